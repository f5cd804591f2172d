//! Part 1 of `bench proxy`: one table, each line measured for every column in turn in one
//! run, so that drift in the machine's load falls on all alike.

use std::{
    convert::Infallible,
    net::SocketAddr,
    pin::Pin,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bytes::Bytes;
use guard_tests::{
    peers::{CpuTime, Load, Peer, Wrk, cpu_run_time, cpu_time},
    servers::GuardProcess,
};
use http_body_util::{BodyExt as _, Full, combinators::BoxBody};
use hyper::{Request, Response, body::Frame, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;

const COLUMNS: [&str; 5] = ["direct", "nginx", "HAProxy", "guard queued", "guard pass"];
const CLIENTS: [usize; 4] = [1, 16, 64, 256];
const FRAMES: usize = 10_000;
const BULK: usize = 1 << 30;
const CHUNK: usize = 64 << 10;
const BULK_TRIES: usize = 3;
const FRAME_TRIES: usize = 3;
/// Between two frames of the paced stream: tokens come one by one.
const FRAME_PACE: Duration = Duration::from_micros(50);

/// The request every column gets in the fixed-answer lines.
pub const CHAT: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"Say hi."}],"stream":false}"#;
/// The fixed answer: what Ollama says to it.
pub const ANSWER: &str = r#"{"model":"m","created_at":"2026-12-04T00:00:00Z","message":{"role":"assistant","content":"Hi!"},"done_reason":"stop","done":true,"total_duration":1000000,"load_duration":1000,"prompt_eval_count":9,"prompt_eval_duration":100000,"eval_count":3,"eval_duration":300000}"#;
pub const TAGS: &str = r#"{"models":[{"name":"m","model":"m","digest":"0"}]}"#;
pub const PS: &str = r#"{"models":[{"name":"m","model":"m","size":1000,"size_vram":1000}]}"#;

/// guard with room for every client of the table: neither its queue nor its pass-through
/// limit shapes the figures.
pub const GUARD: &str = "[upstream]\nmax_concurrency = 1024\nmax_passthrough = 1024\n\
                     [class.interactive]\nmax_queue = 10000\n[class.batch]\npriority = 10\nmax_queue = 1\n";

/// The proxies in front of one upstream.
struct Stage {
    upstream: SocketAddr,
    nginx: Peer,
    haproxy: Peer,
    guard: GuardProcess,
}

impl Stage {
    fn new(upstream: SocketAddr) -> Self {
        Self {
            upstream,
            nginx: Peer::nginx_proxy(upstream),
            haproxy: Peer::haproxy(upstream),
            guard: GuardProcess::start(upstream, "ollama", GUARD),
        }
    }

    /// Each column's address and path; the guard columns differ in path alone (`queued`
    /// goes through a class queue, `pass` does not). None: the column has no such path.
    fn targets<'a>(
        &self,
        queued: Option<&'a str>,
        pass: &'a str,
    ) -> [Option<(SocketAddr, &'a str)>; 5] {
        let same = queued.unwrap_or(pass);
        [
            Some((self.upstream, same)),
            Some((self.nginx.addr, same)),
            Some((self.haproxy.addr, same)),
            queued.map(|path| (self.guard.listen, path)),
            Some((self.guard.listen, pass)),
        ]
    }
}

