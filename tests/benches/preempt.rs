//! `cargo xtask bench preempt`: SmolLM2 on llama-server with one slot; fifty interactive chats
//! alone, then while a batch flood runs (bounded extractions and stories with no token limit),
//! through guard without and with batch preemption, side by side in one run. Chat TTFT p50/p99,
//! batch tokens a second against the batch alone, preemptions, exact resumes and the prompt
//! tokens each read again: the gain and its cost.

use std::time::Duration;

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
    let shape = Shape {
        unbounded: true,
        chats: 50,
        chat_every: Duration::from_millis(600),
        ..Shape::default()
    };
    let llama = LlamaServer::start(1).await;
    println!(
        "{} chats of {} tokens, one every {} ms; batch: {} clients back to back, half {}-token \
         extractions, half stories with no token limit",
        shape.chats,
        shape.chat_tokens,
        shape.chat_every.as_millis(),
        shape.batch_clients,
        shape.batch_tokens
    );
    println!(
        "{:<34} {:>8} {:>8} {:>9} {:>9} {:>10} {:>7} {:>14}",
        "", "p50 ms", "p99 ms", "batch t/s", "of alone", "preempted", "exact", "reread/resume"
    );
    let idle = workload::run(llama.addr, llama.addr, shape, false).await;
    row("chats alone", &idle, None, None);
    let alone = {
        let guard = GuardProcess::start(llama.addr, "openai", &preemptible());
        let solo = Shape {
            chats: 0,
            chat_every: shape.chat_every * shape.chats as u32,
            ..shape
        };
        let outcome = workload::run(guard.listen, llama.addr, solo, true).await;
        workload::wait_until_idle(llama.addr).await;
        outcome.batch_tokens_per_second
    };
    println!(
        "{:<34} {:>8} {:>8} {:>9.0}",
        "batch alone, through guard", "-", "-", alone
    );
    for (name, config) in [
        ("flood, guard without preemption", CLASSES.to_owned()),
        ("flood, guard with preemption", preemptible()),
    ] {
        let guard = GuardProcess::start(llama.addr, "openai", &config);
        let outcome = workload::run(guard.listen, llama.addr, shape, true).await;
        workload::wait_until_idle(llama.addr).await;
        let text = guard.metrics_text().await;
        let m = |series: &str| metric(&text, series).unwrap_or(0.0);
        let preempted = m("guard_preempted_total{class=\"batch\"}");
        let counts = (
            preempted,
            m("guard_preempt_resumes_total{class=\"batch\",kind=\"exact\"}"),
            m("guard_preempt_reread_tokens_total{class=\"batch\"}") / preempted.max(1.0),
        );
        row(
            name,
            &outcome,
            Some(outcome.batch_tokens_per_second / alone),
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
    let worst = |o: &workload::Outcome| percentile(&o.ttft, 1.0);
    println!(
        "goals: the worst chat within 100 ms of the worst idle one ({:.0} ms idle); batch at \
         least 80 % of its rate alone; at most 16 prompt tokens read again a resume",
        worst(&idle).as_secs_f64() * 1e3
    );
}

fn preemptible() -> String {
    CLASSES.replace(
        "max_queue = 1000\n",
        "max_queue = 1000\npreemptible = true\n",
    )
}

fn row(
    name: &str,
    outcome: &workload::Outcome,
    of_alone: Option<f64>,
    preempt: Option<(f64, f64, f64)>,
) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let share = of_alone.map_or("-".to_owned(), |s| format!("{:.0} %", s * 100.0));
    let batch = match of_alone {
        Some(_) => format!("{:.0}", outcome.batch_tokens_per_second),
        None => "-".to_owned(),
    };
    let (preempted, exact, reread) = preempt.map_or(
        ("-".to_owned(), "-".to_owned(), "-".to_owned()),
        |(p, e, r)| (format!("{p:.0}"), format!("{e:.0}"), format!("{r:.1}")),
    );
    println!(
        "{name:<34} {:>8.0} {:>8.0} {batch:>9} {share:>9} {preempted:>10} {exact:>7} {reread:>14}",
        ms(percentile(&outcome.ttft, 0.5)),
        ms(percentile(&outcome.ttft, 0.99)),
    );
}
