//! The threads client connections are served on: one single-threaded runtime per CPU, each
//! connection (and every task its requests spawn) on one of them, as nginx's workers are.
//!
//! On the shared multi-threaded runtime a request's tasks (hyper's connection, the request's
//! owner, the upstream exchange) were woken across threads: about one futex wake and one
//! more context switch per request, a fifth of guard's CPU per request (docs/design.md §6b).
//! Here only the hand-over of a new connection, and a dispatch that wakes a waiter on another
//! thread, cross threads.

use std::{
    cell::Cell,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

thread_local! {
    /// The serving thread this is, on a serving thread.
    static INDEX: Cell<Option<usize>> = const { Cell::new(None) };
    /// This serving thread's anchor timer, on a serving thread.
    static ANCHOR: Arc<Anchor> = Arc::new(Anchor::default());
}

/// How far ahead a serving thread's anchor timer lies, at most: less than every deadline a
/// request arms (the shortest, a class's `deadline_ms`, is 1 ms or more but in practice
/// seconds; the head, body and idle limits are seconds).
const ANCHOR_PERIOD: Duration = Duration::from_millis(500);

/// How many serving threads `Workers::per_cpu` starts.
pub fn per_cpu_count() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// The index of the serving thread this code runs on; None elsewhere.
pub fn current() -> Option<usize> {
    INDEX.with(Cell::get)
}

use tokio::{runtime::Handle, sync::oneshot};

/// Why the serving threads could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot start serving thread {index}")]
pub struct WorkersError {
    index: usize,
    #[source]
    source: std::io::Error,
}

/// The serving threads; dropping this stops them (their tasks are dropped, so requests still
/// on them conclude as failed).
pub struct Workers {
    threads: Vec<Worker>,
    next: AtomicUsize,
}

struct Worker {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Workers {
    /// One thread per CPU this process may run on.
    pub fn per_cpu() -> Result<Self, WorkersError> {
        Self::start(per_cpu_count())
    }

    pub fn start(count: usize) -> Result<Self, WorkersError> {
        let threads = (0..count.max(1))
            .map(Worker::start)
            .collect::<Result<_, _>>()?;
        Ok(Self {
            threads,
            next: AtomicUsize::new(0),
        })
    }

    /// The runtime the next connection goes to, in turn.
    pub fn next(&self) -> &Handle {
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        &self.threads[turn % self.threads.len()].handle
    }
}

impl Worker {
    fn start(index: usize) -> Result<Self, WorkersError> {
        let error = |source| WorkersError { index, source };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(error)?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("guard-serve-{index}"))
            .spawn(move || {
                INDEX.with(|own| own.set(Some(index)));
                // Runs the connections' tasks until told to stop (or the sender is gone).
                runtime.block_on(async {
                    let anchor = tokio::spawn(ANCHOR.with(Arc::clone).hold());
                    let _ = stopped.await;
                    anchor.abort();
                });
            })
            .map_err(error)?;
        Ok(Self {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

/// A timer a serving thread keeps armed while it has connections, never more than
/// `ANCHOR_PERIOD` ahead.
///
/// tokio's timer, arming a deadline earlier than any its thread would wake for, wakes the
/// thread's driver with a write to an eventfd, even when the thread is awake and is the one
/// arming it. Every request arms deadlines (hyper's head timeout, the park's), so on a thread
/// with no earlier one each request paid two such writes and a spurious return from
/// `epoll_wait`. With the anchor armed, each request's deadline lies after it.
#[derive(Default)]
struct Anchor {
    /// Connections open on this thread.
    open: AtomicUsize,
    /// The first connection came.
    resumed: tokio::sync::Notify,
}

impl Anchor {
    /// Keeps the timer armed while the thread has connections; idle, it sleeps untimed.
    async fn hold(self: Arc<Self>) {
        loop {
            if self.open.load(Ordering::Relaxed) == 0 {
                self.resumed.notified().await;
            }
            tokio::time::sleep(ANCHOR_PERIOD).await;
        }
    }
}

/// A connection open on this serving thread, for as long as it lives.
pub struct OpenHere(Arc<Anchor>);

impl OpenHere {
    /// Counts a connection open on the thread this runs on.
    pub fn count() -> Self {
        let anchor = ANCHOR.with(Arc::clone);
        if anchor.open.fetch_add(1, Ordering::Relaxed) == 0 {
            anchor.resumed.notify_one();
        }
        Self(anchor)
    }
}

impl Drop for OpenHere {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_go_to_each_thread_in_turn_and_run_there() {
        let workers = Workers::start(2).expect("threads");
        let names: Vec<String> = (0..4)
            .map(|_| {
                let (tx, rx) = std::sync::mpsc::channel();
                workers.next().spawn(async move {
                    // A task the connection spawns stays on its thread.
                    let inner = tokio::spawn(async {
                        let name = std::thread::current().name().map(str::to_owned);
                        assert_eq!(name, current().map(|i| format!("guard-serve-{i}")));
                        name
                    });
                    let _ = tx.send(inner.await.ok().flatten());
                });
                rx.recv().expect("ran").expect("a named thread")
            })
            .collect();
        assert_eq!(
            names,
            [
                "guard-serve-0",
                "guard-serve-1",
                "guard-serve-0",
                "guard-serve-1"
            ]
        );
    }

    /// Writes to each of this process's eventfds so far (tokio's reactors are woken through
    /// them, and nothing reads them back but an overflow).
    fn eventfd_writes() -> std::collections::HashMap<i32, u64> {
        let me = procfs::process::Process::myself().expect("/proc/self");
        me.fd()
            .expect("fds")
            .flatten()
            .filter(|fd| {
                matches!(&fd.target, procfs::process::FDTarget::AnonInode(kind) if kind == "[eventfd]")
            })
            .filter_map(|fd| {
                let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.fd)).ok()?;
                let line = info.lines().find(|l| l.starts_with("eventfd-count:"))?;
                let count = line.trim_start_matches("eventfd-count:").trim();
                Some((fd.fd, u64::from_str_radix(count, 16).ok()?))
            })
            .collect()
    }

    #[test]
    fn with_a_connection_open_arming_later_deadlines_does_not_wake_the_reactor() {
        use futures_util::FutureExt as _;
        let workers = Workers::start(1).expect("threads");
        let (tx, rx) = std::sync::mpsc::channel();
        workers.next().spawn(async move {
            let _open = OpenHere::count();
            // The anchor runs and arms its sleep; the thread's driver then parks (a yield
            // parks it with no timeout) and notes the anchor as its next timer.
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
            let before = eventfd_writes();
            // Armed as a request's deadlines are (each polled once, kept), all later than it.
            let armed: Vec<_> = (0..100)
                .map(|_| {
                    let mut sleep = Box::pin(tokio::time::sleep(ANCHOR_PERIOD * 4));
                    assert!((&mut sleep).now_or_never().is_none());
                    sleep
                })
                .collect();
            let _ = tx.send((before, eventfd_writes()));
            drop(armed);
        });
        let (before, after) = rx.recv().expect("ran");
        // Without the anchor each of them wrote to this thread's eventfd: 100 on one of them.
        // (Other tests' runtimes may write to theirs meanwhile: a few.)
        let most = after
            .iter()
            .map(|(fd, n)| n - before.get(fd).copied().unwrap_or(0))
            .max();
        assert!(most.unwrap_or(0) < 50, "{before:?} -> {after:?}");
    }

    #[test]
    fn dropping_the_workers_stops_their_threads_and_drops_their_tasks() {
        let workers = Workers::start(1).expect("threads");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        workers.next().spawn(async move {
            let _held = tx;
            std::future::pending::<()>().await;
        });
        drop(workers);
        // The task was dropped with its runtime: its sender is gone.
        assert!(rx.recv().is_err());
    }
}
