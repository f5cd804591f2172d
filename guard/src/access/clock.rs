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
    PAIR.with(|kept| {
        if let Some(pair) = kept.get()
            && let Some(after) = fresh(pair, at)
        {
            return later(pair.1, after);
        }
        let read = (Instant::now(), jiff::Timestamp::now());
        kept.set(Some(read));
        on(read, at)
    })
}

/// How long after `pair`'s reading `at` is, where that is under PAIRED_FOR.
fn fresh((mono, _): Pair, at: Instant) -> Option<Duration> {
    at.checked_duration_since(mono)
        .filter(|after| *after < PAIRED_FOR)
}

/// The wall time of `at` by `pair` (a pairing read just now is later than `at`).
fn on((mono, time): Pair, at: Instant) -> jiff::Timestamp {
    match at.checked_duration_since(mono) {
        Some(after) => later(time, after),
        None => time.checked_sub(mono - at).unwrap_or(time),
    }
}

/// `time` moved on by `after`: the seconds and the nanoseconds added apart (a line's time
/// is a few instructions, not jiff's arithmetic over every unit); before 1970, or beyond
/// jiff's range, by jiff.
fn later(time: jiff::Timestamp, after: Duration) -> jiff::Timestamp {
    const NANOS: i32 = 1_000_000_000;
    let by_jiff = || time.checked_add(after).unwrap_or(time);
    if time.as_second() < 0 {
        return by_jiff();
    }
    let nanos = time.subsec_nanosecond() + after.subsec_nanos() as i32;
    let (carry, nanos) = if nanos >= NANOS {
        (1, nanos - NANOS)
    } else {
        (0, nanos)
    };
    i64::try_from(after.as_secs())
        .ok()
        .and_then(|secs| time.as_second().checked_add(secs)?.checked_add(carry))
        .and_then(|second| jiff::Timestamp::new(second, nanos).ok())
        .unwrap_or_else(by_jiff)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{PAIRED_FOR, fresh, later, on, wall};

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
        assert_eq!(fresh(pair, later), Some(later - mono));
        assert_eq!(
            fresh(pair, earlier),
            None,
            "an instant before the pairing reads anew"
        );
        assert_eq!(
            fresh(pair, mono + PAIRED_FOR),
            None,
            "a pairing a second old reads anew"
        );
    }

    /// Seconds and nanoseconds added apart make what jiff's own arithmetic makes: across a
    /// second's end, before 1970, and at the end of jiff's range (where the time stays).
    #[test]
    fn a_time_moved_on_is_what_jiff_adds() {
        let times = [
            (1_765_000_000, 0),
            (1_765_000_000, 999_999_999),
            (1_765_000_000, 400_000_001),
            (0, 0),
            (-1, -1),
            (-100, -999_999_999),
            (jiff::Timestamp::MAX.as_second(), 999_999_999),
            (jiff::Timestamp::MAX.as_second() - 1, 0),
        ];
        let afters = [0, 1, 599_999_999, 600_000_000, 999_999_999, 1_000_000_000]
            .map(Duration::from_nanos)
            .into_iter()
            .chain([Duration::from_secs(2), Duration::new(86_400, 123)])
            .chain([Duration::new(u64::MAX, 999_999_999)]);
        for after in afters {
            for (second, nanos) in times {
                let time = jiff::Timestamp::new(second, nanos).expect("a time");
                let jiffs = time.checked_add(after).unwrap_or(time);
                assert_eq!(later(time, after), jiffs, "{time} + {after:?}");
            }
        }
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
