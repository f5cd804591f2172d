//! Who a client is decides its class: a bearer token (given as a file or a digest, never in
//! the config), a real process's cgroup, systemd unit and user, read from the eBPF record of
//! its connect(). The class header may only lower urgency, unless a rule trusts it; a refused
//! claim is served in the client's own class and counted. The daemon drops every capability it
//! no longer needs and still knows who its clients are. `/metrics` and `/status` may require a
//! token and never show prompts or tokens.

use std::{
    path::Path,
    process::{Command, Stdio},
};

use bytes::Bytes;
use guard_tests::{
    TempDir,
    body::ollama_generate,
    cgroup2_root, guard_bin,
    http::{post, send},
    metric, require_root, serial,
    servers::{GuardProcess, OllamaEmulator},
};
use serde_json::json;
use sha2::Digest as _;

const CLASSES: &str = "[class.interactive]\npriority = 0\nmax_queue = 8\ndeadline_ms = 5000\n\
                       [class.batch]\npriority = 10\nmax_queue = 100\n";

const PROMPT: &str = "the secret plan is 42";

fn generate() -> serde_json::Value {
    ollama_generate(PROMPT)
}

/// The class guard served a request in, as its answer says.
fn served_in(response: &guard_tests::http::Response) -> String {
    assert_eq!(response.status, 200, "{}", response.text());
    response.header("x-guard-class").unwrap_or("-").to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_token_cannot_claim_interactive_but_a_trusted_front_end_can() {
    let _serial = serial().await;
    let secrets = TempDir::new("guard-identity-tokens");
    let token_file = secrets.0.join("batch.token");
    std::fs::write(&token_file, "nightly-token\n").expect("write the token file");
    let front = hex::encode(sha2::Sha256::digest(b"front-end-token"));
    let ollama = OllamaEmulator::start(&["--tokens", "2"]);
    let config = format!(
        "{CLASSES}[[classify.rule]]\nclass = \"batch\"\nname = \"nightly\"\nbearer_file = \"{}\"\n\
         [[classify.rule]]\nclass = \"batch\"\nname = \"front end\"\nbearer_sha256 = \"{front}\"\n\
         trust_header = true\n",
        token_file.display()
    );
    let guard = GuardProcess::start(ollama.addr, "ollama", &config);
    let ask = async |token: &str, claim: &str| {
        let auth = format!("Bearer {token}");
        let headers = [("authorization", auth.as_str()), ("x-guard-class", claim)];
        post(guard.listen, "/api/generate", &headers, &generate()).await
    };
    // The batch token claims interactive: served as batch, counted.
    assert_eq!(
        served_in(&ask("nightly-token", "interactive").await),
        "batch"
    );
    // The trusted front end may claim any class.
    assert_eq!(
        served_in(&ask("front-end-token", "interactive").await),
        "interactive"
    );
    // Anyone may ask to be less urgent; a near miss of the token is just anyone.
    assert_eq!(served_in(&ask("nightly-tokenx", "batch").await), "batch");
    // An unknown class is still a 400.
    assert_eq!(ask("nightly-token", "vip").await.status, 400);

    let text = guard.metrics_text().await;
    let m = |series: &str| metric(&text, series);
    assert_eq!(
        m("guard_class_claims_refused_total{claimed=\"interactive\",class=\"batch\"}"),
        Some(1.0)
    );
    assert_eq!(
        m("guard_classified_total{by=\"nightly\",class=\"batch\"}"),
        Some(1.0)
    );
    assert_eq!(
        m("guard_classified_total{by=\"header\",class=\"interactive\"}"),
        Some(1.0)
    );
    let status = guard.status().await;
    assert_eq!(status["classified"]["batch"]["nightly"], 1, "{status}");
    assert_eq!(status["classified"]["batch"]["header"], 1, "{status}");
    let table = Command::new(guard_bin())
        .args(["status", "--url", &format!("http://{}", guard.metrics)])
        .output()
        .expect("guard status");
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("nightly: 1"), "{table}");
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_and_status_may_require_a_token_and_never_show_prompts_or_tokens() {
    let _serial = serial().await;
    let secrets = TempDir::new("guard-identity-metrics");
    let token_file = secrets.0.join("metrics.token");
    std::fs::write(&token_file, "scraper-token\n").expect("write the token file");
    let ollama = OllamaEmulator::start(&["--tokens", "2"]);
    let config = format!(
        "{CLASSES}[metrics]\nbearer_token_file = \"{}\"\n[[classify.rule]]\nclass = \"batch\"\n\
         bearer = \"client-token\"\n",
        token_file.display()
    );
    let guard = GuardProcess::start(ollama.addr, "ollama", &config);
    let auth = [("authorization", "Bearer client-token")];
    assert_eq!(
        served_in(&post(guard.listen, "/api/generate", &auth, &generate()).await),
        "batch"
    );
    for path in ["/metrics", "/status"] {
        let get = async |headers: &[(&str, &str)]| {
            send(guard.metrics, "GET", path, headers, Bytes::new())
                .await
                .expect("the metrics listener answers")
        };
        let open = get(&[]).await;
        assert_eq!(open.status, 401, "{path} without a token");
        assert_eq!(open.header("www-authenticate"), Some("Bearer"));
        assert_eq!(get(&[("authorization", "Bearer wrong")]).await.status, 401);
        let answer = get(&[("authorization", "Bearer scraper-token")]).await;
        assert_eq!(answer.status, 200, "{path} with the token");
        let text = answer.text();
        for secret in [PROMPT, "client-token", "scraper-token"] {
            assert!(!text.contains(secret), "{path} shows {secret:?}");
        }
    }
    let table = Command::new(guard_bin())
        .args(["status", "--url", &format!("http://{}", guard.metrics)])
        .arg("--token-file")
        .arg(&token_file)
        .output()
        .expect("guard status");
    assert!(
        table.status.success(),
        "{}",
        String::from_utf8_lossy(&table.stderr)
    );
    let refused = Command::new(guard_bin())
        .args(["status", "--url", &format!("http://{}", guard.metrics)])
        .output()
        .expect("guard status");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--token-file"));
}

/// Runs curl (a real client process) against guard, claiming interactive, from `cgroup` (which
/// it joins first) and as `uid`. Returns the class guard served it in.
fn curl_claiming_interactive(
    guard: &GuardProcess,
    cgroup: Option<&Path>,
    uid: Option<u32>,
) -> String {
    use std::os::unix::process::CommandExt as _;
    let url = format!("http://{}/api/generate", guard.listen);
    let body = generate().to_string();
    let curl = format!(
        "exec curl -s -o /dev/null -D - -H 'x-guard-class: interactive' \
         -H 'content-type: application/json' -d '{body}' {url}"
    );
    let script = match cgroup {
        Some(cgroup) => format!("echo $$ > {}/cgroup.procs && {curl}", cgroup.display()),
        None => curl,
    };
    let mut command = Command::new("sh");
    command.args(["-c", &script]).stderr(Stdio::inherit());
    if let Some(uid) = uid {
        command.uid(uid).gid(uid);
    }
    let out = command.output().expect("run curl");
    let head = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    head.lines()
        .find_map(|l| l.strip_prefix("x-guard-class:"))
        .map(|c| c.trim().to_owned())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_process_is_classified_by_its_cgroup_unit_and_user_with_no_capability_left() {
    require_root();
    let _serial = serial().await;
    let root = cgroup2_root();
    let slice = guard_tests::TestCgroup::new(&root, "guard-test.slice");
    let batch = guard_tests::TestCgroup::new(&slice.path, "batch");
    let unit = slice.path.join("nightly-extract.service");
    std::fs::create_dir_all(&unit).expect("create the unit's cgroup");
    let unit = guard_tests::TestCgroup { path: unit };
    let elsewhere = guard_tests::TestCgroup::new(&slice.path, "interactive-app");
    let relative = |p: &Path| format!("/{}", p.strip_prefix(&root).expect("under root").display());
    let ollama = OllamaEmulator::start(&["--tokens", "2"]);
    // watch.upstream_pid names the upstream, and no rule reads executables: guard needs no
    // /proc scan of other processes, so it keeps no capability at all.
    let config = format!(
        "{CLASSES}[watch]\nupstream_pid = 1\n\
         [[classify.rule]]\nclass = \"batch\"\ncgroup_prefix = \"{}\"\n\
         [[classify.rule]]\nclass = \"batch\"\nunit = \"nightly-extract.service\"\n\
         [[classify.rule]]\nclass = \"batch\"\nuid = \"nobody\"\n",
        relative(&batch.path)
    );
    let guard = GuardProcess::start(ollama.addr, "ollama", &config);
    let status = guard.status().await;
    assert_eq!(status["ebpf"]["attached"], true, "{status}");
    assert_eq!(status["capabilities"], json!([]), "{status}");
    let served = |cgroup: Option<&Path>, uid| curl_claiming_interactive(&guard, cgroup, uid);
    assert_eq!(served(Some(&batch.path), None), "batch", "cgroup_prefix");
    assert_eq!(served(Some(&unit.path), None), "batch", "unit");
    assert_eq!(served(None, Some(65534)), "batch", "uid");
    assert_eq!(
        served(Some(&elsewhere.path), None),
        "interactive",
        "no rule matches"
    );
    let text = guard.metrics_text().await;
    assert_eq!(
        metric(
            &text,
            "guard_class_claims_refused_total{claimed=\"interactive\",class=\"batch\"}"
        ),
        Some(3.0)
    );
    for rule in 1..=3 {
        let series = format!("guard_classified_total{{by=\"rule {rule}\",class=\"batch\"}}");
        assert_eq!(metric(&text, &series), Some(1.0), "{series}");
    }
    drop((unit, batch, elsewhere));
}