/// Each load's length: GUARD_BENCH_SECONDS, else 3 s.
fn bench_seconds() -> u64 {
    std::env::var("GUARD_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
}

/// Rounds of `access_log_rows`, each path measured once a round.
const ACCESS_ROUNDS: usize = 7;
/// Each guard's (and nginx's) `wrk` clients.
const ACCESS_CLIENTS: usize = 32;
/// Each `wrk` connection rests this long after each answer (`Wrk::run_paced`).
const ACCESS_PAUSE: Duration = Duration::from_millis(2);
/// The rows of the access log's cost; its goal is read from the paired one.
const ACCESS_OFF: &str = "CPU per request, access log off (us)";
const ACCESS_ON: &str = "  the same, access log on (us)";
const ACCESS_CONTROL: &str = "  a second guard, log off (us)";
const ACCESS_PAIRED: &str = "  on over off, paired (%)";
const ACCESS_NOISE: &str = "  second over first, both off (%)";
const ACCESS_NGINX: &str = "  nginx's JSON log, on over off (%)";

/// `cargo xtask bench proxy access`: the access log's cost alone.
pub async fn access() {
    let seconds = bench_seconds();
    let fixed = Peer::nginx_fixed(&[("/api/tags", TAGS), ("/api/ps", PS)], ANSWER);
    let rows = access_log_rows(fixed.addr, Duration::from_secs(seconds));
    println!(
        "the access log's cost (guards side by side, each under a wrk of its own for {seconds} s, \
         {ACCESS_CLIENTS} clients resting {} ms between requests; medians of {ACCESS_ROUNDS} rounds; queued, \
         pass; nginx in the pass column):",
        ACCESS_PAUSE.as_millis()
    );
    for row in &rows {
        let [queued, pass] = [row.cells[3], row.cells[4].or(row.cells[1])];
        let [queued, pass] = [queued, pass].map(|c| c.map_or("-".into(), |c| format!("{c:.1}")));
        println!("   {:<38}{queued:>10}{pass:>10}", row.label);
    }
    println!("   {}", access_goal(&rows));
}

/// The goal: CPU per request with the access log on within 5 % of it off, on both paths (the
/// median of the rounds' paired ratios).
fn access_goal(rows: &[Row]) -> String {
    let find = |label: &str| rows.iter().find(|r| r.label == label).expect(label);
    let [paired, noise] = [ACCESS_PAIRED, ACCESS_NOISE].map(|label| {
        let row = find(label);
        [row.cells[3], row.cells[4]]
    });
    let met = paired.iter().all(|p| p.is_some_and(|p| p <= 5.0));
    let shown =
        |cells: [Option<f64>; 2]| cells.map(|p| p.map_or("-".into(), |p| format!("{p:+.1} %")));
    format!(
        "CPU per request with the access log on within 5 % of it off: {}: {} (two guards both \
         off: {})",
        shown(paired).join(", "),
        if met { "met" } else { "missed" },
        shown(noise).join(", "),
    )
}

pub async fn run() {
    let seconds = bench_seconds();
    let fixed = Peer::nginx_fixed(&[("/api/tags", TAGS), ("/api/ps", PS)], ANSWER);
    let stage = Stage::new(fixed.addr);
    let mut rows = Vec::new();
    let loads = fixed_loads(&stage, Duration::from_secs(seconds));
    rows.extend(latency_rows(&loads[0]));
    for (clients, loads) in CLIENTS.iter().zip(&loads) {
        rows.extend(load_rows(*clients, loads));
    }
    rows.extend(cpu_rows(&stage, fixed.pid(), Duration::from_secs(seconds)));
    drop(stage);
    rows.extend(access_log_rows(fixed.addr, Duration::from_secs(seconds)));
    let stage = Stage::new(frame_upstream());
    rows.push(frames_row(&stage).await);
    drop(stage);
    let stage = Stage::new(stream_upstream().await);
    rows.extend(bulk_rows(&stage).await);
    print(&rows, seconds);
}

/// `wrk` at each client count, every column in turn.
fn fixed_loads(stage: &Stage, duration: Duration) -> Vec<[Option<Load>; 5]> {
    let targets = stage.targets(Some("/api/chat"), "/api/show");
    // A short load first, so that every proxy's pools and caches are warm.
    for (addr, path) in targets.iter().flatten() {
        let warm = Wrk {
            connections: 16,
            duration: Duration::from_secs(1),
            threads: 2,
        };
        warm.run(*addr, path, CHAT);
    }
    CLIENTS
        .iter()
        .map(|&connections| {
            let wrk = Wrk {
                connections,
                duration,
                threads: 2,
            };
            targets.map(|target| {
                let (addr, path) = target?;
                let load = wrk.run(addr, path, CHAT);
                assert_eq!(load.errors, 0, "{connections} clients to {path}: {load:?}");
                Some(load)
            })
        })
        .collect()
}

/// CPU per request at 64 clients: the upstream's own for direct, each proxy's (all its
/// threads and processes) for the others, and of it what ran in user space and in the
/// kernel. Steadier than req/s on a shared machine.
fn cpu_rows(stage: &Stage, upstream_pid: u32, duration: Duration) -> [Row; 3] {
    let targets = stage.targets(Some("/api/chat"), "/api/show");
    let pids = [
        upstream_pid,
        stage.nginx.pid(),
        stage.haproxy.pid(),
        stage.guard.pid(),
        stage.guard.pid(),
    ];
    let wrk = Wrk {
        connections: 64,
        duration,
        threads: 2,
    };
    let used: [Option<(CpuTime, u64)>; 5] = std::array::from_fn(|i| {
        let (addr, path) = targets[i]?;
        let before = cpu_time(pids[i]);
        let load = wrk.run(addr, path, CHAT);
        let used = cpu_time(pids[i]).since(before);
        assert_eq!(load.errors, 0, "{path}: {load:?}");
        Some((used, load.requests.max(1)))
    });
    let row = |label: &str, part: fn(CpuTime) -> Duration| {
        let cells = used.map(|cell| {
            cell.map(|(cpu, requests)| part(cpu).as_secs_f64() * 1e6 / requests as f64)
        });
        Row::new(label.into(), cells, Better::Lower)
    };
    [
        row("CPU per request (us), 64 clients", CpuTime::total),
        row("  of it in user space (us)", |cpu| cpu.user),
        row("  of it in the kernel (us)", |cpu| cpu.system),
    ]
}

/// What the access log costs: CPU per request of three guards loaded at once, side by side,
/// each by a `wrk` of its own: one without the log, one writing it to a file, and a second
/// without it, whose difference from the first is this machine's noise. Loaded together, a
/// burst of noise falls on all three alike; paced, none of them saturates the machine. Each
/// round measures both paths, then nginx's `proxy_pass` without and with a JSON access log
/// (the peer). The cells are medians over ACCESS_ROUNDS rounds, the paired rows the medians
/// of each round's ratio.
fn access_log_rows(upstream: SocketAddr, duration: Duration) -> [Row; 6] {
    let dir = guard_tests::TempDir::new("guard-bench-access");
    let log = dir.0.join("access.log");
    let on = format!("{GUARD}[log]\naccess = \"{}\"\n", log.display());
    let guards = [GUARD.to_owned(), on, GUARD.to_owned()]
        .map(|config| GuardProcess::start(upstream, "ollama", &config));
    let nginx = [None, Some(dir.0.join("nginx.log"))]
        .map(|log| Peer::nginx_proxy_logged(upstream, log.as_deref()));
    let guard_targets = guards.each_ref().map(|g| (g.pid(), g.listen));
    let nginx_targets = nginx.each_ref().map(|n| (n.pid(), n.addr));
    // [path][guard] -> one figure a round; nginx's [off, on] apart.
    let mut seen: [[Vec<f64>; 3]; 2] = Default::default();
    let mut peer: [Vec<f64>; 2] = Default::default();
    for _ in 0..ACCESS_ROUNDS {
        for (p, path) in ["/api/chat", "/api/show"].iter().enumerate() {
            let figures = side_by_side(&guard_targets, path, duration);
            for (g, figure) in figures.into_iter().enumerate() {
                seen[p][g].push(figure);
            }
        }
        let figures = side_by_side(&nginx_targets, "/api/show", duration);
        for (n, figure) in figures.into_iter().enumerate() {
            peer[n].push(figure);
        }
    }
    let cells = |[queued, pass]: [f64; 2]| [None, None, None, Some(queued), Some(pass)];
    let absolute = |g: usize| cells(seen.each_ref().map(|guards| median(&guards[g])));
    let over_first = |g: usize| cells(seen.each_ref().map(|guards| paired(&guards[g], &guards[0])));
    let mut nginx_row = [None; 5];
    nginx_row[1] = Some(paired(&peer[1], &peer[0]));
    [
        Row::new(ACCESS_OFF.into(), absolute(0), Better::Lower),
        Row::new(ACCESS_ON.into(), absolute(1), Better::Lower),
        Row::new(ACCESS_CONTROL.into(), absolute(2), Better::Lower),
        Row::new(ACCESS_PAIRED.into(), over_first(1), Better::Lower),
        Row::new(ACCESS_NOISE.into(), over_first(2), Better::Lower),
        Row::new(ACCESS_NGINX.into(), nginx_row, Better::Lower),
    ]
}

fn median(figures: &[f64]) -> f64 {
    guard::quantile::quantile(figures, 0.5).unwrap_or(f64::NAN)
}

/// The median over rounds of `figures` over `base`, as a percentage more.
fn paired(figures: &[f64], base: &[f64]) -> f64 {
    let ratios: Vec<f64> = figures
        .iter()
        .zip(base)
        .map(|(figure, base)| (figure / base - 1.0) * 100.0)
        .collect();
    median(&ratios)
}

/// Each process's CPU per request (us) while a paced `wrk` of its own loads it, all at once.
fn side_by_side<const N: usize>(
    targets: &[(u32, SocketAddr); N],
    path: &str,
    duration: Duration,
) -> [f64; N] {
    let wrk = Wrk {
        connections: ACCESS_CLIENTS,
        duration,
        threads: 1,
    };
    let before = targets.each_ref().map(|(pid, _)| cpu_run_time(*pid));
    let loads = std::thread::scope(|scope| {
        let running = targets
            .each_ref()
            .map(|(_, addr)| scope.spawn(|| wrk.run_paced(*addr, path, CHAT, Some(ACCESS_PAUSE))));
        running.map(|load| load.join().expect("wrk"))
    });
    std::array::from_fn(|i| {
        let used = cpu_run_time(targets[i].0).saturating_sub(before[i]);
        assert_eq!(loads[i].errors, 0, "{path}: {:?}", loads[i]);
        used.as_secs_f64() * 1e6 / loads[i].requests.max(1) as f64
    })
}

/// How a line's figures compare: higher is better, or lower is.
#[derive(Clone, Copy, PartialEq)]
enum Better {
    Higher,
    Lower,
}

/// One line of the table. `added`: the proxies' cells are their cost over direct's.
struct Row {
    label: String,
    cells: [Option<f64>; 5],
    better: Better,
    added: bool,
}

impl Row {
    fn new(label: String, cells: [Option<f64>; 5], better: Better) -> Self {
        Self {
            label,
            cells,
            better,
            added: false,
        }
    }

    /// A cost line: every proxy's figure less direct's.
    fn added(label: String, raw: [Option<f64>; 5]) -> Self {
        let base = raw[0];
        let mut cells = raw;
        for cell in &mut cells[1..] {
            *cell = cell.zip(base).map(|(value, base)| value - base);
        }
        Self {
            label,
            cells,
            better: Better::Lower,
            added: true,
        }
    }

    /// guard's figure over nginx's, for each guard column.
    fn ratios(&self) -> [Option<f64>; 2] {
        let nginx = self.cells[1];
        [self.cells[3], self.cells[4]].map(|g| g.zip(nginx).map(|(g, n)| g / n))
    }

    fn meets(&self, column: usize, goal: f64) -> bool {
        self.cells[column].is_some_and(|v| match self.better {
            Better::Higher => v >= goal,
            Better::Lower => v <= goal,
        })
    }
}

fn latency_rows(one: &[Option<Load>; 5]) -> [Row; 2] {
    let us = |pick: fn(&Load) -> Duration| one.map(|l| l.map(|l| pick(&l).as_secs_f64() * 1e6));
    [
        Row::added("added latency p50, 1 client (us)".into(), us(|l| l.p50)),
        Row::added("added latency p99, 1 client (us)".into(), us(|l| l.p99)),
    ]
}

fn load_rows(clients: usize, loads: &[Option<Load>; 5]) -> [Row; 2] {
    [
        Row::new(
            format!("req/s, {clients} clients"),
            loads.map(|l| l.map(|l| l.requests_per_second)),
            Better::Higher,
        ),
        Row::new(
            format!("p99 (us), {clients} clients"),
            loads.map(|l| l.map(|l| l.p99.as_secs_f64() * 1e6)),
            Better::Lower,
        ),
    ]
}

/// The relay of FRAMES small NDJSON frames, each written on its own a moment after the
/// last (as tokens come): each frame's time from the upstream's write to the client's read,
/// p50 of the best of FRAME_TRIES per column, in microseconds over direct's.
async fn frames_row(stage: &Stage) -> Row {
    let targets = stage.targets(Some("/api/generate"), "/api/pull");
    let mut best = [None::<Duration>; 5];
    for _ in 0..FRAME_TRIES {
        for (cell, target) in best.iter_mut().zip(&targets) {
            let Some((addr, path)) = *target else {
                continue;
            };
            let mut sender = client(addr).await;
            let p50 = frame_latency(&mut sender, path).await;
            *cell = Some(cell.map_or(p50, |b| b.min(p50)));
        }
    }
    Row::added(
        format!("{FRAMES} NDJSON frames, per frame p50 (us)"),
        best.map(|b| b.map(|b| b.as_secs_f64() * 1e6)),
    )
}

/// Reads a paced stream of frames; the p50 of each frame's time from the upstream's write.
async fn frame_latency(sender: &mut Sender, path: &str) -> Duration {
    let body = Full::new(Bytes::from_static(b"{\"model\":\"m\",\"prompt\":\"x\"}")).boxed();
    let request = Request::post(path)
        .header("host", "bench")
        .header("content-type", "application/json")
        .body(body)
        .expect("request");
    sender.ready().await.expect("ready");
    let response = sender.send_request(request).await.expect("response");
    assert_eq!(response.status(), 200, "{path}");
    let mut body = response.into_body();
    let (mut pending, mut delays) = (Vec::new(), Vec::with_capacity(FRAMES));
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.expect("frame").into_data() else {
            continue;
        };
        let now = epoch().elapsed();
        pending.extend_from_slice(&data);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            if let Some(sent) = sent_at(&line) {
                delays.push(now.saturating_sub(sent));
            }
        }
    }
    assert_eq!(delays.len(), FRAMES, "{path}: every frame arrived");
    guard_tests::workload::percentile(&delays, 0.5)
}

