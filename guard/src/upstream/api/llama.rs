//! llama-server's own endpoints: `/props`, `/slots`, the timings on a stream's last event, and its
//! Prometheus `/metrics` (read with a Prometheus text parser).

use serde::Deserialize;

/// `GET /props`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Props {
    pub build_info: Option<String>,
    pub model_path: Option<String>,
    /// Its slots (`--parallel`).
    pub total_slots: Option<usize>,
    /// Asleep after `--sleep-idle-seconds` without work: its model unloaded.
    pub is_sleeping: bool,
}

/// One entry of `GET /slots`: a slot is one request the server works on at a time.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(default)]
pub struct Slot {
    pub id: u32,
    pub n_ctx: u64,
    pub is_processing: bool,
}

/// The timings llama-server adds to an answer's last event.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Timings {
    pub predicted_n: Option<u64>,
}

/// What guard reads of `/metrics`: requests being processed and waiting in its own queue.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Load {
    pub processing: f64,
    pub deferred: f64,
    /// Its KV cache's usage, 0..1, where it reports it.
    pub kv_usage: Option<f64>,
    /// Tokens it has generated since it started, counted as each task ends.
    pub predicted_total: Option<f64>,
}

impl Load {
    /// From the Prometheus text of `/metrics`; absent samples read as 0.
    pub fn parse(text: &str) -> Option<Self> {
        let (_, families) = nom_openmetrics::parser::prometheus(text).ok()?;
        let find = |name: &str| {
            families
                .iter()
                .flat_map(|family| family.samples.iter())
                .find(|sample| sample.name() == name)
                .map(|sample| sample.number())
        };
        Some(Self {
            processing: find("llamacpp:requests_processing").unwrap_or(0.0),
            deferred: find("llamacpp:requests_deferred").unwrap_or(0.0),
            kv_usage: find("llamacpp:kv_cache_usage_ratio"),
            predicted_total: find("llamacpp:tokens_predicted_total"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_as_llama_server_lists_them() {
        let slots: Vec<Slot> = crate::upstream::api::parse(
            br#"[{"id":0,"n_ctx":2048,"speculative":false,"is_processing":true},{"id":1,"n_ctx":2048}]"#,
        )
        .expect("slots");
        assert_eq!(slots.len(), 2);
        assert!(slots[0].is_processing && !slots[1].is_processing);
        assert_eq!(slots[1].n_ctx, 2048);
    }

    #[test]
    fn busy_and_deferred_from_metrics() {
        let text = "# HELP llamacpp:requests_processing Number of requests processing.\n\
                    # TYPE llamacpp:requests_processing gauge\n\
                    llamacpp:requests_processing 1\n\
                    # TYPE llamacpp:requests_deferred gauge\n\
                    llamacpp:requests_deferred 3\n";
        assert_eq!(
            Load::parse(text),
            Some(Load {
                processing: 1.0,
                deferred: 3.0,
                kv_usage: None,
                predicted_total: None,
            })
        );
        let with_kv = format!(
            "{text}# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.25\n"
        );
        assert_eq!(Load::parse(&with_kv).and_then(|l| l.kv_usage), Some(0.25));
    }
}
