//! The wall clock read off the monotonic one: a line's time and its duration come from one
//! reading of the clock, not two.

use std::{cell::Cell, time::Duration};

/// How long a thread's pairing of the two clocks is used before it is read again: a step of
/// the wall clock (settimeofday, an NTP step) shows in the log within this long. NTP's slew
/// moves both clocks alike.
const PAIRED_FOR: Duration = Duration::from_secs(1);

thread_local! {
    /// This thread's last reading of both clocks.
    static PAIR: Cell<Option<(std::time::Instant, jiff::Timestamp)>> = const { Cell::new(None) };
}

/// The wall clock's time at `at`, a monotonic instant read lately (tokio's converts, where
/// its clock is not paused).
pub fn wall(at: std::time::Instant) -> jiff::Timestamp {
    let (mono, time) = PAIR.with(|pair| match pair.get() {
        Some((mono, time)) if at >= mono && at - mono < PAIRED_FOR => (mono, time),
        _ => {
            let read = (std::time::Instant::now(), jiff::Timestamp::now());
            pair.set(Some(read));
            read
        }
    });
    // Signed: a pairing read just now is later than `at`.
    let nanos = |later: std::time::Instant, earlier| {
        i64::try_from(later.duration_since(earlier).as_nanos()).unwrap_or(i64::MAX)
    };
    let offset = match at >= mono {
        true => nanos(at, mono),
        false => -nanos(mono, at),
    };
    time.checked_add(jiff::SignedDuration::from_nanos(offset))
        .unwrap_or(time)
}

#[cfg(test)]
mod tests {
    use super::wall;

    /// The time read off the monotonic clock falls between two readings of the wall clock
    /// taken around it (for a new pairing and for one kept).
    #[test]
    fn the_wall_time_of_an_instant_falls_between_the_wall_clock_read_around_it() {
        for _ in 0..3 {
            let before = jiff::Timestamp::now();
            let at = std::time::Instant::now();
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
