//! What fails quietly, made visible: partial CPU offload and cold loads (through the Ollama
//! emulator: Ollama cannot be installed here), models served from elsewhere (flagged, and
//! refused with 403 when configured), swap, PSI and the upstream process, no GPU here
//! (`guard_gpu_available 0`), `guard status` and `guard doctor`, and the Prometheus side: the
//! alert rules check and pass their unit tests, every metric the dashboard and the rules name
//! exists in a fresh guard (the series a rate() reads at 0 for every class, reason, outcome
//! and model guard knows), and a real Prometheus scrapes it.

use std::{
    collections::BTreeSet,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use guard_tests::{
    ChildGuard, TempDir,
    body::{With as _, ollama_chat},
    free_addr, guard_bin,
    http::{get, post},
    serial,
    servers::{GuardProcess, LlamaServer, OllamaEmulator},
};
use serde_json::json;

const CLASSES: &str = "[class.interactive]\npriority = 0\nmax_queue = 8\ndeadline_ms = 5000\n\
                       [class.batch]\npriority = 10\nmax_queue = 100\n\
                       [watch]\ninterval_ms = 200\ncold_load_ms = 300\n";

fn chat(model: &str) -> serde_json::Value {
    ollama_chat("hi").with("model", model).with("stream", false)
}

/// An emulated Ollama with one model half on the CPU, slow cold loads and one cloud model,
/// and guard in front of it after one cold and one warm chat.
async fn watched_guard(extra: &str) -> (OllamaEmulator, GuardProcess) {
    watched_guard_config(&format!("{CLASSES}{extra}")).await
}

/// The same, with the whole config given.
async fn watched_guard_config(config: &str) -> (OllamaEmulator, GuardProcess) {
    let ollama = OllamaEmulator::start(&[
        "--models",
        "smollm2:135m,gpt-oss:20b-cloud",
        "--remote-models",
        "gpt-oss:20b-cloud",
        "--vram-ratio",
        "0.48",
        "--load-ms",
        "500",
        "--tokens",
        "3",
    ]);
    let guard = GuardProcess::start(ollama.addr, "ollama", config);
    for _ in 0..2 {
        assert_eq!(
            post(guard.listen, "/api/chat", &[], &chat("smollm2:135m"))
                .await
                .status,
            200
        );
    }
    (ollama, guard)
}

#[tokio::test(flavor = "multi_thread")]
async fn offload_cold_loads_and_remote_models_show_in_metrics_and_status() {
    let _serial = serial().await;
    let (_ollama, guard) = watched_guard("[upstream]\nrefuse_remote_models = false\n").await;
    guard
        .wait_for_metric("guard_model_cpu_offload_ratio{model=\"smollm2:135m\"}", 0.5)
        .await;
    assert_eq!(
        guard
            .metric("guard_model_cpu_offload_ratio{model=\"smollm2:135m\"}")
            .await,
        0.52
    );
    assert_eq!(
        guard
            .metric("guard_model_cold_loads_total{model=\"smollm2:135m\"}")
            .await,
        1.0,
        "one cold, one warm"
    );
    guard
        .wait_for_metric("guard_model_remote{model=\"gpt-oss:20b-cloud\"}", 1.0)
        .await;
    assert_eq!(
        guard
            .metric("guard_model_remote{model=\"smollm2:135m\"}")
            .await,
        0.0
    );
    // With refuse_remote_models = false every class may: the request passes, flagged.
    assert_eq!(
        post(guard.listen, "/api/chat", &[], &chat("gpt-oss:20b-cloud"))
            .await
            .status,
        200
    );

    let status = guard.status().await;
    let loaded = &status["watch"]["upstream"]["loaded_models"];
    assert_eq!(loaded[0]["name"], "smollm2:135m", "{status}");
    assert_eq!(loaded[0]["cpu_offload_ratio"], 0.52);
    assert!(
        status["watch"]["host"]["swap_total_bytes"].is_u64(),
        "{status}"
    );
    assert_eq!(
        status["watch"]["gpu"]["available"], false,
        "no NVIDIA driver on this machine"
    );

    let text = guard.metrics_text().await;
    let m = |s: &str| guard_tests::metric(&text, s);
    assert_eq!(m("guard_gpu_available"), Some(0.0));
    assert_eq!(
        m("guard_psi_available"),
        Some(1.0),
        "this kernel offers PSI"
    );
    assert!(m("guard_pressure_waiting_ratio{resource=\"cpu\"}").is_some());
    assert!(m("guard_swap_total_bytes").is_some());
    assert!(
        m("guard_upstream_rss_bytes").is_some_and(|rss| rss > 1e6),
        "the emulator's process was found by its port"
    );
}

/// The privacy boundary per class: by default no class may ask for a model served elsewhere;
/// `[class.batch] allow_remote_models = true` lets the batch class (and only it) do so.
#[tokio::test(flavor = "multi_thread")]
async fn remote_models_are_refused_with_403_in_a_class_that_does_not_allow_them() {
    let _serial = serial().await;
    let config = CLASSES.replace(
        "max_queue = 100\n",
        "max_queue = 100\nallow_remote_models = true\n",
    );
    let (ollama, guard) = watched_guard_config(&config).await;
    guard
        .wait_for_metric("guard_model_remote{model=\"gpt-oss:20b-cloud\"}", 1.0)
        .await;
    // The private chat (interactive by default) may not.
    let refused = post(guard.listen, "/api/chat", &[], &chat("gpt-oss:20b-cloud")).await;
    assert_eq!(refused.status, 403);
    let error = refused.json()["error"]
        .as_str()
        .expect("Ollama shape")
        .to_owned();
    assert!(
        error.contains("gpt-oss:20b-cloud") && error.contains("allow_remote_models"),
        "{error}"
    );
    assert_eq!(
        guard
            .metric("guard_remote_refused_total{class=\"interactive\",model=\"gpt-oss:20b-cloud\"}")
            .await,
        1.0
    );
    let stats = ollama.stats().await;
    assert_eq!(
        stats["requests"]["/api/chat"], 2,
        "the refused chat never left guard"
    );
    // The batch class may (a client may always ask to be less urgent).
    let batch = [("x-guard-class", "batch")];
    let allowed = post(
        guard.listen,
        "/api/chat",
        &batch,
        &chat("gpt-oss:20b-cloud"),
    )
    .await;
    assert_eq!(allowed.status, 200, "{}", allowed.text());
    assert_eq!(ollama.stats().await["requests"]["/api/chat"], 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn status_and_doctor_read_like_tables() {
    let _serial = serial().await;
    let (_ollama, guard) = watched_guard("").await;
    let status = Command::new(guard_bin())
        .args(["status", "--url", &format!("http://{}", guard.metrics)])
        .output()
        .expect("guard status");
    let table = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    assert!(
        table.contains("interactive") && table.contains("batch") && table.contains("ebpf"),
        "{table}"
    );

    let doctor = Command::new(guard_bin())
        .args(["doctor", "--config"])
        .arg(&guard.config_path)
        .output()
        .expect("guard doctor");
    let lines = String::from_utf8_lossy(&doctor.stdout).into_owned();
    for check in [
        "bpf capabilities",
        "tracepoint",
        "cgroups",
        "NVIDIA GPU",
        "upstream",
        "server.listen",
    ] {
        assert!(
            lines.lines().any(|l| l.contains(check)),
            "doctor checks {check}:\n{lines}"
        );
    }
    let gpu = lines
        .lines()
        .find(|l| l.contains("NVIDIA GPU"))
        .expect("gpu line");
    // A box without an NVIDIA GPU is information, not a fault.
    assert!(gpu.starts_with("notice") && gpu.contains("driver"), "{gpu}");
    let listen = lines
        .lines()
        .find(|l| l.contains("server.listen"))
        .expect("listen line");
    // A port held by a running guard is a warning (a reload keeps it; a second `guard run`
    // would need it stopped): nothing here stops guard, so doctor exits 0.
    assert!(
        listen.starts_with("warning") && listen.contains("guard"),
        "guard itself holds the port: {listen}"
    );
    assert!(doctor.status.success(), "{lines}");
}

/// Watching leaves llama-server free to fall asleep (`--sleep-idle-seconds`): while guard runs
/// nothing there, the watcher reads only endpoints that answer from the server's cache
/// (`/slots`, read every tick, kept it awake for good). A request through guard wakes it.
#[tokio::test(flavor = "multi_thread")]
async fn watching_lets_an_idle_llama_server_fall_asleep() {
    let _serial = serial().await;
    let llama = LlamaServer::start_with(1, &["--sleep-idle-seconds", "1"]).await;
    // CLASSES has the watcher sample every 200 ms: five times in each idle second.
    let guard = GuardProcess::start(llama.addr, "openai", CLASSES);
    let started = Instant::now();
    let asleep = |props: &serde_json::Value| props["is_sleeping"] == true;
    loop {
        let status = guard.status().await;
        let props = get(llama.addr, "/props").await.expect("props").json();
        if status["watch"]["upstream"]["up"] == true && asleep(&props) {
            assert_eq!(status["watch"]["upstream"]["slots"], 1, "{status}");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "llama-server never fell asleep under guard's watch: {props} {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let body = json!({ "prompt": "Hello", "n_predict": 2 });
    let answer = post(guard.listen, "/completion", &[], &body).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    let props = get(llama.addr, "/props").await.expect("props").json();
    assert!(!asleep(&props), "the request woke it: {props}");
}

#[tokio::test(flavor = "multi_thread")]
async fn status_sets_concurrency_beside_the_llama_server_slots() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let extra = format!("{CLASSES}[upstream]\nmax_concurrency = 2\n");
    let guard = GuardProcess::start(llama.addr, "openai", &extra);
    let started = Instant::now();
    let slots = loop {
        let status = guard.status().await;
        if let Some(slots) = status["watch"]["upstream"]["slots"].as_u64() {
            break slots;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        slots, 1,
        "llama-server's slots (/props), read by the watcher"
    );
    let output = Command::new(guard_bin())
        .args(["status", "--url", &format!("http://{}", guard.metrics)])
        .output()
        .expect("guard status");
    let table = String::from_utf8_lossy(&output.stdout);
    let line = table
        .lines()
        .find(|l| l.starts_with("concurrency"))
        .unwrap_or_default();
    assert!(
        line.contains("2 (the upstream has 1 slots: lower upstream.max_concurrency to 1)"),
        "{table}"
    );
    let models = get(llama.addr, "/v1/models").await.expect("models").json();
    let id = models["data"][0]["id"].as_str().expect("a model id");
    let text = guard.metrics_text().await;
    for series in ["guard_model_remote", "guard_model_cold_loads_total"] {
        assert_eq!(
            guard_tests::metric(&text, &format!("{series}{{model=\"{id}\"}}")),
            Some(0.0),
            "the model the watcher has seen, at 0:\n{text}"
        );
    }
}

fn promtool(args: &[&str], dir: &Path) -> String {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool (apt prometheus)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "promtool {args:?}: {text}");
    text
}

fn deploy() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy"))
}

#[test]
fn alert_rules_check_and_pass_their_unit_tests() {
    let dir = deploy().join("prometheus");
    assert!(promtool(&["check", "rules", "guard-alerts.yml"], &dir).contains("SUCCESS"));
    assert!(promtool(&["test", "rules", "guard-alerts.test.yml"], &dir).contains("SUCCESS"));
}

/// The guard_* metric names an expression text uses, without histogram suffixes.
fn named_metrics(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("guard_") {
        let tail = &rest[at..];
        let name: String = tail
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name)
            .to_owned();
        names.insert(base);
        rest = &tail[name.len().max(1)..];
    }
    names
}

/// An emulated Ollama that lists a local and a cloud model, with guard in front of it and no
/// request made yet: what a dashboard reads in the first minute.
async fn fresh_guard() -> (OllamaEmulator, GuardProcess) {
    let ollama = OllamaEmulator::start(&["--models", "smollm2:135m,gpt-oss:20b-cloud"]);
    let guard = GuardProcess::start(ollama.addr, "ollama", CLASSES);
    // The watcher has seen both models once the cloud one is flagged.
    guard
        .wait_for_metric("guard_model_remote{model=\"gpt-oss:20b-cloud\"}", 1.0)
        .await;
    (ollama, guard)
}

#[tokio::test(flavor = "multi_thread")]
async fn every_metric_of_the_dashboard_and_rules_exists_in_a_fresh_guard() {
    let _serial = serial().await;
    let (ollama, guard) = fresh_guard().await;
    let dashboard =
        std::fs::read_to_string(deploy().join("grafana/guard-dashboard.json")).expect("dashboard");
    let parsed: serde_json::Value =
        serde_json::from_str(&dashboard).expect("the dashboard is valid JSON");
    assert!(
        parsed["panels"].as_array().is_some_and(|p| p.len() > 10),
        "a Grafana dashboard with panels"
    );
    let rules =
        std::fs::read_to_string(deploy().join("prometheus/guard-alerts.yml")).expect("rules");
    let text = guard.metrics_text().await;
    let exported: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    let gpu_available = guard_tests::metric(&text, "guard_gpu_available") == Some(1.0);
    let ps = get(ollama.addr, "/api/ps").await.expect("/api/ps").json();
    let none_loaded = ps["models"].as_array().is_some_and(Vec::is_empty);
    let mut missing = Vec::new();
    for name in named_metrics(&dashboard).union(&named_metrics(&rules)) {
        // Per-GPU series exist only where NVML reads a GPU; guard_gpu_available says which.
        let per_gpu = name.starts_with("guard_gpu_") && name != "guard_gpu_available";
        // A share of a model off the GPU exists only while the model is loaded: 0 would claim
        // an unloaded model sits wholly in GPU memory.
        let per_loaded_model = name == "guard_model_cpu_offload_ratio";
        let may_be_absent = (per_gpu && !gpu_available) || (per_loaded_model && none_loaded);
        if !exported.contains(name.as_str()) && !may_be_absent {
            missing.push(name.clone());
        }
    }
    assert!(
        missing.is_empty(),
        "named but not exported: {missing:?}\n{text}"
    );
    for series in zero_series() {
        assert_eq!(
            guard_tests::metric(&text, &series),
            Some(0.0),
            "{series} is not at 0 in a fresh guard:\n{text}"
        );
    }
}

/// Series a rate() or increase() reads, which must exist at 0 before their first event: every
/// class, reason, outcome and model guard knows.
fn zero_series() -> Vec<String> {
    let mut series = Vec::new();
    for class in ["interactive", "batch"] {
        for reason in ["queue_full", "deadline_predicted", "body_bytes_full"] {
            series.push(format!(
                "guard_rejected_total{{class=\"{class}\",reason=\"{reason}\"}}"
            ));
        }
        for outcome in ["completed", "rejected", "reaped", "timed_out", "failed"] {
            series.push(format!(
                "guard_requests_total{{class=\"{class}\",outcome=\"{outcome}\"}}"
            ));
        }
        for stage in ["queued", "running"] {
            series.push(format!(
                "guard_reaped_total{{class=\"{class}\",stage=\"{stage}\"}}"
            ));
        }
        series.push(format!("guard_queue_depth{{class=\"{class}\"}}"));
        series.push(format!("guard_inflight{{class=\"{class}\"}}"));
        series.push(format!("guard_admitted_total{{class=\"{class}\"}}"));
        series.push(format!("guard_class_throttled{{class=\"{class}\"}}"));
        series.push(format!("guard_ttft_seconds_count{{class=\"{class}\"}}"));
        series.push(format!(
            "guard_queue_wait_seconds_count{{class=\"{class}\"}}"
        ));
    }
    for model in ["smollm2:135m", "gpt-oss:20b-cloud"] {
        series.push(format!("guard_model_cold_loads_total{{model=\"{model}\"}}"));
    }
    series.push("guard_model_remote{model=\"smollm2:135m\"}".to_owned());
    for reason in ["wait", "ttft", "swap", "memory_pressure", "gpu_memory"] {
        series.push(format!("guard_at_risk{{reason=\"{reason}\"}}"));
    }
    for result in ["ok", "refused"] {
        series.push(format!("guard_config_reloads_total{{result=\"{result}\"}}"));
    }
    series.push("guard_ebpf_ring_drops_total".to_owned());
    series
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_prometheus_scrapes_guard() {
    let _serial = serial().await;
    let (_ollama, guard) = watched_guard("").await;
    let dir = TempDir::new("guard-prometheus");
    let config = dir.0.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: guard\n    static_configs:\n      - targets: ['{}']\n",
            deploy().join("prometheus/guard-alerts.yml").display(),
            guard.metrics
        ),
    )
    .expect("write prometheus.yml");
    let web = free_addr();
    let _prometheus = ChildGuard(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.0.join("data").display()
            ))
            .arg(format!("--web.listen-address={web}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus (apt prometheus)"),
    );
    let started = Instant::now();
    let query = "/api/v1/query?query=guard_requests_total%7Bclass%3D%22interactive%22%2Coutcome%3D%22completed%22%7D";
    loop {
        if let Ok(response) = get(web, query).await
            && response.status == 200
        {
            let body = response.json();
            if let Some(value) = body["data"]["result"][0]["value"][1].as_str() {
                assert_eq!(value, "2", "Prometheus holds guard's count: {body}");
                assert_eq!(body["data"]["result"][0]["metric"]["job"], "guard");
                break;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "Prometheus never had guard's data"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rules = get(web, "/api/v1/rules").await.expect("rules").json();
    assert_eq!(
        rules["data"]["groups"][0]["name"], "guard",
        "the alert rules loaded"
    );
}

/// llama-server resets its throughput gauges on every GET of `/metrics`: guard watching it by
/// default must leave them to the user's own scraper. With `watch.upstream_metrics` (the old
/// behaviour) guard's reads take them first, which shows the check can fail.
#[tokio::test(flavor = "multi_thread")]
async fn watching_leaves_llama_servers_own_metrics_as_they_are() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    for reads_metrics in [false, true] {
        let guard = GuardProcess::start(
            llama.addr,
            "openai",
            &format!(
                "[class.interactive]\nmax_queue = 8\n[watch]\ninterval_ms = 100\nupstream_metrics = {reads_metrics}\n"
            ),
        );
        let body = json!({ "prompt": "Say hello to the world.", "n_predict": 8 });
        let answer = post(guard.listen, "/completion", &[], &body).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
        // Five watcher ticks: the window in which guard's own reads would reset the gauge.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let text = get(llama.addr, "/metrics").await.expect("metrics").text();
        let rate = guard_tests::metric(&text, "llamacpp:prompt_tokens_seconds").unwrap_or(0.0);
        if reads_metrics {
            assert_eq!(rate, 0.0, "guard's reads reset it first:\n{text}");
        } else {
            assert!(
                rate > 0.0,
                "the user's scraper reads the throughput:\n{text}"
            );
        }
        let status = guard.status().await;
        assert_eq!(status["watch"]["upstream"]["up"], true, "{status}");
        assert_eq!(status["watch"]["upstream"]["slots"], 1, "{status}");
    }
}
