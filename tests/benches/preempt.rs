//! `cargo xtask bench preempt`: SmolLM2 on llama-server with one slot; interactive chats alone,
//! then while a batch flood runs, through guard without and with batch preemption, side by
//! side in one run. Interactive TTFT p50/p95, batch valid jobs per hour, tokens regenerated:
//! the gain and its cost.

use std::time::{Duration, Instant};

use guard_tests::{
    metric,
    servers::{GuardProcess, LlamaServer},
    workload::{self, Shape, percentile},
};

const CLASSES: &str = "[class.interactive]\npriority = 0\nmax_queue = 8\ndeadline_ms = 10000\n\
                       [class.batch]\npriority = 10\nmax_queue = 1000\n";

fn main() {
    let runtime = guard_tests::bench_runtime();
    runtime.block_on(bench());
}

async fn bench() {
    let shape = Shape::default();
    let llama = LlamaServer::start(1).await;
    let idle = workload::run(llama.addr, shape, false).await;
    println!(
        "interactive TTFT, {} chats; batch: {} clients of {} tokens back to back",
        shape.chats, shape.batch_clients, shape.batch_tokens
    );
    println!(
        "{:<34} {:>8} {:>8} {:>13} {:>11} {:>12}",
        "", "p50 ms", "p95 ms", "valid jobs/h", "preempted", "regenerated"
    );
    row("idle, no flood", &idle, None, None);
    for (name, preemptible) in [
        ("flood through guard", false),
        ("flood, guard with preemption", true),
    ] {
        let config = match preemptible {
            true => CLASSES.replace(
                "max_queue = 1000\n",
                "max_queue = 1000\npreemptible = true\n",
            ),
            false => CLASSES.to_owned(),
        };
        let guard = GuardProcess::start(llama.addr, "openai", &config);
        let started = Instant::now();
        let outcome = workload::run(guard.listen, shape, true).await;
        let took = started.elapsed();
        workload::wait_until_idle(llama.addr).await;
        let text = guard.metrics_text().await;
        let m = |series: &str| metric(&text, series).unwrap_or(0.0);
        let valid = m("guard_jobs_total{class=\"batch\",result=\"valid\"}");
        let counts = (
            m("guard_preempted_total{class=\"batch\"}"),
            m("guard_preempt_regenerated_tokens_total{class=\"batch\"}"),
        );
        row(
            name,
            &outcome,
            Some(valid / took.as_secs_f64() * 3600.0),
            Some(counts),
        );
        // GUARD_BENCH_VERBOSE=1 (with GUARD_LOG=guard=debug): each chat's TTFT and what guard
        // logged of dispatch and preemption.
        if std::env::var_os("GUARD_BENCH_VERBOSE").is_some() {
            eprintln!("{name}: {:?}", outcome.ttft);
            let said = guard.log_lines();
            let said = said
                .iter()
                .filter(|l| l.contains("preempted") || l.contains("dispatched"));
            for line in said {
                eprintln!("  {line}");
            }
        }
    }
}

fn row(
    name: &str,
    outcome: &workload::Outcome,
    jobs_per_hour: Option<f64>,
    preempt: Option<(f64, f64)>,
) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let jobs = jobs_per_hour.map_or("-".to_owned(), |j| format!("{j:.0}"));
    let (preempted, regenerated) = preempt.map_or(("-".to_owned(), "-".to_owned()), |(p, r)| {
        (format!("{p:.0}"), format!("{r:.0}"))
    });
    println!(
        "{name:<34} {:>8.0} {:>8.0} {jobs:>13} {preempted:>11} {regenerated:>12}",
        ms(percentile(&outcome.ttft, 0.5)),
        ms(percentile(&outcome.ttft, 0.95)),
    );
}
