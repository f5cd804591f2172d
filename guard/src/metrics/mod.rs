//! guard's Prometheus metrics (docs/design.md §7) and the listener that serves them.

pub mod family;
pub mod labels;
mod server;

use prometheus::{
    CounterVec, Encoder as _, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Registry, TextEncoder,
};

pub use family::Family;
use labels::*;

/// Integer counters, told apart by the label set `L`.
pub type Counters<L> = Family<L, IntCounterVec>;
/// Counters of a measured quantity (joules).
pub type FloatCounters<L> = Family<L, CounterVec>;
/// Integer gauges.
pub type IntGauges<L> = Family<L, IntGaugeVec>;
/// Gauges of a measured value.
pub type Gauges<L> = Family<L, GaugeVec>;
/// Histograms.
pub type Histograms<L> = Family<L, HistogramVec>;

pub use server::{Extra, Limits, StatusFn, serve};

/// Buckets for waits and latencies, from 1 ms to 5 minutes.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

/// Buckets for the signed error of a predicted start (actual minus predicted), ±5 minutes.
const PREDICTION_ERROR_BUCKETS: &[f64] = &[
    -300.0, -60.0, -10.0, -5.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0.0, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 60.0, 300.0,
];

/// Buckets for decode rates, tokens per second.
const TOKEN_RATE_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0,
];

/// Buckets for reap latency, from 10 µs to 5 s.
const REAP_BUCKETS: &[f64] = &[
    0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0,
];

/// Every metric guard exports. Cheap to clone: each field is a handle.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    pub requests_total: Counters<ByClassOutcome>,
    pub rejected_total: Counters<ByClassReason>,
    pub reaped_total: Counters<ByClassStage>,
    pub queue_depth: IntGauges<ByClass>,
    pub inflight: IntGauges<ByClass>,
    pub queue_wait_seconds: Histograms<ByClass>,
    pub ttft_seconds: Histograms<ByClass>,
    pub request_duration_seconds: Histograms<ByClass>,
    pub start_prediction_error_seconds: Histograms<ByClass>,
    pub reap_latency_seconds: Histogram,
    pub timed_out_total: Counters<ByClassWhich>,
    pub failed_total: Counters<ByClassKind>,
    pub ebpf_attached: IntGauge,
    /// What the balancers are told (docs/design.md §11), as one series each.
    pub cluster_waiting: IntGauge,
    pub cluster_running: IntGauge,
    pub cluster_usage: prometheus::Gauge,
    pub ebpf_events_total: IntCounter,
    pub ebpf_ring_drops_total: IntCounter,
    pub passthrough_requests_total: Counters<ByCode>,
    pub config_reloads_total: Counters<ByResult>,
    pub admitted_total: Counters<ByClass>,
    pub rejected_after_queueing_total: Counters<ByClassReason>,
    pub invalid_requests_total: Counters<ByReason>,
    pub model_cold_loads_total: Counters<ByModel>,
    pub model_last_load_seconds: Gauges<ByModel>,
    pub class_deadline_seconds: Gauges<ByClass>,
    pub remote_refused_total: Counters<ByClassModel>,
    pub class_throttled: IntGauges<ByClass>,
    pub preempted_total: Counters<ByClass>,
    pub tokens_total: Counters<ByClassKind>,
    pub jobs_total: Counters<ByClassResult>,
    pub generation_tokens_per_second: Histograms<ByClass>,
    pub preempt_regenerated_tokens_total: Counters<ByClass>,
    pub preempt_pause_seconds: Histograms<ByClass>,
    pub preempt_resumes_total: Counters<ByClassKind>,
    pub preempt_reread_tokens_total: Counters<ByClass>,
    pub preempt_pad_tokens_total: Counters<ByClass>,
    pub prompt_tokens_total: Counters<ByClassSource>,
    pub throttle_changes_total: Counters<ByClassChange>,
    pub at_risk: IntGauges<ByReason>,
    pub body_bytes_in_flight: IntGauge,
    pub connections: IntGauge,
    pub connections_parked: IntGauge,
    pub connections_refused_total: Counters<ByListener>,
    pub access_log_dropped_total: IntCounter,
    /// Written only where the box measures energy (`watch::energy`): elsewhere it has no series.
    pub energy_joules_total: FloatCounters<ByClass>,
}

