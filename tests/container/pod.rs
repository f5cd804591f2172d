//! The DaemonSet's pod spec and config map, read from deploy/kubernetes, and their translation
//! into `podman run` options. Every field either becomes an option or is named here as
//! having no effect on one node; anything else is refused, so that no change to the
//! manifest goes untested.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;

/// The two manifests, as JSON.
pub struct Manifests {
    pub daemonset: Value,
    pub configmaps: Vec<Value>,
}

impl Manifests {
    /// Reads daemonset.yaml and configmap.yaml with PyYAML (setup's validators' Python).
    pub fn read(dir: &Path) -> Self {
        let daemonset = yaml(&dir.join("daemonset.yaml"));
        let configmaps = yaml(&dir.join("configmap.yaml"));
        let daemonset = daemonset
            .into_iter()
            .find(|doc| doc["kind"] == "DaemonSet")
            .expect("daemonset.yaml holds a DaemonSet");
        let configmaps = configmaps
            .into_iter()
            .filter(|doc| doc["kind"] == "ConfigMap")
            .collect();
        Self {
            daemonset,
            configmaps,
        }
    }

    pub fn pod(&self) -> &Value {
        &self.daemonset["spec"]["template"]["spec"]
    }

    pub fn pod_mut(&mut self) -> &mut Value {
        &mut self.daemonset["spec"]["template"]["spec"]
    }

    pub fn container(&self) -> &Value {
        &self.pod()["containers"][0]
    }

    pub fn container_mut(&mut self) -> &mut Value {
        &mut self.pod_mut()["containers"][0]
    }

    pub fn image(&self) -> String {
        self.container()["image"]
            .as_str()
            .expect("an image")
            .to_owned()
    }

    fn configmap(&self, name: &str) -> Option<&Value> {
        self.configmaps
            .iter()
            .find(|map| map["metadata"]["name"] == name)
    }
}

