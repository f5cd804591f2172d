//! Waiting for a state of the system under test: polled, with a bound that fails the test.

use std::time::Duration;

use tokio::time::Instant;

/// How long a test waits for a state of the system under test; reaching it fails.
pub const STATE_BOUND: Duration = Duration::from_secs(30);

/// How a wait looks at its condition.
#[derive(Clone, Copy, Debug)]
pub struct Polling {
    /// Reaching it fails the test.
    pub bound: Duration,
    /// The sleep between looks.
    pub every: Duration,
    /// Before each sleep, how many times the other tasks run and the condition is looked at
    /// again.
    pub yields: u32,
}

impl Polling {
    /// Real servers and sockets: [`STATE_BOUND`], a look every 5 ms.
    pub const STATE: Self = Self::within(STATE_BOUND, Duration::from_millis(5));

    /// Under tokio's paused clock: every task runs before time moves on, so the wait ends at
    /// the very instant the condition came true; two minutes of virtual time at most.
    pub const PAUSED: Self = Self {
        bound: Duration::from_secs(120),
        every: Duration::from_millis(1),
        yields: 64,
    };

    /// A look every `every`, for at most `bound`.
    pub const fn within(bound: Duration, every: Duration) -> Self {
        Self {
            bound,
            every,
            yields: 0,
        }
    }
}

/// Waits for `condition` as [`Polling::STATE`] says; `what` names it when it never holds.
pub async fn until(what: &str, condition: impl AsyncFnMut() -> bool) {
    until_with(Polling::STATE, what, condition).await;
}

/// Waits for `condition` as `polling` says; `what` names it when it never holds.
pub async fn until_with(polling: Polling, what: &str, condition: impl AsyncFnMut() -> bool) {
    if let Err(never) = try_until_with(polling, what, condition).await {
        panic!("{never}");
    }
}

/// Waits for `condition` as `polling` says, and says so where it never holds (for a check
/// whose failure is itself expected, as in a test that breaks what it checks on purpose).
pub async fn try_until_with(
    polling: Polling,
    what: &str,
    mut condition: impl AsyncFnMut() -> bool,
) -> Result<(), String> {
    let started = Instant::now();
    while !condition().await {
        for _ in 0..polling.yields {
            tokio::task::yield_now().await;
            if condition().await {
                return Ok(());
            }
        }
        if started.elapsed() >= polling.bound {
            return Err(format!("never within {:?}: {what}", polling.bound));
        }
        tokio::time::sleep(polling.every).await;
    }
    Ok(())
}
