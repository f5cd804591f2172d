//! `bench proxy flame`: where guard's time goes on each path. `perf record` samples guard
//! while `wrk` drives 64 kept-alive clients through it; the samples become a flame graph
//! (the `inferno` crate) in target/flame/, and the frames that hold most of the time are
//! printed, each as its share of guard's samples (children included).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use guard_tests::peers::{Peer, Wrk};
use inferno::{
    collapse::{Collapse as _, perf::Folder},
    flamegraph,
};

use super::table::{ANSWER, CHAT, GUARD, PS, TAGS};

const SECONDS: u64 = 4;
/// Frames of guard's own, hyper's and the kernel's that say where a request's time goes.
const SHOWN: &[&str] = &[
    "QueuedRequest::run",
    "::phases",
    "::forward",
    "::relay",
    "::admit",
    "Scheduler::enqueue",
    "QueuedRequest::finish",
    "Proxy::handle",
    "client::legacy::client::Client",
    "poll_read_head",
    "poll_write_vectored",
    "do_syscall_64",
    "__schedule",
    "malloc",
    "libc_free",
    "tokio::task::spawn",
];

pub fn run() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/flame");
    std::fs::create_dir_all(&dir).expect("create target/flame");
    let dir = dir.canonicalize().expect("target/flame");
    let fixed = Peer::nginx_fixed(&[("/api/tags", TAGS), ("/api/ps", PS)], ANSWER);
    let guard = guard_tests::servers::GuardProcess::start(fixed.addr, "ollama", GUARD);
    println!("4. where guard's time goes, {SECONDS} s of wrk -c64 on each path (perf, inferno):");
    for (name, path) in [("queued", "/api/chat"), ("pass", "/api/show")] {
        let data = dir.join(format!("{name}.perf.data"));
        let load = std::thread::spawn({
            let addr = guard.listen;
            move || {
                let wrk = Wrk {
                    connections: 64,
                    duration: Duration::from_secs(SECONDS + 1),
                    threads: 2,
                };
                wrk.run(addr, path, CHAT)
            }
        });
        record(guard.pid(), &data);
        let load = load.join().expect("wrk");
        let folded = collapse(&data);
        let svg = dir.join(format!("{name}.svg"));
        draw(&folded, &svg);
        println!(
            "   {name} ({path}, {:.0} req/s): {}",
            load.requests_per_second,
            svg.display()
        );
        for (share, frame) in shares(&folded) {
            println!("     {share:5.1} %  {frame}");
        }
    }
}

/// `perf record` with call graphs for SECONDS, started once the load runs.
fn record(pid: u32, data: &Path) {
    std::thread::sleep(Duration::from_millis(500));
    let status = Command::new("perf")
        .args(["record", "-F", "999", "--call-graph", "dwarf,16384", "-p"])
        .arg(pid.to_string())
        .arg("-o")
        .arg(data)
        .args(["--", "sleep", &SECONDS.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run perf (run `cargo xtask setup`)");
    assert!(status.success(), "perf record failed");
}

/// The samples, one folded stack a line.
fn collapse(data: &Path) -> String {
    let script = Command::new("perf")
        .arg("script")
        .arg("-i")
        .arg(data)
        .stderr(Stdio::null())
        .output()
        .expect("perf script");
    let mut folded = Vec::new();
    Folder::default()
        .collapse(&script.stdout[..], &mut folded)
        .expect("fold the stacks");
    String::from_utf8_lossy(&folded).into_owned()
}

fn draw(folded: &str, svg: &PathBuf) {
    let mut options = flamegraph::Options::default();
    options.title = "guard under 64 clients".to_owned();
    let file = std::fs::File::create(svg).expect("create the svg");
    flamegraph::from_lines(&mut options, folded.lines(), file).expect("draw the flame graph");
}

/// The share of samples whose stack holds each SHOWN frame, largest first.
fn shares(folded: &str) -> Vec<(f64, String)> {
    let mut total = 0u64;
    let mut hits: HashMap<&str, u64> = HashMap::new();
    for line in folded.lines() {
        let Some((stack, count)) = line.rsplit_once(' ') else {
            continue;
        };
        let count: u64 = count.parse().unwrap_or(0);
        total += count;
        for frame in SHOWN {
            if stack.contains(frame) {
                *hits.entry(frame).or_default() += count;
            }
        }
    }
    let mut shares: Vec<(f64, String)> = hits
        .into_iter()
        .map(|(frame, n)| (100.0 * n as f64 / total.max(1) as f64, frame.to_owned()))
        .collect();
    shares.sort_by(|a, b| b.0.total_cmp(&a.0));
    shares
}