/// All documents of a YAML file, as JSON.
fn yaml(file: &Path) -> Vec<Value> {
    let bin = std::env::var_os("GUARD_KUBE_TOOLS").map_or_else(
        || {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                .join(".cache/guard-dev/kube-tools/bin")
        },
        PathBuf::from,
    );
    let out = Command::new(bin.join("python3"))
        .args([
            "-c",
            "import sys, json, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(file)
        .output()
        .expect("run the validators' python3 (cargo xtask setup)");
    assert!(
        out.status.success(),
        "{}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("PyYAML's JSON")
}

/// A mount of the node's (or the config map's) directory into the container.
#[derive(Debug, Clone)]
pub struct Mount {
    pub host: PathBuf,
    pub container: PathBuf,
    pub read_only: bool,
}

/// What `podman run` gets, and what the test needs to know of the pod.
#[derive(Debug)]
pub struct PodmanRun {
    pub options: Vec<String>,
    pub image: String,
    pub args: Vec<String>,
    pub mounts: Vec<Mount>,
    /// terminationGracePeriodSeconds: `podman stop -t`.
    pub grace_s: u64,
    /// The readiness probe: path and port (hostNetwork: on the node's loopback).
    pub ready: (String, u16),
    /// The capabilities the container adds (`BPF`), after dropping ALL.
    pub capabilities: Vec<String>,
}

/// Fields with no effect on a single node run by podman, and why.
const NO_EFFECT_POD: &[&str] = &[
    // Resolves cluster names; the test reaches everything by address.
    "dnsPolicy",
    // No service account exists outside a cluster.
    "automountServiceAccountToken",
    "serviceAccountName",
    // Scheduling: which nodes, not how the pod runs on one.
    "nodeSelector",
    "tolerations",
    "affinity",
    "priorityClassName",
];
const NO_EFFECT_CONTAINER: &[&str] = &[
    "name",
    // The test runs the image it built (`--pull=never`).
    "imagePullPolicy",
    // hostNetwork: ports are the config's own listen addresses.
    "ports",
    // The kubelet's; the test polls the readiness probe itself.
    "livenessProbe",
];

/// Translates the pod spec into podman options; config map files go into `config_dir`.
pub fn translate(manifests: &Manifests, config_dir: &Path) -> Result<PodmanRun, String> {
    let pod = manifests.pod();
    let mut options = vec![
        "--pull=never".to_owned(),
        // Kubernetes mounts no tmpfs over a read-only root; podman would.
        "--read-only-tmpfs=false".to_owned(),
        "--systemd=false".to_owned(),
    ];
    options.extend(pod_options(pod)?);
    let containers = pod["containers"].as_array().ok_or("no containers")?;
    if containers.len() != 1 || pod.get("initContainers").is_some() {
        return Err("the test runs a pod of exactly one container".into());
    }
    let container = &containers[0];
    check_keys(
        container,
        "container",
        &[
            "image",
            "args",
            "command",
            "env",
            "securityContext",
            "resources",
            "readinessProbe",
            "volumeMounts",
        ],
        NO_EFFECT_CONTAINER,
    )?;
    let (security, capabilities) = security_options(pod, container, config_dir)?;
    options.extend(security);
    options.extend(resource_options(&container["resources"])?);
    options.extend(env_options(&container["env"])?);
    let mounts = mounts(manifests, container, config_dir)?;
    for mount in &mounts {
        let mode = if mount.read_only { "ro" } else { "rw" };
        options.push(format!(
            "--volume={}:{}:{mode}",
            mount.host.display(),
            mount.container.display()
        ));
    }
    let (args, entrypoint) = arguments(container)?;
    options.extend(entrypoint);
    Ok(PodmanRun {
        options,
        image: container["image"].as_str().ok_or("no image")?.to_owned(),
        args,
        mounts,
        grace_s: pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30),
        ready: readiness(container)?,
        capabilities,
    })
}

/// Pod-level fields: the host's network (and PID and IPC namespaces, where asked for).
fn pod_options(pod: &Value) -> Result<Vec<String>, String> {
    check_keys(
        pod,
        "pod",
        &[
            "hostNetwork",
            "hostPID",
            "hostIPC",
            "terminationGracePeriodSeconds",
            "securityContext",
            "containers",
            "volumes",
        ],
        NO_EFFECT_POD,
    )?;
    let host = |key: &str| pod[key].as_bool().unwrap_or(false);
    let mut options = vec![if host("hostNetwork") {
        "--network=host".to_owned()
    } else {
        // A pod network of its own: nothing on the node's loopback reaches it.
        "--network=none".to_owned()
    }];
    if host("hostPID") {
        options.push("--pid=host".into());
    }
    if host("hostIPC") {
        options.push("--ipc=host".into());
    }
    Ok(options)
}

/// The container's (and pod's) security context: user, capabilities, privilege escalation,
/// read-only root, seccomp. Returns the options and the added capabilities.
fn security_options(
    pod: &Value,
    container: &Value,
    dir: &Path,
) -> Result<(Vec<String>, Vec<String>), String> {
    let pod_security = &pod["securityContext"];
    check_keys(
        pod_security,
        "pod securityContext",
        &["seccompProfile", "runAsUser", "runAsGroup"],
        &[],
    )?;
    let security = &container["securityContext"];
    check_keys(
        security,
        "container securityContext",
        &[
            "privileged",
            "allowPrivilegeEscalation",
            "readOnlyRootFilesystem",
            "runAsUser",
            "runAsGroup",
            "capabilities",
            "seccompProfile",
        ],
        &[],
    )?;
    let field = |key: &str| {
        let own = &security[key];
        if own.is_null() {
            &pod_security[key]
        } else {
            own
        }
    };
    let mut options = Vec::new();
    if security["privileged"].as_bool() == Some(true) {
        options.push("--privileged".to_owned());
    }
    if security["allowPrivilegeEscalation"].as_bool() == Some(false) {
        options.push("--security-opt=no-new-privileges".into());
    }
    if security["readOnlyRootFilesystem"].as_bool() == Some(true) {
        options.push("--read-only".into());
    }
    let user = field("runAsUser").as_u64().unwrap_or(0);
    let group = field("runAsGroup").as_u64().unwrap_or(0);
    options.push(format!("--user={user}:{group}"));
    match field("seccompProfile")["type"].as_str() {
        None | Some("RuntimeDefault") => {
            let profile = runtime_default(dir)?;
            options.push(format!("--security-opt=seccomp={}", profile.display()));
        }
        Some("Unconfined") => options.push("--security-opt=seccomp=unconfined".into()),
        Some(other) => return Err(format!("seccompProfile type {other} is not supported")),
    }
    let capabilities = &security["capabilities"];
    check_keys(capabilities, "capabilities", &["drop", "add"], &[])?;
    let names = |key: &str| -> Vec<String> {
        capabilities[key]
            .as_array()
            .map(|list| {
                list.iter()
                    .filter_map(|c| c.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    for dropped in names("drop") {
        options.push(format!("--cap-drop={dropped}"));
    }
    let added = names("add");
    for cap in &added {
        options.push(format!("--cap-add=CAP_{cap}"));
    }
    Ok((options, added))
}

/// This host's podman profile.
const PODMAN_SECCOMP: &str = "/usr/share/containers/seccomp.json";

/// `RuntimeDefault` as containerd (the runtime of most nodes) defines it: podman's default
/// profile, which on Debian 12 (containers-common 0.50) allows bpf(2) and perf_event_open(2)
/// only with CAP_SYS_ADMIN, plus what containerd's default adds: bpf with CAP_BPF,
/// perf_event_open with CAP_PERFMON (contrib/seccomp/seccomp_default.go). Without either,
/// both still fail with EPERM. Written to `dir`; returns its path.
fn runtime_default(dir: &Path) -> Result<PathBuf, String> {
    const GATED: [(&str, &str); 2] = [("bpf", "CAP_BPF"), ("perf_event_open", "CAP_PERFMON")];
    let text =
        std::fs::read_to_string(PODMAN_SECCOMP).map_err(|e| format!("{PODMAN_SECCOMP}: {e}"))?;
    let mut profile: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let rules = profile["syscalls"]
        .as_array_mut()
        .ok_or("a seccomp profile without syscalls")?;
    for rule in rules.iter_mut().filter(|r| r["action"] == "SCMP_ACT_ERRNO") {
        if let Some(names) = rule["names"].as_array_mut() {
            names.retain(|name| !GATED.iter().any(|(call, _)| name == call));
        }
    }
    for (call, cap) in GATED {
        rules.push(serde_json::json!({
            "names": [call], "action": "SCMP_ACT_ALLOW", "includes": {"caps": [cap]},
        }));
        rules.push(serde_json::json!({
            "names": [call], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
            "excludes": {"caps": ["CAP_SYS_ADMIN", cap]},
        }));
    }
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let path = dir.join("runtime-default-seccomp.json");
    std::fs::write(&path, profile.to_string()).map_err(|e| e.to_string())?;
    Ok(path)
}

/// CPU and memory limits (requests only place the pod).
fn resource_options(resources: &Value) -> Result<Vec<String>, String> {
    check_keys(resources, "resources", &["limits"], &["requests"])?;
    let limits = &resources["limits"];
    check_keys(limits, "limits", &["cpu", "memory"], &[])?;
    let mut options = Vec::new();
    if let Some(cpu) = limits["cpu"].as_str() {
        let cpus = match cpu.strip_suffix('m') {
            Some(milli) => milli.parse::<f64>().map_err(|e| e.to_string())? / 1000.0,
            None => cpu.parse::<f64>().map_err(|e| e.to_string())?,
        };
        options.push(format!("--cpus={cpus}"));
    }
    if let Some(memory) = limits["memory"].as_str() {
        let bytes = quantity_bytes(memory).ok_or_else(|| format!("memory limit {memory}"))?;
        options.push(format!("--memory={bytes}b"));
    }
    Ok(options)
}

/// `256Mi`, `1Gi`, `500M` in bytes.
fn quantity_bytes(quantity: &str) -> Option<u64> {
    let split = quantity.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = quantity.split_at(split);
    let scale: u64 = match unit {
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "K" | "k" => 1000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => return None,
    };
    Some(number.parse::<u64>().ok()? * scale)
}

fn env_options(env: &Value) -> Result<Vec<String>, String> {
    let Some(list) = env.as_array() else {
        return Ok(Vec::new());
    };
    list.iter()
        .map(|var| {
            check_keys(var, "env", &["name", "value"], &[])?;
            Ok(format!(
                "--env={}={}",
                var["name"].as_str().ok_or("env name")?,
                var["value"].as_str().unwrap_or("")
            ))
        })
        .collect()
}

/// The volume mounts, each from its volume: a config map's keys written to `config_dir`, or
/// a hostPath (created first for DirectoryOrCreate, required for Directory).
fn mounts(
    manifests: &Manifests,
    container: &Value,
    config_dir: &Path,
) -> Result<Vec<Mount>, String> {
    let volumes: BTreeMap<&str, &Value> = manifests.pod()["volumes"]
        .as_array()
        .ok_or("no volumes")?
        .iter()
        .filter_map(|v| Some((v["name"].as_str()?, v)))
        .collect();
    let mut mounts = Vec::new();
    for mount in container["volumeMounts"]
        .as_array()
        .ok_or("no volumeMounts")?
    {
        check_keys(
            mount,
            "volumeMount",
            &["name", "mountPath", "readOnly"],
            &[],
        )?;
        let name = mount["name"].as_str().ok_or("a volumeMount's name")?;
        let volume = volumes
            .get(name)
            .ok_or_else(|| format!("no volume {name}"))?;
        let host = volume_source(manifests, volume, &config_dir.join(name))?;
        mounts.push(Mount {
            host,
            container: PathBuf::from(mount["mountPath"].as_str().ok_or("a mountPath")?),
            read_only: mount["readOnly"].as_bool().unwrap_or(false),
        });
    }
    // Outer mounts first (/sys/fs/cgroup before /sys/fs/cgroup/guard), as the kubelet sorts.
    mounts.sort_by_key(|m| m.container.components().count());
    Ok(mounts)
}

/// Where a volume's files are on this node.
fn volume_source(manifests: &Manifests, volume: &Value, dir: &Path) -> Result<PathBuf, String> {
    check_keys(volume, "volume", &["name", "configMap", "hostPath"], &[])?;
    if let Some(map) = volume.get("configMap") {
        check_keys(map, "configMap", &["name"], &[])?;
        let name = map["name"].as_str().ok_or("a configMap's name")?;
        let data = manifests
            .configmap(name)
            .ok_or_else(|| format!("no ConfigMap {name} in configmap.yaml"))?["data"]
            .as_object()
            .ok_or("a ConfigMap without data")?;
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        for (key, value) in data {
            std::fs::write(dir.join(key), value.as_str().unwrap_or(""))
                .map_err(|e| e.to_string())?;
        }
        return Ok(dir.to_owned());
    }
    let host = volume
        .get("hostPath")
        .ok_or("a volume that is neither configMap nor hostPath")?;
    check_keys(host, "hostPath", &["path", "type"], &[])?;
    let path = PathBuf::from(host["path"].as_str().ok_or("a hostPath's path")?);
    match host["type"].as_str().unwrap_or("") {
        "DirectoryOrCreate" => {
            std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?
        }
        "Directory" | "" if path.is_dir() => {}
        "Directory" => {
            return Err(format!(
                "hostPath {} is not a directory on this node",
                path.display()
            ));
        }
        other => return Err(format!("hostPath type {other} is not supported")),
    }
    Ok(path)
}

/// The container's arguments, and `--entrypoint` where it sets a command.
fn arguments(container: &Value) -> Result<(Vec<String>, Vec<String>), String> {
    let strings = |value: &Value| -> Vec<String> {
        value
            .as_array()
            .map(|list| {
                list.iter()
                    .filter_map(|a| a.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut args = strings(&container["args"]);
    let command = strings(&container["command"]);
    let mut entrypoint = Vec::new();
    if let Some((first, rest)) = command.split_first() {
        entrypoint.push(format!("--entrypoint={first}"));
        args = rest.iter().cloned().chain(args).collect();
    }
    Ok((args, entrypoint))
}

/// The readiness probe's path and port (a named port looked up in `ports`).
fn readiness(container: &Value) -> Result<(String, u16), String> {
    let get = &container["readinessProbe"]["httpGet"];
    let path = get["path"]
        .as_str()
        .ok_or("a readiness probe with httpGet.path")?;
    let port = match &get["port"] {
        Value::Number(n) => n.as_u64(),
        Value::String(name) => container["ports"]
            .as_array()
            .and_then(|ports| ports.iter().find(|p| p["name"] == name.as_str()))
            .and_then(|p| p["containerPort"].as_u64()),
        _ => None,
    }
    .ok_or("the readiness probe's port")?;
    Ok((
        path.to_owned(),
        u16::try_from(port).map_err(|e| e.to_string())?,
    ))
}

/// Err naming the first key of `object` that is neither `known` nor `no_effect`.
fn check_keys(
    object: &Value,
    what: &str,
    known: &[&str],
    no_effect: &[&str],
) -> Result<(), String> {
    let Some(map) = object.as_object() else {
        return Ok(());
    };
    match map
        .keys()
        .find(|key| !known.contains(&key.as_str()) && !no_effect.contains(&key.as_str()))
    {
        Some(key) => Err(format!(
            "{what} field `{key}` is unknown to this test: teach tests/container/pod.rs what it does"
        )),
        None => Ok(()),
    }
}
