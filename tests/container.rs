//! deploy/kubernetes's DaemonSet, run: the pod spec of daemonset.yaml and the config of
//! configmap.yaml (read from the files, not copied) become one `podman run` of the image
//! `cargo xtask image` builds, with the same capabilities, read-only root, host network,
//! hostPath mounts, config map, limits and grace period; unknown fields fail rather than
//! being ignored. Beside a real llama-server, guard must attach its eBPF program, reap a
//! real client's close, freeze and restore a real batch cgroup through the mounted class
//! cgroups, and answer /metrics and /status with no capability beyond what the manifest
//! grants. The same run with the manifest's capabilities cut short must fail those checks.
//! Where podman cannot start a container, each test says why in one line and passes.

#[path = "container/pod.rs"]
mod pod;
#[path = "container/run.rs"]
mod run;

use std::process::Command;

use guard_tests::require_root;
use serde_json::Value;

use crate::pod::Manifests;

/// The capability the manifest must grant for guard's eBPF program to load.
const NEEDED_FOR_EBPF: &str = "BPF";

/// `cargo xtask image` (a second run finds the image up to date); None, with the reason
/// printed, where podman is missing or cannot start a container here.
fn image_or_skip() -> Option<()> {
    if Command::new("podman").arg("--version").output().is_err() {
        println!("container: skipped: podman is not installed; fix: cargo xtask setup");
        return None;
    }
    if let Err(why) = run::has_storage() {
        println!("container: skipped: podman cannot store images here: {why}");
        return None;
    }
    guard_tests::xtask(&["image".as_ref()]);
    if let Err(why) =
        run::can_start_containers(&format!("localhost/guard:{}", env!("CARGO_PKG_VERSION")))
    {
        println!("container: skipped: podman cannot start a container here: {why}");
        return None;
    }
    Some(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_daemonset_runs_under_podman_as_the_manifest_says() {
    require_root();
    let _serial = guard_tests::serial().await;
    if image_or_skip().is_none() {
        return;
    }
    let manifests = Manifests::read(&guard_tests::workspace().join("deploy/kubernetes"));
    let image = manifests.image();
    assert_eq!(
        image,
        format!("guard:{}", env!("CARGO_PKG_VERSION")),
        "the DaemonSet names the image `cargo xtask image` tags"
    );
    match run::check(&manifests).await {
        Ok(seen) => println!("container: {seen}"),
        Err(failure) => panic!("the DaemonSet does not work under podman: {failure}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_manifest_without_the_bpf_capability_fails_the_checks() {
    require_root();
    let _serial = guard_tests::serial().await;
    if image_or_skip().is_none() {
        return;
    }
    let mut manifests = Manifests::read(&guard_tests::workspace().join("deploy/kubernetes"));
    let added = manifests.container_mut()["securityContext"]["capabilities"]["add"]
        .as_array_mut()
        .expect("the manifest adds capabilities");
    added.retain(|cap| cap != &Value::from(NEEDED_FOR_EBPF));
    let failed = run::check(&manifests)
        .await
        .expect_err("guard ran as if nothing were missing");
    assert!(
        failed.failure.starts_with(run::EBPF_NOT_ATTACHED),
        "failed for another reason: {failed}"
    );
    println!("container: without CAP_BPF: {failed}");
}

#[test]
fn unknown_fields_in_the_pod_spec_are_refused() {
    let mut manifests = Manifests::read(&guard_tests::workspace().join("deploy/kubernetes"));
    manifests.container_mut()["volumeDevices"] = serde_json::json!([]);
    let dir = guard_tests::TempDir::new("guard-container-unknown");
    let refused = pod::translate(&manifests, &dir.0).expect_err("an unknown field passed");
    assert!(refused.contains("volumeDevices"), "{refused}");

    let mut manifests = Manifests::read(&guard_tests::workspace().join("deploy/kubernetes"));
    manifests.pod_mut()["volumes"][0]["nfs"] = serde_json::json!({"server": "x"});
    let refused = pod::translate(&manifests, &dir.0).expect_err("an nfs volume passed");
    assert!(refused.contains("nfs"), "{refused}");
}
