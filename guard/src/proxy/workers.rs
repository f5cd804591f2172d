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
    sync::atomic::{AtomicUsize, Ordering},
    thread::JoinHandle,
};

thread_local! {
    /// The serving thread this is, on a serving thread.
    static INDEX: Cell<Option<usize>> = const { Cell::new(None) };
}

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
                let _ = runtime.block_on(stopped);
            })
            .map_err(error)?;
        Ok(Self {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
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