/// When the upstream wrote a frame (its `response` holds nanoseconds since `epoch`).
fn sent_at(line: &[u8]) -> Option<Duration> {
    let text = std::str::from_utf8(line).ok()?;
    let (_, rest) = text.split_once("\"response\":\"")?;
    let (nanos, _) = rest.split_once('"')?;
    nanos.parse().ok().map(Duration::from_nanos)
}

/// The instant the frames' times count from, shared by the upstream thread and the client.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// An upstream on a thread of its own that streams FRAMES NDJSON frames on /api/generate and
/// /api/pull, each in one write FRAME_PACE after the last, and answers the watcher's
/// questions; one request per connection.
fn frame_upstream() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = serve_frames(stream);
            });
        }
    });
    addr
}

fn serve_frames(mut stream: std::net::TcpStream) -> std::io::Result<()> {
    use std::io::{Read as _, Write as _};
    stream.set_nodelay(true)?;
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head);
    let path = text.split_whitespace().nth(1).unwrap_or("/");
    let fixed = |body: &str| {
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    match path {
        "/api/generate" | "/api/pull" => {}
        "/api/tags" => return stream.write_all(fixed(TAGS).as_bytes()),
        "/api/ps" => return stream.write_all(fixed(PS).as_bytes()),
        _ => return stream.write_all(fixed(ANSWER).as_bytes()),
    }
    stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")?;
    for i in 1..=FRAMES {
        let line = match i == FRAMES {
            false => format!(
                "{{\"model\":\"m\",\"response\":\"{}\",\"done\":false}}\n",
                epoch().elapsed().as_nanos()
            ),
            true => format!(
                "{{\"model\":\"m\",\"response\":\"{}\",\"done\":true,\"done_reason\":\"length\",\"prompt_eval_count\":9,\"eval_count\":{FRAMES},\"eval_duration\":1000000000}}\n",
                epoch().elapsed().as_nanos()
            ),
        };
        stream.write_all(format!("{:x}\r\n{line}\r\n", line.len()).as_bytes())?;
        std::thread::sleep(FRAME_PACE);
    }
    stream.write_all(b"0\r\n\r\n")
}

