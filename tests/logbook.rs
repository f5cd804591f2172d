//! `guard bench` and `guard logbook` as a user runs them: a baseline against the real
//! llama-server (every field recorded, a planted quality failure caught), the report of two
//! real runs opened in headless Chromium, the cold-start path against the Ollama emulator
//! (Ollama cannot be installed here), and due, compare and report on fixture entries.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use guard_tests::{
    TempDir, guard_bin, serial,
    servers::{LlamaServer, OllamaEmulator},
};
use guard_tools::logbook::{
    Entry,
    entry::{InputSet, Maybe, Runs, Spread},
};

fn bench(args: &[&str], logbook: &Path) -> Entry {
    let output = Command::new(guard_bin())
        .arg("bench")
        .args(args)
        .args(["--owner", "tests", "--logbook"])
        .arg(logbook)
        .output()
        .expect("guard bench");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let entries = guard_tools::logbook::read(logbook).expect("read logbook");
    entries.last().cloned().expect("an entry")
}

/// A two-prompt set (the second with a planted quality failure) measured against llama-server,
/// each baseline appended to one logbook.
struct Baseline {
    input: PathBuf,
    url: String,
    logbook: PathBuf,
}

impl Baseline {
    /// Writes the set under `dir`, for the llama-server at `addr`.
    fn new(dir: &TempDir, addr: std::net::SocketAddr) -> Self {
        let input = dir.0.join("set.jsonl");
        std::fs::write(
            &input,
            "{\"prompt\": \"Say hello.\"}\n{\"prompt\": \"Count to three.\", \"expect\": \"^PLANTED-FAILURE$\"}\n",
        )
        .expect("write inputs");
        Self {
            input,
            url: format!("http://{addr}"),
            logbook: dir.0.join("logbook.jsonl"),
        }
    }

    /// A baseline of the set against llama-server, run `repeat` times for `tokens` tokens.
    fn run(&self, repeat: &str, tokens: &str) -> Entry {
        let input = self.input.to_str().expect("utf-8");
        let args = [
            "--input",
            input,
            "--url",
            &self.url,
            "--api",
            "openai",
            "--model",
            "smollm2",
            "--runtime",
            "llama.cpp",
            "--repeat",
            repeat,
            "--max-tokens",
            tokens,
        ];
        bench(&args, &self.logbook)
    }
}

/// What the entry says was measured: the set, its runs and what ran it.
fn assert_recorded_setup(entry: &Entry) {
    assert_eq!(
        entry.quality_failures, 2,
        "the planted failure, caught in both runs"
    );
    assert_eq!(entry.repetitions, 2);
    assert_eq!(entry.ttft_samples_ms.len(), 4);
    assert!(
        entry.launch_flags.contains("llama-server") && entry.launch_flags.contains("-np 1"),
        "{}",
        entry.launch_flags
    );
    assert!(
        entry.model_digest.starts_with("sha256:"),
        "{}",
        entry.model_digest
    );
    assert_ne!(entry.runtime_version, "unknown");
    assert_eq!(entry.input_set.inputs, 2);
    assert_eq!(entry.input_set.sha256.len(), 64);
}

/// The entry's measurements, those unavailable here said so, and its retest date.
fn assert_measured(entry: &Entry) {
    assert!(entry.ttft_ms.p50 > 0.0 && entry.completion_ms.p95 >= entry.ttft_ms.p95);
    assert!(entry.decode_tokens_per_second.p50 > 0.0);
    assert!(
        matches!(entry.peak_server_rss_bytes, Maybe::Value(rss) if rss > 1e7),
        "{:?}",
        entry.peak_server_rss_bytes
    );
    assert_eq!(
        entry.cold_start_ms,
        Maybe::unavailable(),
        "no unload in this API and no --restart given"
    );
    assert_eq!(
        entry.peak_gpu_memory_bytes,
        Maybe::unavailable(),
        "no GPU here"
    );
    assert_eq!(
        entry.retest_date,
        guard_tools::logbook::date_after(jiff::Timestamp::now(), 30)
    );
}

