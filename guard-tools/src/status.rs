//! `guard status`: a running guard's `/status`, fetched and laid out as tables.

use bytes::Bytes;
use comfy_table::{CellAlignment, ColumnConstraint, Table, Width};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

use guard::status::Status;

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("`{url}` is not a URL: {reason}")]
    BadUrl { url: String, reason: String },
    #[error(
        "no guard answered at {url}: {reason} (is `guard run` running, and is this its metrics.listen?)"
    )]
    Unreachable { url: String, reason: String },
    #[error("{url} wants a bearer token: pass --token-file (metrics.bearer_token_file)")]
    Unauthorized { url: String },
    #[error("{url} answered something that is not guard's status: {reason}")]
    NotStatus { url: String, reason: String },
}

/// Fetches `<base>/status` (with the bearer token, where one is given) and renders it.
pub async fn show(base: &str, token: Option<&str>) -> Result<String, StatusError> {
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
    let mut request = http::Request::get(uri);
    if let Some(token) = token {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request
        .body(Empty::new())
        .map_err(|err| unreachable(err.to_string()))?;
    let response = client
        .request(request)
        .await
        .map_err(|err| unreachable(err.to_string()))?;
    if response.status() == http::StatusCode::UNAUTHORIZED {
        return Err(StatusError::Unauthorized { url });
    }
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|err| unreachable(err.to_string()))?
        .to_bytes();
    let status: Status = serde_json::from_slice(&body).map_err(|err| StatusError::NotStatus {
        url: url.clone(),
        reason: err.to_string(),
    })?;
    Ok(render(&status))
}

/// guard's concurrency beside the server's own slots, where it lists them: more than the
/// slots only moves the queue into the server, where guard cannot order or reap it.
fn concurrency(status: &Status) -> String {
    let max = status.upstream.max_concurrency;
    let slots = status.watch.upstream.as_ref().and_then(|u| u.slots);
    match slots {
        Some(slots) if max as usize > slots => format!(
            "{max} (the upstream has {slots} slots: lower upstream.max_concurrency to {slots})"
        ),
        Some(slots) => format!("{max} (the upstream has {slots} slots)"),
        None => max.to_string(),
    }
}

/// The status document as readable tables: its summary, then one table a part. Plain text,
/// columns a space apart, no borders or colours, so it reads the same in a pipe.
pub fn render(status: &Status) -> String {
    let sections = [
        Some(summary(status)),
        Some(classes(status)),
        Some(last_hour(status)),
        (!status.preemption.is_empty()).then(|| preemption(status)),
        Some(classified(status)),
    ];
    let tables: Vec<String> = sections.iter().flatten().map(Table::trim_fmt).collect();
    format!("{}\n", tables.join("\n\n"))
}