/// 1 GiB up and 1 GiB down, best of BULK_TRIES per column, in MB/s. The queued path takes
/// bodies up to `server.body_limit_bytes` only: its cells stay empty.
async fn bulk_rows(stage: &Stage) -> [Row; 2] {
    let up = stage.targets(None, "/api/blobs/sha256:00");
    let down = stage.targets(None, "/download");
    let mut rates = [[0.0f64; 5]; 2];
    for _ in 0..BULK_TRIES {
        for (i, targets) in [up, down].iter().enumerate() {
            for (rate, target) in rates[i].iter_mut().zip(targets) {
                let Some((addr, path)) = *target else {
                    continue;
                };
                let (took, bytes) = bulk(addr, path, i == 0).await;
                assert_eq!(bytes, BULK, "{path}");
                *rate = rate.max(bytes as f64 / took.as_secs_f64() / 1e6);
            }
        }
    }
    let cells = |rates: [f64; 5]| {
        let mut cells = rates.map(Some);
        cells[3] = None;
        cells
    };
    [
        Row::new(
            "1 GiB upload (MB/s)".into(),
            cells(rates[0]),
            Better::Higher,
        ),
        Row::new(
            "1 GiB download (MB/s)".into(),
            cells(rates[1]),
            Better::Higher,
        ),
    ]
}

