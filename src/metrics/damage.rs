//! What the store's recovery found damaged, kept for the status page.

use std::sync::Mutex;

/// Ranges kept (the counters count them all).
pub(super) const KEPT: usize = 100;

/// One damaged range of a segment file, or the torn tail recovery cut.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Damaged {
    /// The segment file.
    pub file: String,
    /// First byte.
    pub from: u64,
    /// Byte after the last.
    pub to: u64,
    /// What was there (`torn` for the cut torn tail: not damage).
    pub what: &'static str,
    /// What it costs.
    pub cost: &'static str,
}

/// The ranges of the last recovery, first ones first.
#[derive(Debug, Default)]
pub struct DamageList(Mutex<Vec<Damaged>>);

impl DamageList {
    /// Adds a range, up to `KEPT`.
    pub fn push(&self, range: Damaged) {
        let mut list = self.0.lock().expect("damage list lock");
        if list.len() < KEPT {
            list.push(range);
        }
    }

    /// The ranges kept.
    pub fn all(&self) -> Vec<Damaged> {
        self.0.lock().expect("damage list lock").clone()
    }
}