/// A table of `rows` under `header` (none: no header line), its first column at least
/// `first_width` wide and left-aligned, the others right-aligned from `right_from` on.
fn table<R: Into<comfy_table::Row>>(
    header: &[&str],
    rows: impl IntoIterator<Item = R>,
    first_width: u16,
    right_from: usize,
) -> Table {
    let mut table = Table::new();
    table.load_style(comfy_table::presets::NOTHING);
    if !header.is_empty() {
        table.set_header(header.to_vec());
    }
    table.add_rows(rows);
    for (index, column) in table.column_iter_mut().enumerate() {
        column.set_padding((0, 1));
        if index == 0 {
            column.set_constraint(ColumnConstraint::LowerBoundary(Width::Fixed(first_width)));
        }
        if index >= right_from {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    table
}

/// Where a class name heads a row: as wide as the longest, at least this.
const CLASS_WIDTH: u16 = 15;

/// What the daemon is and does: one key a line.
fn summary(status: &Status) -> Table {
    let ebpf = &status.ebpf;
    let ebpf = match &ebpf.unavailable_reason {
        None if ebpf.attached => format!(
            "attached ({} events, {} dropped)",
            ebpf.events_total, ebpf.ring_drops_total
        ),
        reason => format!("off: {}", reason.as_deref().unwrap_or("-")),
    };
    let list = |items: Vec<String>| match items.is_empty() {
        true => "none".to_owned(),
        false => items.join(", "),
    };
    let signals = status.risk.signals.iter().map(|s| s.as_str().to_owned());
    let cluster = &status.cluster;
    let router = format!(
        "waiting {}, running {}, kv usage {:.2}",
        cluster.waiting, cluster.running, cluster.usage
    );
    let rows = [
        ("version", status.version.clone()),
        ("uptime", format!("{} s", status.uptime_seconds)),
        ("listen", status.listen.clone()),
        ("upstream", status.upstream.url.clone()),
        ("concurrency", concurrency(status)),
        ("ebpf", ebpf),
        ("at risk", list(signals.collect())),
        ("throttled", list(status.risk.throttled_classes.clone())),
        ("capabilities", list(status.capabilities.clone())),
        ("haproxy agent", cluster.agent.clone()),
        ("llm-d router", router),
    ];
    table(
        &[],
        rows.map(|(key, value)| vec![key.to_owned(), value]),
        19,
        usize::MAX,
    )
}

/// Each class's limits and what it holds now.
fn classes(status: &Status) -> Table {
    let header = [
        "class",
        "priority",
        "max_queue",
        "deadline_ms",
        "queued",
        "running",
        "wait_ms",
    ];
    let rows = status.classes.iter().map(|class| {
        let deadline = class
            .deadline_ms
            .map_or_else(|| "-".to_owned(), |d| d.to_string());
        vec![
            class.name.clone(),
            class.priority.to_string(),
            class.max_queue.to_string(),
            deadline,
            class.queued.to_string(),
            class.running.to_string(),
            class.predicted_wait_ms.to_string(),
        ]
    });
    table(&header, rows, CLASS_WIDTH, 1)
}

/// Each class's work over the last hour.
fn last_hour(status: &Status) -> Table {
    let header = [
        "last hour",
        "valid jobs",
        "invalid jobs",
        "prompt tokens",
        "generated tokens",
    ];
    let rows = status.last_hour.iter().map(|(class, hour)| {
        vec![
            class.clone(),
            hour.valid_jobs.to_string(),
            hour.invalid_jobs.to_string(),
            hour.prompt_tokens.to_string(),
            hour.generated_tokens.to_string(),
        ]
    });
    table(&header, rows, CLASS_WIDTH, 1)
}

/// Each preemptible class's setting, and how its last preempted request was to go on.
fn preemption(status: &Status) -> Table {
    let rows = status.preemption.iter().map(|(class, preempt)| {
        let setting = serde_json::to_string(&preempt.preemptible).unwrap_or_default();
        let resume = match preempt.resume {
            Some(kind) => serde_json::to_string(&kind).unwrap_or_default(),
            None => "(no request yet)".to_owned(),
        };
        vec![class.clone(), setting, resume.trim_matches('"').to_owned()]
    });
    let mut table = table(&["preemptible", "setting", "goes on"], rows, CLASS_WIDTH, 1);
    // The setting right-aligned, what follows it read from its left, a space further on.
    if let Some(column) = table.column_mut(2) {
        column.set_cell_alignment(CellAlignment::Left);
        column.set_padding((1, 1));
    }
    table
}

/// Per class, what sent its requests there, and how many.
fn classified(status: &Status) -> Table {
    let rows = status.classified.iter().map(|(class, by)| {
        let by: Vec<String> = by.iter().map(|(by, n)| format!("{by}: {n}")).collect();
        vec![class.clone(), by.join(", ")]
    });
    table(&["class", "sent by"], rows, CLASS_WIDTH, usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status() -> Status {
        let class = |name: &str, priority: i32, deadline: Option<u64>| {
            serde_json::json!({
                "name": name, "priority": priority, "max_queue": 64, "deadline_ms": deadline,
                "queued": 3, "running": 1, "held": false, "retired": false,
                "predicted_wait_ms": 1250,
            })
        };
        serde_json::from_value(serde_json::json!({
            "version": "0.1.0",
            "uptime_seconds": 42,
            "config": null,
            "listen": "127.0.0.1:8080",
            "upstream": { "url": "http://127.0.0.1:8081", "api": "openai", "max_concurrency": 2 },
            "ebpf": {
                "attached": false, "unavailable_reason": "no CAP_BPF",
                "events_total": 0, "ring_drops_total": 0,
            },
            "classes": [class("interactive", 10, Some(2000)), class("a-long-batch-class", 0, None)],
            "classified": { "interactive": { "default": 5, "header": 2 } },
            "preemption": { "a-long-batch-class": { "preemptible": "exact-only", "resume": "exact" } },
            "last_hour": {
                "interactive": {
                    "valid_jobs": 7, "invalid_jobs": 1, "prompt_tokens": 700,
                    "generated_tokens": 12345,
                },
            },
            "risk": { "signals": ["wait"], "throttled_classes": [] },
            "watch": {},
            "cluster": { "agent": "up 50%", "waiting": 3, "running": 1, "usage": 0.5 },
        }))
        .expect("a status document")
    }

    #[test]
    fn the_status_reads_as_aligned_tables() {
        let text = render(&status());
        let want = "\
version            0.1.0
uptime             42 s
listen             127.0.0.1:8080
upstream           http://127.0.0.1:8081
concurrency        2
ebpf               off: no CAP_BPF
at risk            wait
throttled          none
capabilities       none
haproxy agent      up 50%
llm-d router       waiting 3, running 1, kv usage 0.50

class              priority max_queue deadline_ms queued running wait_ms
interactive              10        64        2000      3       1    1250
a-long-batch-class        0        64           -      3       1    1250

last hour      valid jobs invalid jobs prompt tokens generated tokens
interactive             7            1           700            12345

preemptible             setting  goes on
a-long-batch-class \"exact-only\"  exact

class          sent by
interactive    default: 5, header: 2
";
        assert_eq!(text, want, "\n{text}");
    }
}
