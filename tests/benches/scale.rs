//! `cargo xtask bench scale`: guard's cost as its lines grow.
//!
//! 1. In process: enqueue + dispatch per request at 10 to 100,000 waiting (one slot, steady
//!    state: each request joins the end as the head starts), first come first served and with
//!    100 fair flows; a waiter leaving from the middle; bytes per waiter (ticket and place in
//!    line). Goal: within 2x from 10 to 100,000; at most 2 KiB per waiter.
//! 2. A guard process with real connections: RSS for 10,000 idle keep-alive connections
//!    (goal: 64 MiB), then for 10,000 requests waiting on them (goal: 2 KiB each beyond its
//!    connection and its body).
//!
//! `cargo xtask bench scale lines` (or `connections`) runs one part.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::{
        Arc,
        atomic::{AtomicIsize, Ordering},
    },
    time::{Duration, Instant},
};

use guard::{
    config::{ClassConfig, Config},
    metrics::Metrics,
    queue::{Job, Permit, Scheduler, Ticket},
};
use guard_tests::{rss_bytes, servers::GuardProcess};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

/// Counts the bytes allocated and not yet freed, to weigh a waiter.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout contract is passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const DEPTHS: [usize; 5] = [10, 100, 1_000, 10_000, 100_000];
const CYCLES: usize = 20_000;
const CONNECTIONS: usize = 10_000;
/// Idle connections guard keeps in hyper (`server.ready_connections`, its default).
const READY: usize = 256;

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let wanted = guard_tests::bench_parts();
    runtime.block_on(async {
        if wanted("lines") {
            lines().await;
        }
        if wanted("connections") {
            connections().await;
        }
    });
}

fn scheduler() -> Arc<Scheduler> {
    let mut config = Config::default();
    config.upstream.max_concurrency = 1;
    config.estimate.initial_service_ms = 1_000;
    let mut batch = ClassConfig::new(10, 200_000, None);
    batch.max_queue_per_flow = None;
    config.class.insert("batch".to_owned(), batch);
    Scheduler::new(&config, Metrics::new())
}

fn job(flow: u64) -> Job {
    Job {
        class: "batch".to_owned(),
        flow,
        ..Job::default()
    }
}

/// A line of `depth` waiting behind one running request, kept at that depth.
struct Steady {
    scheduler: Arc<Scheduler>,
    running: Option<Permit>,
    waiting: std::collections::VecDeque<Ticket>,
    flows: u64,
    next: u64,
}

impl Steady {
    async fn new(depth: usize, flows: u64) -> Self {
        let scheduler = scheduler();
        let first = scheduler.enqueue(job(0)).expect("room");
        let running = Some(first.wait().await.expect("the free slot"));
        let mut steady = Self {
            scheduler,
            running,
            waiting: std::collections::VecDeque::new(),
            flows,
            next: 0,
        };
        for _ in 0..depth {
            steady.join();
        }
        steady
    }

    fn join(&mut self) {
        self.next += 1;
        let flow = if self.flows > 1 {
            1 + self.next % self.flows
        } else {
            0
        };
        let ticket = self.scheduler.enqueue(job(flow)).expect("room");
        self.waiting.push_back(ticket);
    }

    /// One request joins, the running one ends, the next starts.
    async fn cycle(&mut self) {
        self.join();
        if let Some(permit) = self.running.take() {
            permit.release();
        }
        // Fair order may start any flow's head: find the ticket that was granted.
        let at = self
            .waiting
            .iter()
            .position(Ticket::is_granted)
            .expect("one started");
        let ticket = self.waiting.remove(at).expect("there");
        self.running = Some(ticket.wait().await.expect("granted"));
    }
}

async fn per_cycle(depth: usize, flows: u64) -> Duration {
    let mut steady = Steady::new(depth, flows).await;
    let started = Instant::now();
    for _ in 0..CYCLES {
        steady.cycle().await;
    }
    started.elapsed() / CYCLES as u32
}

/// A waiter in the middle of the line leaves (its client went away).
async fn leave_from_middle(depth: usize) -> Duration {
    let mut steady = Steady::new(depth, 1).await;
    let started = Instant::now();
    for _ in 0..CYCLES {
        let middle = steady.waiting.len() / 2;
        // Taken from the bench's own list in O(1); dropping it is what is timed.
        drop(steady.waiting.swap_remove_back(middle));
        steady.join();
    }
    started.elapsed() / CYCLES as u32
}

/// Bytes held per waiting request: its ticket and its place in the line.
async fn bytes_per_waiter(depth: usize) -> f64 {
    let mut steady = Steady::new(0, 1).await;
    let before = LIVE.load(Ordering::Relaxed);
    steady.waiting.reserve(depth);
    let reserved = LIVE.load(Ordering::Relaxed);
    for _ in 0..depth {
        steady.join();
    }
    // The bench's own list of tickets is not guard's: count the tickets, not the list.
    let after = LIVE.load(Ordering::Relaxed) - (reserved - before);
    (after - before) as f64 / depth as f64
}