fn print(rows: &[Row], seconds: u64) {
    println!(
        "1. the request path, side by side (wrk {seconds} s per cell; the proxies' latency and per-frame cells are added to direct's):"
    );
    print!("   {:<38}", "");
    for column in COLUMNS {
        print!("{column:>13}");
    }
    println!("   guard/nginx (queued, pass)");
    for row in rows {
        print!("   {:<38}", row.label);
        for (i, cell) in row.cells.iter().enumerate() {
            let text = match cell {
                Some(v) if row.added && i == 0 => format!("({v:.1})"),
                Some(v) if v.abs() < 100.0 => format!("{v:.1}"),
                Some(v) => format!("{v:.0}"),
                None => "-".into(),
            };
            print!("{text:>13}");
        }
        let [q, p] = row
            .ratios()
            .map(|r| r.map_or("-".into(), |r| format!("{r:.2}x")));
        println!("   {q}, {p}");
    }
    goals(rows);
}

/// Each goal of the issue, met or not, on this run's figures.
fn goals(rows: &[Row]) {
    let find = |label: &str| {
        rows.iter()
            .find(|r| r.label.starts_with(label))
            .expect(label)
    };
    let nginx = |label: &str| find(label).cells[1].unwrap_or(f64::NAN);
    let verdict = |ok: bool| if ok { "met" } else { "missed" };
    let both =
        |label: &str, goal: f64| verdict(find(label).meets(3, goal) && find(label).meets(4, goal));
    println!("   goals, both guard paths:");
    let p50 = "added latency p50";
    println!(
        "   - added p50 <= 1.5x nginx's ({:.1} us): {}",
        1.5 * nginx(p50),
        both(p50, 1.5 * nginx(p50))
    );
    println!(
        "   - added p99 <= 500 us: {}",
        both("added latency p99", 500.0)
    );
    for clients in [64, 256] {
        let label = format!("req/s, {clients} clients");
        println!(
            "   - req/s at {clients} clients >= nginx's: {}",
            both(&label, nginx(&label))
        );
    }
    let frames = format!("{FRAMES} NDJSON");
    println!(
        "   - per-frame cost <= nginx's: {}",
        both(&frames, nginx(&frames))
    );
    println!("   - {}", access_goal(rows));
    for label in ["1 GiB upload", "1 GiB download"] {
        let row = find(label);
        let share = row.cells[4].zip(row.cells[0]).map_or(0.0, |(g, d)| g / d);
        println!(
            "   - {label} >= 95 % of direct (pass-through): {:.0} %: {}",
            share * 100.0,
            verdict(share >= 0.95)
        );
    }
}

