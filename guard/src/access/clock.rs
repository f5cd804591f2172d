//! The wall clock read off the monotonic one: a line's time and its duration come from one
//! reading of the clock, not two.

use std::{cell::Cell, time::Duration, time::Instant};

/// How long a thread's pairing of the two clocks is used before it is read again: a step of
/// the wall clock (settimeofday, an NTP step) shows in the log within this long. NTP's slew
/// moves both clocks alike.
const PAIRED_FOR: Duration = Duration::from_secs(1);

/// One reading of both clocks.
type Pair = (Instant, jiff::Timestamp);

thread_local! {
    /// This thread's last reading of both clocks.
    static PAIR: Cell<Option<Pair>> = const { Cell::new(None) };
}

/// The wall clock's time at `at`, a monotonic instant read lately (tokio's converts, where
/// its clock is not paused).
pub fn wall(at: Instant) -> jiff::Timestamp {
    let pair = PAIR.with(|kept| match kept.get() {
        Some(pair) if fresh(pair, at) => pair,
        _ => {
            let read = (Instant::now(), jiff::Timestamp::now());
            kept.set(Some(read));
            read
        }
    });
    on(pair, at)
}

/// Whether `pair` was read at most PAIRED_FOR before `at`.
fn fresh((mono, _): Pair, at: Instant) -> bool {
    at.checked_duration_since(mono)
        .is_some_and(|age| age < PAIRED_FOR)
}

/// The wall time of `at` by `pair` (a pairing read just now is later than `at`).
fn on((mono, time): Pair, at: Instant) -> jiff::Timestamp {
    let moved = match at.checked_duration_since(mono) {
        Some(after) => time.checked_add(after),
        None => time.checked_sub(mono - at),
    };
    moved.unwrap_or(time)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{PAIRED_FOR, fresh, on, wall};

    /// An instant after the pairing, and one before it, are the pairing's wall time moved by
    /// exactly their distance from it; a pairing is kept for PAIRED_FOR, no longer.
    #[test]
    fn an_instant_is_the_pairings_wall_time_moved_by_its_distance() {
        let mono = Instant::now();
        let time = jiff::Timestamp::new(1_765_000_000, 123_456_789).expect("a time");
        let pair = (mono, time);
        let later = mono + Duration::from_millis(250) + Duration::from_nanos(7);
        assert_eq!(
            on(pair, later),
            jiff::Timestamp::new(1_765_000_000, 373_456_796).expect("a time")
        );
        let earlier = mono - Duration::from_millis(3);
        assert_eq!(
            on(pair, earlier),
            jiff::Timestamp::new(1_765_000_000, 120_456_789).expect("a time")
        );
        assert!(fresh(pair, later));
        assert!(
            !fresh(pair, earlier),
            "an instant before the pairing reads anew"
        );
        assert!(
            !fresh(pair, mono + PAIRED_FOR),
            "a pairing a second old reads anew"
        );
    }

    /// Through the thread's pairing, the time falls between two readings of the wall clock
    /// taken around the instant.
    #[test]
    fn the_wall_time_of_an_instant_falls_between_the_wall_clock_read_around_it() {
        for _ in 0..3 {
            let before = jiff::Timestamp::now();
            let at = Instant::now();
            let time = wall(at);
            let after = jiff::Timestamp::now();
            // The pairing's two reads are a few microseconds apart at most.
            let slack = jiff::SignedDuration::from_millis(1);
            assert!(
                time >= before - slack && time <= after + slack,
                "{before} {time} {after}"
            );
        }
    }
}
