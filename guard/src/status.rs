//! `guard status`: asks a running guard's /status and prints it as a table.

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("`{url}` is not a URL: {reason}")]
    BadUrl { url: String, reason: String },
    #[error(
        "no guard answered at {url}: {reason} (is `guard run` running, and is this its metrics.listen?)"
    )]
    Unreachable { url: String, reason: String },
    #[error("{url} answered something that is not guard's status: {reason}")]
    NotStatus { url: String, reason: String },
}

/// Fetches `<base>/status` and renders it.
pub async fn show(base: &str) -> Result<String, StatusError> {
    let url = format!("{}/status", base.trim_end_matches('/'));
    let uri: http::Uri = url
        .parse()
        .map_err(|err: http::uri::InvalidUri| StatusError::BadUrl {
            url: url.clone(),
            reason: err.to_string(),
        })?;
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let unreachable = |reason: String| StatusError::Unreachable {
        url: url.clone(),
        reason,
    };
    let response = client
        .get(uri)
        .await
        .map_err(|err| unreachable(err.to_string()))?;
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|err| unreachable(err.to_string()))?
        .to_bytes();
    let status: serde_json::Value =
        serde_json::from_slice(&body).map_err(|err| StatusError::NotStatus {
            url: url.clone(),
            reason: err.to_string(),
        })?;
    Ok(render(&status))
}

/// The status document as a readable table.
pub fn render(status: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "-".to_owned(),
        other => other.to_string(),
    };
    let mut out = String::new();
    let line = |out: &mut String, key: &str, value: String| {
        out.push_str(&format!("{key:<18} {value}\n"));
    };
    line(&mut out, "version", text(&status["version"]));
    line(
        &mut out,
        "uptime",
        format!("{} s", text(&status["uptime_seconds"])),
    );
    line(&mut out, "listen", text(&status["listen"]));
    line(&mut out, "upstream", text(&status["upstream"]["url"]));
    let ebpf = &status["ebpf"];
    let ebpf_state = if ebpf["attached"] == serde_json::Value::Bool(true) {
        format!(
            "attached ({} events, {} dropped)",
            text(&ebpf["events_total"]),
            text(&ebpf["ring_drops_total"])
        )
    } else {
        format!("off: {}", text(&ebpf["unavailable_reason"]))
    };
    line(&mut out, "ebpf", ebpf_state);
    let list = |v: &serde_json::Value| {
        let items: Vec<String> = v.as_array().into_iter().flatten().map(text).collect();
        if items.is_empty() {
            "none".to_owned()
        } else {
            items.join(", ")
        }
    };
    line(&mut out, "at risk", list(&status["risk"]["signals"]));
    line(
        &mut out,
        "throttled",
        list(&status["risk"]["throttled_classes"]),
    );
    out.push_str(&format!(
        "\n{:<14} {:>8} {:>9} {:>11} {:>7} {:>8} {:>9}\n",
        "class", "priority", "max_queue", "deadline_ms", "queued", "running", "wait_ms"
    ));
    for class in status["classes"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{:<14} {:>8} {:>9} {:>11} {:>7} {:>8} {:>9}\n",
            text(&class["name"]),
            text(&class["priority"]),
            text(&class["max_queue"]),
            text(&class["deadline_ms"]),
            text(&class["queued"]),
            text(&class["running"]),
            text(&class["predicted_wait_ms"]),
        ));
    }
    out
}
