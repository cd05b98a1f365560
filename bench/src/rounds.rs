//! Alternating rounds: every side of a comparison (direct, through nackd,
//! through HAProxy) measured in turn, round after round, so a machine whose
//! load drifts during the run loads every side alike.

use std::future::Future;
use std::time::Duration;

use super::{BenchResult, Target, Targets};

/// Which way the clients connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Straight to RabbitMQ.
    Direct,
    /// Through nackd.
    Nackd,
    /// Through HAProxy in TCP mode (the baseline of issue 24).
    Haproxy,
    /// Through another nackd build (`--baseline-nackd`): before and after
    /// a change, side by side in one run.
    Baseline,
}

impl Side {
    /// Column label.
    pub fn label(self) -> &'static str {
        match self {
            Side::Direct => "direct",
            Side::Nackd => "nackd",
            Side::Haproxy => "haproxy",
            Side::Baseline => "baseline",
        }
    }
}

/// Per-round results of every side, in round order.
#[derive(Debug)]
pub struct Sides<T> {
    sides: Vec<(Side, Vec<T>)>,
}

impl<T> Sides<T> {
    fn new(sides: &[Side]) -> Self {
        Self {
            sides: sides.iter().map(|&s| (s, Vec::new())).collect(),
        }
    }

    fn push(&mut self, side: Side, result: T) {
        if let Some((_, rounds)) = self.sides.iter_mut().find(|(s, _)| *s == side) {
            rounds.push(result);
        }
    }

    /// The rounds of `side`, if it was measured.
    pub fn of(&self, side: Side) -> Option<&[T]> {
        self.sides
            .iter()
            .find(|(s, _)| *s == side)
            .map(|(_, r)| r.as_slice())
    }

    /// Every side measured and its rounds, in the order the sides were given.
    pub fn iter(&self) -> impl Iterator<Item = (Side, &[T])> {
        self.sides.iter().map(|(s, r)| (*s, r.as_slice()))
    }
}

/// The order of the sides in round `round` (0-based): `sides` rotated by
/// the round number, so each side goes first, second, ... equally often
/// and none always follows the same one.
pub fn round_order(sides: &[Side], round: usize) -> Vec<Side> {
    let mut order = sides.to_vec();
    if !order.is_empty() {
        let by = round % order.len();
        order.rotate_left(by);
    }
    order
}

/// Runs `round` for every side of `targets` in turn, `rounds` times each
/// (the order rotating by round, see [`round_order`]), with a pause between
/// runs so one run's queue deletion does not load the next.
pub async fn alternate<T, F, Fut>(
    rounds: usize,
    targets: &Targets,
    mut round: F,
) -> BenchResult<Sides<T>>
where
    F: FnMut(Target) -> Fut,
    Fut: Future<Output = BenchResult<T>>,
{
    let sides = targets.sides();
    let mut results = Sides::new(&sides);
    for n in 0..rounds {
        for side in round_order(&sides, n) {
            let result = round(targets.target(side))
                .await
                .map_err(|e| format!("{} round {}: {e}", side.label(), n + 1))?;
            results.push(side, result);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    const THREE: [Side; 3] = [Side::Direct, Side::Nackd, Side::Haproxy];

    #[test]
    fn every_round_runs_every_side_once_and_the_first_rotates() {
        let orders: Vec<Vec<Side>> = (0..6).map(|r| round_order(&THREE, r)).collect();
        for order in &orders {
            for side in THREE {
                assert_eq!(order.iter().filter(|&&s| s == side).count(), 1);
            }
        }
        assert_eq!(orders[0], THREE);
        assert_eq!(orders[1], [Side::Nackd, Side::Haproxy, Side::Direct]);
        assert_eq!(orders[2], [Side::Haproxy, Side::Direct, Side::Nackd]);
        assert_eq!(orders[3], orders[0]);
        // Over three rounds each side stands once in each position.
        for position in 0..3 {
            let at: Vec<Side> = orders[..3].iter().map(|o| o[position]).collect();
            for side in THREE {
                assert!(at.contains(&side), "position {position}: {at:?}");
            }
        }
    }

    #[test]
    fn two_sides_take_turns_going_first() {
        let two = [Side::Direct, Side::Nackd];
        assert_eq!(round_order(&two, 0), two);
        assert_eq!(round_order(&two, 1), [Side::Nackd, Side::Direct]);
        assert!(round_order(&[], 3).is_empty());
    }

    #[test]
    fn results_are_kept_per_side_in_round_order() {
        let mut sides = Sides::new(&THREE);
        for (n, side) in (0..3).flat_map(|r| round_order(&THREE, r)).enumerate() {
            sides.push(side, n);
        }
        assert_eq!(sides.of(Side::Direct), Some(&[0, 5, 7][..]));
        assert_eq!(sides.of(Side::Nackd), Some(&[1, 3, 8][..]));
        assert_eq!(sides.of(Side::Haproxy), Some(&[2, 4, 6][..]));
        let labels: Vec<Side> = sides.iter().map(|(s, _)| s).collect();
        assert_eq!(labels, THREE);
    }
}
