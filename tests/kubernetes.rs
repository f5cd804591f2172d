//! deploy/kubernetes, checked offline: the core manifests against Kubernetes 1.37's schema
//! (`kubernetes-validate --strict`), the whole directory with `checkov` (every failed check
//! explained in docs/cluster.md), and the Prometheus operator's objects against what they mirror
//! (no schema ships offline for those), and the image the DaemonSet names is the one
//! `cargo xtask image` tags.

use std::{path::PathBuf, process::Command};

fn root() -> PathBuf {
    // checkov finds nothing under a path with `..` in it.
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("the repository")
}

fn manifests() -> PathBuf {
    root().join("deploy/kubernetes")
}

/// Where setup put the validators (`cargo xtask test` says).
fn tool(name: &str) -> PathBuf {
    let bin = std::env::var_os("GUARD_KUBE_TOOLS")
        .map_or_else(|| guard_tests_cache().join("kube-tools/bin"), PathBuf::from);
    bin.join(name)
}

fn guard_tests_cache() -> PathBuf {
    PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".to_owned()))
        .join(".cache/guard-dev")
}

fn run(command: &mut Command) -> (bool, String) {
    let output = command
        .output()
        .unwrap_or_else(|err| panic!("cannot start {command:?} (run `cargo xtask setup`): {err}"));
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

#[test]
fn the_core_manifests_pass_kubernetes_validate() {
    let files: Vec<PathBuf> = std::fs::read_dir(manifests())
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    let (ok, text) = run(Command::new(tool("kubernetes-validate"))
        .args(["--strict", "-k", "1.37.0"])
        .args(&files));
    assert!(ok, "{text}");
    for kind in ["namespace", "configmap", "daemonset", "service"] {
        assert!(
            text.lines()
                .any(|l| l.contains(&format!("passed for resource {kind}/"))),
            "{kind} not validated: {text}"
        );
    }
}

#[test]
fn checkov_fails_only_checks_the_readme_explains() {
    let (_, text) = run(Command::new(tool("checkov"))
        .args([
            "--skip-download",
            "--framework",
            "kubernetes",
            "--output",
            "json",
            "--quiet",
            "-d",
        ])
        .arg(manifests())
        // Nothing leaves the machine: no telemetry, no download of policies.
        .env("BC_SKIP_MAPPING", "TRUE")
        .env("CHECKOV_RUN_SCA_PACKAGE_SCAN_V2", "false"));
    let json_start = text.find('{').expect("checkov's report");
    let report: serde_json::Value = serde_json::Deserializer::from_str(&text[json_start..])
        .into_iter()
        .next()
        .expect("a JSON report")
        .expect("JSON");
    let failed: Vec<String> = report["results"]["failed_checks"]
        .as_array()
        .unwrap_or_else(|| panic!("no failed_checks in {report}"))
        .iter()
        .filter_map(|c| c["check_id"].as_str().map(str::to_owned))
        .collect();
    let passed = report["summary"]["passed"].as_u64().unwrap_or(0);
    assert!(passed > 50, "checkov ran its checks: {passed} passed");
    let page = std::fs::read_to_string(root().join("docs/cluster.md")).expect("docs/cluster.md");
    for id in &failed {
        assert!(
            page.contains(id.as_str()),
            "{id} fails and docs/cluster.md does not explain it"
        );
    }
    println!("checkov: {passed} passed, failed (each explained): {failed:?}");
}

#[test]
fn the_operator_objects_mirror_the_alert_rules_and_the_service() {
    // PyYAML comes with the validators; one script compares what no schema checks offline.
    let script = r#"
import sys, yaml
d = sys.argv[1]
load = lambda f: yaml.safe_load(open(f"{d}/{f}"))
rule, alerts = load("kubernetes/prometheusrule.yaml"), load("prometheus/guard-alerts.yml")
assert rule["spec"]["groups"] == alerts["groups"], "PrometheusRule and guard-alerts.yml differ"
monitor, service = load("kubernetes/servicemonitor.yaml"), load("kubernetes/service.yaml")
labels = service["metadata"]["labels"]
assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
ports = {p["name"] for p in service["spec"]["ports"]}
assert all(e["port"] in ports for e in monitor["spec"]["endpoints"]), "ServiceMonitor port"
print("ok")
"#;
    let (ok, text) = run(Command::new(tool("python3"))
        .arg("-c")
        .arg(script)
        .arg(root().join("deploy")));
    assert!(ok && text.trim() == "ok", "{text}");
}

#[test]
fn the_daemonset_names_the_image_cargo_xtask_image_builds() {
    let script = r#"
import sys, yaml
spec = yaml.safe_load(open(sys.argv[1]))["spec"]["template"]["spec"]
print(spec["containers"][0]["image"])
"#;
    let (ok, text) = run(Command::new(tool("python3"))
        .arg("-c")
        .arg(script)
        .arg(manifests().join("daemonset.yaml")));
    assert!(ok, "{text}");
    // `cargo xtask image` tags localhost/guard:VERSION; a runtime finds it as guard:VERSION.
    assert_eq!(
        text.trim(),
        format!("guard:{}", env!("CARGO_PKG_VERSION")),
        "the DaemonSet names another image than the one `cargo xtask image` builds"
    );
}
