//! Injected I/O failures for the store's tests: a write that stops part way
//! with ENOSPC, an fsync that fails with EIO, a disk that others fill.

use std::fs::File;
use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Failures armed for the next commit.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    /// The next write puts this many bytes in the file, then fails.
    pub write_then_fail: Option<usize>,
    /// The next fsync fails (after the write went through).
    pub fail_sync: bool,
    /// Free disk space every commit finds from now on.
    pub free_bytes: Option<u64>,
    /// A disk shared with the test, which plays the other processes on it:
    /// its free bytes. Every write takes its bytes from it, or fails with
    /// ENOSPC (writing nothing) when they are not there; the store's
    /// reserve takes its bytes from it and gives them back. Commits read it
    /// as the free space.
    pub disk: Option<Arc<AtomicU64>>,
}

impl Faults {
    pub(crate) fn before_write(&mut self, mut file: &File, pending: &[u8]) -> Option<io::Error> {
        if let Some(n) = self.write_then_fail.take() {
            let _ = file.write_all(&pending[..n.min(pending.len())]);
            return Some(io::Error::from_raw_os_error(28)); // ENOSPC
        }
        let disk = self.disk.as_ref()?;
        let len = pending.len() as u64;
        let taken = disk.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |free| {
            free.checked_sub(len)
        });
        taken.is_err().then(|| io::Error::from_raw_os_error(28)) // ENOSPC
    }

    pub(crate) fn before_sync(&mut self) -> Option<io::Error> {
        std::mem::take(&mut self.fail_sync).then(|| io::Error::from_raw_os_error(5))
        // EIO
    }
}