impl Metrics {
    // xtask: table
    pub fn new() -> Self {
        let registry = Registry::new();
        let metrics = Self {
            requests_total: Family::counter(
                "guard_requests_total",
                "Requests to queued endpoints by class and final outcome (completed, rejected, reaped, failed, timed_out).",
            ),
            rejected_total: Family::counter(
                "guard_rejected_total",
                "Requests answered 503 by class and reason (queue_full, deadline_predicted, deadline_expired, shutting_down).",
            ),
            reaped_total: Family::counter(
                "guard_reaped_total",
                "Requests whose client left, by class and stage (queued, running).",
            ),
            queue_depth: Family::int_gauge(
                "guard_queue_depth",
                "Requests waiting, by class.",
            ),
            inflight: Family::int_gauge(
                "guard_inflight",
                "Requests running at the upstream, by class.",
            ),
            queue_wait_seconds: Family::histogram(
                "guard_queue_wait_seconds",
                "Time from arrival to dispatch (or to leaving the queue).",
                LATENCY_BUCKETS,
            ),
            ttft_seconds: Family::histogram(
                "guard_ttft_seconds",
                "Time from arrival to the first response byte sent to the client.",
                LATENCY_BUCKETS,
            ),
            request_duration_seconds: Family::histogram(
                "guard_request_duration_seconds",
                "Time from arrival to the last response byte.",
                LATENCY_BUCKETS,
            ),
            start_prediction_error_seconds: Family::histogram(
                "guard_start_prediction_error_seconds",
                "Actual minus predicted start (arrival to dispatch) of admitted requests: positive started later than predicted.",
                PREDICTION_ERROR_BUCKETS,
            ),
            timed_out_total: Family::counter(
                "guard_timed_out_total",
                "Accepted requests ended by a timeout, by class and which (upstream_idle, client_stall, max_duration).",
            ),
            failed_total: Family::counter(
                "guard_failed_total",
                "Accepted requests that failed, by class and kind (upstream_unreachable, upstream_timeout, upstream_error, upstream_reset).",
            ),
            reap_latency_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "guard_reap_latency_seconds",
                    "Time from the kernel's close event to the request dropped or aborted.",
                )
                .buckets(REAP_BUCKETS.to_vec()),
            )
            .expect("valid histogram"),
            ebpf_attached: IntGauge::new(
                "guard_ebpf_attached",
                "1 while guard's eBPF program is attached to sock/inet_sock_set_state.",
            )
            .expect("valid gauge"),
            cluster_waiting: IntGauge::new(
                "guard_cluster_waiting_requests",
                "Requests waiting on this box: in guard's class queues and the server's own queue (the llm-d router's queued requests).",
            )
            .expect("valid gauge"),
            cluster_running: IntGauge::new(
                "guard_cluster_running_requests",
                "Requests running at the server (the llm-d router's running requests).",
            )
            .expect("valid gauge"),
            cluster_usage: prometheus::Gauge::new(
                "guard_cluster_usage_ratio",
                "The server's KV-cache usage (0..1) where it reports it, else guard's saturation (the llm-d router's KV usage).",
            )
            .expect("valid gauge"),
            ebpf_events_total: IntCounter::new(
                "guard_ebpf_events_total",
                "Socket state changes the eBPF program sent to user space.",
            )
            .expect("valid counter"),
            ebpf_ring_drops_total: IntCounter::new(
                "guard_ebpf_ring_drops_total",
                "Socket state changes lost because the eBPF ring buffer was full.",
            )
            .expect("valid counter"),
            passthrough_requests_total: Family::counter(
                "guard_passthrough_requests_total",
                "Requests to endpoints guard does not queue, passed straight through, by status code.",
            ),
            config_reloads_total: Family::counter(
                "guard_config_reloads_total",
                "SIGHUP reloads by result (applied, refused).",
            ),
            admitted_total: Family::counter(
                "guard_admitted_total",
                "Requests that entered a class queue (accepted).",
            ),
            rejected_after_queueing_total: Family::counter(
                "guard_rejected_after_queueing_total",
                "Accepted requests later answered 503 from the queue (deadline_expired, shutting_down).",
            ),
            invalid_requests_total: Family::counter(
                "guard_invalid_requests_total",
                "Requests refused before queueing and never forwarded: bad_path, framing, method, body_too_large, unknown_class, body_read, body_read_timeout; malformed_head and head_too_large, which hyper answers itself.",
            ),
            model_cold_loads_total: Family::counter(
                "guard_model_cold_loads_total",
                "Responses whose model had to be loaded first (Ollama load_duration above watch.cold_load_ms).",
            ),
            model_last_load_seconds: Family::gauge(
                "guard_model_last_load_seconds",
                "The last load_duration Ollama reported for a model.",
            ),
            class_deadline_seconds: Family::gauge(
                "guard_class_deadline_seconds",
                "A class's configured time-to-first-token deadline.",
            ),
            remote_refused_total: Family::counter(
                "guard_remote_refused_total",
                "Requests refused (403) because their model is served from elsewhere and their class may not ask for that (allow_remote_models).",
            ),
            tokens_total: Family::counter(
                "guard_tokens_total",
                "Tokens by the upstream's own count: prompt (evaluated) and generated.",
            ),
            jobs_total: Family::counter(
                "guard_jobs_total",
                "Dispatched requests: valid when completed with the server's own end marker, else invalid (cut, failed, timed out, an error status).",
            ),
            generation_tokens_per_second: Family::histogram(
                "guard_generation_tokens_per_second",
                "Steady decode rate of an answer (first token excluded), as the server measured it or guard saw it.",
                TOKEN_RATE_BUCKETS,
            ),
            preempted_total: Family::counter(
                "guard_preempted_total",
                "Running requests stopped for a more urgent class (each goes on later).",
            ),
            preempt_regenerated_tokens_total: Family::counter(
                "guard_preempt_regenerated_tokens_total",
                "Tokens generated and thrown away by preemption (a request restarted from scratch).",
            ),
            preempt_pause_seconds: Family::histogram(
                "guard_preempt_pause_seconds",
                "How long a preempted request waited before it went on.",
                LATENCY_BUCKETS,
            ),
            preempt_resumes_total: Family::counter(
                "guard_preempt_resumes_total",
                "Preempted requests that went on, by how: exact (from the token ids it stopped at), text (the partial answer sent again as text) or restart (from scratch).",
            ),
            preempt_reread_tokens_total: Family::counter(
                "guard_preempt_reread_tokens_total",
                "Prompt tokens the server read again (not from its cache) to go on after a preemption.",
            ),
            preempt_pad_tokens_total: Family::counter(
                "guard_preempt_pad_tokens_total",
                "Tokens guard had llama-server read after a short preempted job's state, so that the urgent request could not take that state from its prompt cache.",
            ),
            prompt_tokens_total: Family::counter(
                "guard_prompt_tokens_total",
                "Prompt tokens by what the server did with them: computed (read anew) or cached (reused from its prompt cache), as the server itself counted them.",
            ),
            throttle_changes_total: Family::counter(
                "guard_throttle_changes_total",
                "Holds and releases of a class's cgroup, by reason (at_risk, risk_clear, max_throttle, shutdown).",
            ),
            class_throttled: Family::int_gauge(
                "guard_class_throttled",
                "1 while guard holds this class's cgroup back (frozen or CPU-limited).",
            ),
            at_risk: Family::int_gauge(
                "guard_at_risk",
                "1 while this signal says protected deadlines are at risk (wait, ttft, swap, memory_pressure, gpu_memory).",
            ),
            body_bytes_in_flight: IntGauge::new(
                "guard_body_bytes_in_flight",
                "Bytes of request bodies guard holds (being read or waiting), against server.max_body_bytes_in_flight.",
            )
            .expect("valid gauge"),
            connections: IntGauge::new(
                "guard_connections",
                "Client connections open on the proxy listener.",
            )
            .expect("valid gauge"),
            connections_parked: IntGauge::new(
                "guard_connections_parked",
                "Of the client connections, those idle between requests and parked outside hyper (holding only their socket).",
            )
            .expect("valid gauge"),
            connections_refused_total: Family::counter(
                "guard_connections_refused_total",
                "Connections closed at once because their listener was full (proxy: server.max_connections, metrics: metrics.max_connections, agent: 64).",
            ),
            access_log_dropped_total: IntCounter::new(
                "guard_access_log_dropped_total",
                "Access log lines that found their buffer full or could not be written (a slow or full disk); the requests were served.",
            )
            .expect("valid counter"),
            energy_joules_total: Family::float_counter(
                "guard_energy_joules_total",
                "Energy the box measured (NVML total energy, else RAPL package energy) shared among the requests holding upstream slots, each tick's by the slots held; energy while no slot is held is nobody's. Absent where neither counter exists.",
            ),
            registry,
        };
        metrics.register_all();
        metrics
    }

    fn register_all(&self) {
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            self.requests_total.collector(),
            self.rejected_total.collector(),
            self.reaped_total.collector(),
            self.queue_depth.collector(),
            self.inflight.collector(),
            self.queue_wait_seconds.collector(),
            self.ttft_seconds.collector(),
            self.request_duration_seconds.collector(),
            self.start_prediction_error_seconds.collector(),
            Box::new(self.reap_latency_seconds.clone()),
            self.timed_out_total.collector(),
            self.failed_total.collector(),
            Box::new(self.ebpf_attached.clone()),
            Box::new(self.cluster_waiting.clone()),
            Box::new(self.cluster_running.clone()),
            Box::new(self.cluster_usage.clone()),
            Box::new(self.ebpf_events_total.clone()),
            Box::new(self.ebpf_ring_drops_total.clone()),
            self.passthrough_requests_total.collector(),
            self.config_reloads_total.collector(),
            self.admitted_total.collector(),
            self.rejected_after_queueing_total.collector(),
            self.invalid_requests_total.collector(),
            self.model_cold_loads_total.collector(),
            self.model_last_load_seconds.collector(),
            self.class_deadline_seconds.collector(),
            self.remote_refused_total.collector(),
            self.class_throttled.collector(),
            self.preempted_total.collector(),
            self.tokens_total.collector(),
            self.jobs_total.collector(),
            self.generation_tokens_per_second.collector(),
            self.preempt_regenerated_tokens_total.collector(),
            self.preempt_pause_seconds.collector(),
            self.preempt_resumes_total.collector(),
            self.preempt_reread_tokens_total.collector(),
            self.preempt_pad_tokens_total.collector(),
            self.prompt_tokens_total.collector(),
            self.throttle_changes_total.collector(),
            self.at_risk.collector(),
            Box::new(self.body_bytes_in_flight.clone()),
            Box::new(self.connections.clone()),
            Box::new(self.connections_parked.clone()),
            self.connections_refused_total.collector(),
            Box::new(self.access_log_dropped_total.clone()),
            self.energy_joules_total.collector(),
        ];
        for collector in collectors {
            self.registry
                .register(collector)
                .expect("metric names are unique");
        }
    }

    /// Registers a collector of another module (watchers add theirs).
    pub fn register(&self, collector: Box<dyn prometheus::core::Collector>) {
        if let Err(err) = self.registry.register(collector) {
            tracing::error!(%err, "metric registration failed");
        }
    }

    /// A class's configured deadline, or none.
    pub fn set_deadline(&self, class: &str, deadline: Option<std::time::Duration>) {
        match deadline {
            Some(deadline) => self
                .class_deadline_seconds
                .of(&Class { class })
                .set(deadline.as_secs_f64()),
            None => self.class_deadline_seconds.remove(&Class { class }),
        }
    }

    /// A class's waiting and running requests.
    pub fn publish_class(&self, class: &str, queued: usize, running: usize) {
        self.queue_depth.of(&Class { class }).set(queued as i64);
        self.inflight.of(&Class { class }).set(running as i64);
    }

    /// A request's share of the measured energy, to its class. A share that is not a
    /// positive number adds nothing (a counter only grows).
    pub fn add_energy(&self, class: &str, joules: f64) {
        if joules.is_finite() && joules > 0.0 {
            self.energy_joules_total.of(&Class { class }).inc_by(joules);
        }
    }

    /// Brings a counter that mirrors a monotonic source (a kernel counter) up to `value`.
    pub fn mirror(counter: &IntCounter, value: u64) {
        let current = counter.get();
        if value > current {
            counter.inc_by(value - current);
        }
    }

    /// The Prometheus text exposition of everything registered.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        if let Err(err) = TextEncoder::new().encode(&self.registry.gather(), &mut buffer) {
            tracing::error!(%err, "encoding metrics failed");
        }
        String::from_utf8(buffer).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn energy_is_absent_until_written_and_counts_joules() {
        let metrics = Metrics::new();
        assert!(!metrics.render().contains("guard_energy_joules_total"));
        metrics.add_energy("batch", 1.25);
        metrics.add_energy("batch", 0.5);
        for nothing in [0.0, -2.0, f64::NAN, f64::INFINITY] {
            metrics.add_energy("batch", nothing);
        }
        let text = metrics.render();
        assert!(
            text.contains("guard_energy_joules_total{class=\"batch\"} 1.75"),
            "{text}"
        );
        assert!(text.contains("# TYPE guard_energy_joules_total counter"));
    }
}