/// A body of `remaining` zero bytes in CHUNK-sized frames, produced as fast as it is read.
struct Zeros {
    remaining: usize,
    chunk: Bytes,
}

impl Zeros {
    fn new(remaining: usize) -> Self {
        Self {
            remaining,
            chunk: Bytes::from(vec![0u8; CHUNK]),
        }
    }
}

impl hyper::body::Body for Zeros {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let n = self.remaining.min(self.chunk.len());
        self.remaining -= n;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..n)))))
    }
}

type AnyBody = BoxBody<Bytes, Infallible>;

/// The upstream of the bulk lines: 1 GiB on /download, a body read to its end on
/// /api/blobs/, and never an answer on /v1/embeddings (a request that holds its slot).
pub async fn stream_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(|request: Request<hyper::body::Incoming>| async move {
                    let path = request.uri().path().to_owned();
                    let mut received = 0;
                    let mut body = request.into_body();
                    while let Some(Ok(frame)) = body.frame().await {
                        received += frame.data_ref().map_or(0, Bytes::len);
                    }
                    let text =
                        |s: &'static str| Full::new(Bytes::from_static(s.as_bytes())).boxed();
                    let body: AnyBody = match path.as_str() {
                        "/download" => Zeros::new(BULK).boxed(),
                        "/api/tags" => text(TAGS),
                        "/api/ps" => text(PS),
                        "/v1/embeddings" => std::future::pending::<AnyBody>().await,
                        p if p.starts_with("/api/blobs/") => {
                            Full::new(Bytes::from(format!("{{\"bytes\":{received}}}"))).boxed()
                        }
                        _ => text(ANSWER),
                    };
                    Ok::<_, Infallible>(Response::new(body))
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

type Sender = hyper::client::conn::http1::SendRequest<AnyBody>;

pub async fn client(addr: SocketAddr) -> Sender {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    sender
}

/// Sends one small POST on a kept-alive connection; returns its status, the time to its
/// answer's end and the answer's length.
pub async fn timed(sender: &mut Sender, path: &str, class: Option<&str>) -> (u16, Duration, usize) {
    let mut request = Request::post(path)
        .header("host", "bench")
        .header("content-type", "application/json");
    if let Some(class) = class {
        request = request.header("x-guard-class", class);
    }
    let body = Full::new(Bytes::from_static(b"{\"model\":\"m\",\"prompt\":\"x\"}")).boxed();
    let answer = exchange(sender, request.body(body).expect("request")).await;
    (answer.status, answer.took, answer.bytes)
}

/// A 1 GiB upload (`up`) or download on a connection of its own: the time and the bytes
/// moved (as the upstream counted them, for an upload).
async fn bulk(addr: SocketAddr, path: &str, up: bool) -> (Duration, usize) {
    let mut sender = client(addr).await;
    let request = match up {
        true => Request::post(path)
            .header("host", "bench")
            .header("content-length", BULK)
            .body(Zeros::new(BULK).boxed()),
        false => Request::get(path)
            .header("host", "bench")
            .body(Full::new(Bytes::new()).boxed()),
    };
    let answer = exchange(&mut sender, request.expect("request")).await;
    assert_eq!(answer.status, 200, "{path}");
    if !up {
        return (answer.took, answer.bytes);
    }
    let counted: serde_json::Value =
        serde_json::from_slice(&answer.head).expect("the upstream's count");
    (answer.took, counted["bytes"].as_u64().unwrap_or(0) as usize)
}

/// What came back for one request.
struct Answer {
    status: u16,
    /// From sending the request to the answer's last byte.
    took: Duration,
    bytes: usize,
    /// The answer's first bytes (at most 256).
    head: Vec<u8>,
}

async fn exchange(sender: &mut Sender, request: Request<AnyBody>) -> Answer {
    sender.ready().await.expect("ready");
    let started = Instant::now();
    let response = sender.send_request(request).await.expect("response");
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let (mut bytes, mut head) = (0, Vec::new());
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("frame").into_data() {
            bytes += data.len();
            let room = 256usize.saturating_sub(head.len());
            head.extend_from_slice(&data[..room.min(data.len())]);
        }
    }
    Answer {
        status,
        took: started.elapsed(),
        bytes,
        head,
    }
}