/// The logbook's text names every field, and energy as unavailable.
fn assert_every_field_logged(logbook: &Path) {
    let line = std::fs::read_to_string(logbook).expect("logbook");
    for field in [
        "command",
        "model_digest",
        "launch_flags",
        "runtime_version",
        "input_set",
        "decision",
        "owner",
        "retest_date",
        "energy_joules",
        "mean_power_watts",
        "abstentions",
    ] {
        assert!(
            line.contains(&format!("\"{field}\"")),
            "{field} missing: {line}"
        );
    }
    assert!(
        line.contains("\"energy_joules\":\"unavailable\""),
        "no RAPL or NVML here: {line}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_baseline_against_llama_server_records_every_field() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let dir = TempDir::new("guard-logbook-llama");
    let baseline = Baseline::new(&dir, llama.addr);
    let entry = baseline.run("2", "16");
    assert_recorded_setup(&entry);
    // The hash is of the file: the same set measured again carries the same hash.
    let again = baseline.run("1", "4");
    assert_eq!(again.input_set.sha256, entry.input_set.sha256);
    assert_measured(&entry);
    assert_every_field_logged(&baseline.logbook);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ollama_cold_start_unloads_the_model_first() {
    let _serial = serial().await;
    let ollama =
        OllamaEmulator::start(&["--load-ms", "400", "--tokens", "4", "--token-delay-ms", "5"]);
    let dir = TempDir::new("guard-logbook-ollama");
    let input = dir.0.join("set.jsonl");
    std::fs::write(&input, "{\"prompt\": \"hi\"}\n").expect("write inputs");
    let url = format!("http://{}", ollama.addr);
    let entry = bench(
        &[
            "--input",
            input.to_str().expect("utf-8"),
            "--url",
            &url,
            "--api",
            "ollama",
            "--model",
            "smollm2:135m",
            "--runtime",
            "ollama-emulator",
            "--repeat",
            "2",
        ],
        &dir.0.join("logbook.jsonl"),
    );
    let cold = entry.cold_start_ms.value().expect("a cold start");
    assert!(cold >= 400.0, "cold start paid the load: {cold} ms");
    assert!(
        entry.warm_start_ms < 200.0,
        "warm start: {} ms",
        entry.warm_start_ms
    );
    assert_eq!(entry.runtime_version, "0.12.0", "from /api/version");
    assert_ne!(entry.model_digest, "unknown", "from /api/tags");
}

fn fixture(
    id: &str,
    ttft_p50: f64,
    runs: (f64, f64),
    rate: f64,
    failures: usize,
    retest: &str,
) -> Entry {
    let spread = |p50: f64, range: (f64, f64)| Spread {
        p50,
        p95: p50 * 1.5,
        run_p50_min: range.0,
        run_p50_max: range.1,
    };
    Entry {
        id: id.to_owned(),
        recorded_at: "2026-11-01T10:00:00Z".parse().expect("timestamp"),
        command: "guard bench ...".to_owned(),
        model: "smollm2".to_owned(),
        model_digest: "sha256:aa".to_owned(),
        runtime: "llama.cpp".to_owned(),
        runtime_version: "b1".to_owned(),
        launch_flags: "llama-server -np 1".to_owned(),
        api: guard::config::Api::Openai,
        url: "http://127.0.0.1:11435".to_owned(),
        workload_class: "batch".to_owned(),
        input_set: InputSet {
            path: "set.jsonl".to_owned(),
            sha256: "ff".to_owned(),
            inputs: 3,
        },
        repetitions: 3,
        cold_start_ms: Maybe::Value(900.0),
        warm_start_ms: 40.0,
        ttft_ms: spread(ttft_p50, runs),
        completion_ms: spread(ttft_p50 * 4.0, (ttft_p50 * 4.0, ttft_p50 * 4.0)),
        decode_tokens_per_second: spread(rate, (rate, rate)),
        queue_delay_ms: spread(0.0, (0.0, 0.0)),
        peak_server_rss_bytes: Maybe::Value(2e8),
        peak_gpu_memory_bytes: Maybe::unavailable(),
        energy_joules: Maybe::unavailable(),
        mean_power_watts: Maybe::unavailable(),
        quality_failures: failures,
        abstentions: 0,
        ttft_samples_ms: vec![ttft_p50 * 0.8, ttft_p50, ttft_p50 * 1.5],
        runs: Runs::default(),
        decision: "baseline".to_owned(),
        owner: "ada".to_owned(),
        retest_date: retest.parse().expect("date"),
    }
}

/// `guard logbook ARGS` on `logbook`: its exit code and standard output.
fn logbook_cli(logbook: &Path, args: &[&str]) -> (Option<i32>, String) {
    let output = Command::new(guard_bin())
        .arg("logbook")
        .arg("--logbook")
        .arg(logbook)
        .args(args)
        .output()
        .expect("guard logbook");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[test]
fn due_compare_and_report_on_fixture_entries() {
    let dir = TempDir::new("guard-logbook-fixtures");
    let logbook = dir.0.join("logbook.jsonl");
    // B: TTFT within A's spread, faster decoding (a gain), one more quality failure (a cost).
    guard_tools::logbook::append(
        &logbook,
        &fixture("aaaa1111", 100.0, (90.0, 120.0), 100.0, 0, "2000-01-01"),
    )
    .expect("append");
    guard_tools::logbook::append(
        &logbook,
        &fixture("bbbb2222", 110.0, (100.0, 118.0), 150.0, 1, "2999-01-01"),
    )
    .expect("append");
    let run = |args: &[&str]| logbook_cli(&logbook, args);
    let (code, list) = run(&["list"]);
    assert_eq!(code, Some(0));
    assert!(
        list.contains("aaaa1111") && list.contains("DUE") && list.contains("bbbb2222"),
        "{list}"
    );
    let (code, due) = run(&["due"]);
    assert_eq!(code, Some(1), "a due retest fails `due`, for cron");
    assert!(
        due.contains("aaaa1111") && !due.contains("bbbb2222"),
        "{due}"
    );

    let (code, compare) = run(&["compare", "aaaa", "bbbb"]);
    assert_eq!(code, Some(0));
    assert_compare_speaks(&compare);
    assert_reports_written(&logbook, &dir);
}

/// The table: units, integer counts, words for a change from zero, costs beside gains.
fn assert_compare_speaks(compare: &str) {
    let line = |name: &str| {
        compare
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} in {compare}"))
            .to_owned()
    };
    let ttft = line("TTFT p50");
    assert!(
        ttft.contains(" ms ") && ttft.contains("(90–120)") && ttft.ends_with("within the spread"),
        "{compare}"
    );
    assert!(line("decode rate p50").ends_with("gain"), "{compare}");
    let failures = line("quality failures");
    assert!(
        failures.contains(" count ") && failures.contains(" new ") && failures.ends_with("COST"),
        "0 -> 1 is new, not inf%: {compare}"
    );
    assert!(
        line("peak server RSS").contains("191"),
        "MiB, not bytes: {compare}"
    );
    assert!(
        !compare.contains("inf") && !compare.contains(".0 "),
        "{compare}"
    );
    assert!(
        line("costs: ").contains("quality_failures") && line("gains: ").contains("decode_rate"),
        "costs stand beside gains: {compare}"
    );
}

/// The TTFT chart alone as SVG and PNG, and the page with every figure.
fn assert_reports_written(logbook: &Path, dir: &TempDir) {
    for name in ["ttft.svg", "ttft.png", "report.html"] {
        let out = dir.0.join(name);
        let args = ["report", "aaaa", "--compare", "bbbb", "--out"];
        let (code, _) = logbook_cli(
            logbook,
            &[&args[..], &[out.to_str().expect("utf-8")]].concat(),
        );
        assert_eq!(code, Some(0), "{name}");
    }
    let svg = std::fs::read_to_string(dir.0.join("ttft.svg")).expect("svg");
    assert!(
        svg.starts_with("<svg") && svg.contains("TTFT (ms, log scale)"),
        "{svg}"
    );
    assert!(
        svg.contains("A aaaa1111") && svg.contains("B bbbb2222"),
        "{svg}"
    );
    let png = std::fs::read(dir.0.join("ttft.png")).expect("png");
    assert!(png.starts_with(b"\x89PNG"), "a PNG file");
    let page = std::fs::read_to_string(dir.0.join("report.html")).expect("html");
    assert_eq!(page.matches("<svg id=\"chart-").count(), 4, "{page}");
    assert!(page.contains("completion time: no samples"), "{page}");
}

/// Runs Debian's chromium headless on `page` with `args` (as root: no sandbox), bounded in
/// time; its standard output and error.
fn chromium(page: &Path, profile: &Path, args: &[&str]) -> (String, String) {
    let output = Command::new("timeout")
        .args([
            "120",
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
        ])
        .args([
            "--no-first-run",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("chromium (cargo xtask setup installs Debian's chromium)");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "chromium: {stderr}");
    (String::from_utf8_lossy(&output.stdout).into_owned(), stderr)
}

/// Chromium's console messages: each an error here, as the page runs no script.
/// The console messages of the page itself (Chromium's own pages log too, e.g. "Slow network
/// is detected" from its resources under load: not the page's).
fn console_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains(":CONSOLE") && l.contains("source: file://"))
        .collect()
}

const SCREEN: (u32, u32) = (1400, 2400);

/// The screenshot: the size asked for, not blank, A's and B's colours both drawn.
fn assert_rendered(shot: &Path) {
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(shot).expect("the screenshot"),
    ));
    let mut reader = decoder.read_info().expect("a PNG");
    let mut pixels = vec![0; reader.output_buffer_size()];
    let frame = reader.next_frame(&mut pixels).expect("a frame");
    assert_eq!((frame.width, frame.height), SCREEN);
    let channels = frame.color_type.samples();
    let rgb: Vec<[u8; 3]> = pixels[..frame.buffer_size()]
        .chunks_exact(channels)
        .map(|p| [p[0], p[1], p[2]])
        .collect();
    let share =
        |colour: [u8; 3]| rgb.iter().filter(|p| **p == colour).count() as f64 / rgb.len() as f64;
    let white = share([255, 255, 255]);
    assert!(white > 0.3 && white < 0.97, "white: {white}");
    let colours: std::collections::HashSet<&[u8; 3]> = rgb.iter().collect();
    assert!(colours.len() > 100, "{} colours", colours.len());
    // The curves' and bars' colours (chart.rs COLOURS), exactly: drawn, not only the table.
    for colour in [[0, 114, 178], [213, 94, 0]] {
        assert!(share(colour) > 0.001, "{colour:?}: {}", share(colour));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_report_of_two_real_runs_renders_in_chromium() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let dir = TempDir::new("guard-logbook-report");
    let baseline = Baseline::new(&dir, llama.addr);
    let (a, b) = (baseline.run("2", "4"), baseline.run("2", "8"));
    drop(llama);
    let page = dir.0.join("report.html");
    let output = Command::new(guard_bin())
        .args(["logbook", "--logbook"])
        .arg(&baseline.logbook)
        .args(["report", &a.id, "--compare", &b.id, "--out"])
        .arg(&page)
        .output()
        .expect("guard logbook report");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let html = std::fs::read_to_string(&page).expect("the page");
    assert!(
        !html.contains("<script") && !html.contains("src="),
        "self-contained"
    );
    let charts = html.matches("<svg id=\"chart-").count();

    let profile = dir.0.join("chromium");
    let shot = dir.0.join("shot.png");
    let size = format!("--window-size={},{}", SCREEN.0, SCREEN.1);
    let (_, stderr) = chromium(
        &page,
        &profile,
        &[&size, &format!("--screenshot={}", shot.display())],
    );
    assert_eq!(console_lines(&stderr), Vec::<&str>::new(), "{stderr}");
    assert_rendered(&shot);
    let (dom, _) = chromium(&page, &profile, &["--dump-dom"]);
    for id in [
        "ttft",
        "completion",
        "decode_rate",
        "peak_server_rss",
        "quality_failures",
        "abstentions",
    ] {
        assert!(
            dom.contains(&format!("<svg id=\"chart-{id}\"")),
            "chart-{id} in {dom}"
        );
    }
    assert_eq!(
        dom.matches("<svg id=\"chart-").count(),
        charts,
        "every chart written is in the DOM"
    );
    assert_eq!(dom.matches("<tr class=").count(), 15, "a row a figure");
    assert!(
        dom.contains("queue delay (guard's x-guard-queue-ms): every request at 0 ms"),
        "{dom}"
    );

    // The check above can fail: a page that breaks its own policy is caught.
    let probe = dir.0.join("probe.html");
    std::fs::write(
        &probe,
        html.replacen("<h1>", "<script>console.error(1)</script><h1>", 1),
    )
    .expect("write probe");
    let (_, stderr) = chromium(&probe, &profile, &["--dump-dom"]);
    assert_eq!(console_lines(&stderr).len(), 1, "{stderr}");
}