async fn lines() {
    println!(
        "1. enqueue + dispatch per request against the line's depth (one slot, steady state, {CYCLES} cycles):"
    );
    println!(
        "   {:>8} {:>14} {:>20} {:>22} {:>16}",
        "waiting", "FIFO (ns)", "100 fair flows (ns)", "leave from middle (ns)", "bytes per waiter"
    );
    let mut rows = Vec::new();
    for depth in DEPTHS {
        let fifo = per_cycle(depth, 1).await;
        let fair = per_cycle(depth, 100).await;
        let leave = leave_from_middle(depth).await;
        let bytes = bytes_per_waiter(depth).await;
        println!(
            "   {depth:>8} {:>14} {:>20} {:>22} {:>16.0}",
            fifo.as_nanos(),
            fair.as_nanos(),
            leave.as_nanos(),
            bytes
        );
        rows.push((fifo, fair, leave, bytes));
    }
    let (first, last) = (rows[0], rows[rows.len() - 1]);
    let ratio = |a: Duration, b: Duration| b.as_secs_f64() / a.as_secs_f64();
    println!(
        "   100,000 against 10: FIFO {:.2}x, fair {:.2}x, leave {:.2}x (goal <= 2x); bytes per waiter at 100,000: {:.0} (goal <= 2048)",
        ratio(first.0, last.0),
        ratio(first.1, last.1),
        ratio(first.2, last.2),
        last.3
    );
}

async fn connections() {
    raise_nofile();
    let upstream = guard_tests::http::empty_json_on_get().await;
    let guard = GuardProcess::start(
        upstream,
        "ollama",
        &format!(
            "[server]\nmax_connections = 20000\nready_connections = {READY}\n[upstream]\nmax_concurrency = 1\n[class.interactive]\nmax_queue = 20000\n[class.batch]\npriority = 10\nmax_queue = 1\n"
        ),
    );
    let idle = rss_bytes(guard.pid());
    let mut clients = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        clients.push(TcpStream::connect(guard.listen).await.expect("connect"));
    }
    guard
        .wait_for_metric("guard_connections", CONNECTIONS as f64)
        .await;
    // Each waits for its first request outside hyper.
    guard
        .wait_for_metric("guard_connections_parked", CONNECTIONS as f64)
        .await;
    let fresh = rss_bytes(guard.pid());
    // One request and its answer on each: a kept-alive connection, as a client leaves it.
    let get = b"GET /api/tags HTTP/1.1\r\nhost: g\r\n\r\n";
    for client in &mut clients {
        client.write_all(get).await.expect("send");
        let mut answer = Vec::new();
        let mut buf = [0u8; 1024];
        while !answer.ends_with(b"{}") {
            let n = client.read(&mut buf).await.expect("answer");
            assert!(n > 0, "guard closed a kept-alive connection");
            answer.extend_from_slice(&buf[..n]);
        }
    }
    // Parked again, between requests, all but the first READY (they stay in hyper).
    guard
        .wait_for_metric("guard_connections_parked", (CONNECTIONS - READY) as f64)
        .await;
    let connected = rss_bytes(guard.pid());
    let body = r#"{"model":"m","prompt":"x"}"#;
    let request = format!(
        "POST /api/generate HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    for client in &mut clients {
        client.write_all(request.as_bytes()).await.expect("send");
    }
    guard
        .wait_for_metric(
            "guard_queue_depth{class=\"interactive\"}",
            (CONNECTIONS - 1) as f64,
        )
        .await;
    let waiting = rss_bytes(guard.pid());
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!("2. guard's RSS with real connections ({CONNECTIONS} clients):");
    println!(
        "   idle {:.1} MiB; {CONNECTIONS} connections that sent nothing yet +{:.1} MiB ({:.0} B each)",
        mib(idle),
        mib(fresh.saturating_sub(idle)),
        fresh.saturating_sub(idle) as f64 / CONNECTIONS as f64
    );
    println!(
        "   the same after one request and answer each (idle keep-alive; {READY} kept in hyper, the rest parked) +{:.1} MiB over idle ({:.0} B each; goal: 64 MiB in all)",
        mib(connected.saturating_sub(idle)),
        connected.saturating_sub(idle) as f64 / CONNECTIONS as f64
    );
    println!(
        "   a request waiting on each: +{:.1} MiB more ({:.0} B each beyond its connection, body {} B; goal: 2 KiB)",
        mib(waiting.saturating_sub(connected)),
        waiting.saturating_sub(connected) as f64 / CONNECTIONS as f64,
        body.len()
    );
    drop(clients);
}

/// Lets this process hold every client connection.
fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}
