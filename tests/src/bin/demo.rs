//! `cargo xtask demo`: SmolLM2 on llama-server with one slot, guard in front of it, and a
//! mixed workload (interactive chats while a batch flood runs) sent once straight to
//! llama-server and once through guard. Prints interactive TTFT side by side, then keeps guard
//! serving (with /metrics) until Ctrl-C.

use std::{net::SocketAddr, time::Duration};

use tokio::signal::unix::{SignalKind, signal};

use guard_tests::{
    servers::{GuardProcess, LlamaServer},
    workload::{self, Shape, percentile},
};

const CLASSES: &str = "[class.interactive]\npriority = 0\nmax_queue = 8\ndeadline_ms = 10000\n\
                       [class.batch]\npriority = 10\nmax_queue = 1000\n";

#[tokio::main]
async fn main() {
    // Installed before any server starts: Ctrl-C or SIGTERM at any point, the workload included,
    // drops the demo and with it llama-server and guard.
    let mut interrupt = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let mut terminate = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        () = demo() => {}
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
    eprintln!("demo: stopping guard and llama-server");
}

/// Runs the workload, prints the table, then serves until it is dropped.
async fn demo() {
    // Chats one a second, as a person's would come; batch work runs between them.
    let shape = Shape {
        chat_every: Duration::from_secs(1),
        ..Shape::default()
    };
    eprintln!("demo: starting llama-server (SmolLM2-135M, -np 1)");
    let llama = LlamaServer::start(1).await;
    eprintln!("demo: starting guard in front of it");
    let guard = GuardProcess::start(llama.addr, "openai", CLASSES);
    eprintln!(
        "demo: workload: {} interactive chats of {} tokens, one a second, while {} batch clients send {}-token \
         extractions back to back",
        shape.chats, shape.chat_tokens, shape.batch_clients, shape.batch_tokens
    );

    let idle = workload::run(llama.addr, llama.addr, shape, false).await;
    let direct = workload::run(llama.addr, llama.addr, shape, true).await;
    workload::wait_until_idle(llama.addr).await;
    let guarded = workload::run(guard.listen, llama.addr, shape, true).await;
    workload::wait_until_idle(llama.addr).await;
    // The same, with batch preemptible: interactive work stops a running batch job, which goes
    // on where it stopped afterwards.
    let preempting = GuardProcess::start(
        llama.addr,
        "openai",
        &CLASSES.replace(
            "max_queue = 1000\n",
            "max_queue = 1000\npreemptible = true\n",
        ),
    );
    let preempted = workload::run(preempting.listen, llama.addr, shape, true).await;
    workload::wait_until_idle(llama.addr).await;
    drop(preempting);

    let row = |name: &str, o: &workload::Outcome, flood: bool| {
        let batch = match flood {
            true => format!("{:.0}", o.batch_tokens_per_second),
            false => "-".to_owned(),
        };
        println!(
            "{name:<34} {:>9.0} {:>9.0} {:>9} {batch:>14}",
            ms(percentile(&o.ttft, 0.5)),
            ms(percentile(&o.ttft, 0.95)),
            o.chats_rejected,
        );
    };
    println!();
    println!("interactive time to first token       p50 ms    p95 ms  rejected  batch tokens/s");
    row("idle llama-server, no flood", &idle, false);
    row("batch flood, straight to llama", &direct, true);
    row("batch flood, through guard", &guarded, true);
    row("batch flood, guard with preemption", &preempted, true);
    println!();
    println!(
        "batch tokens/s: what the batch flood generated a second while the chats ran (llama-server's\n\
         own count less the chats'). guard holds the flood in its own queue and dispatches chats\n\
         first; llama-server alone serves requests in arrival order behind it. With batch\n\
         preemptible, a chat also stops the running batch job, which goes on afterwards from the\n\
         exact tokens where it stopped: the cost is in the last column."
    );
    print_where_guard_serves(&guard, llama.addr);
    std::future::pending::<()>().await;
}

fn print_where_guard_serves(guard: &GuardProcess, llama: SocketAddr) {
    println!();
    println!(
        "guard keeps serving: proxy http://{} -> llama-server http://{llama}",
        guard.listen
    );
    println!("  metrics  http://{}/metrics", guard.metrics);
    println!(
        "  status   http://{}/status   (or: target/release/guard status --url http://{})",
        guard.metrics, guard.metrics
    );
    println!(
        "  try      curl -s http://{}/v1/chat/completions -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'",
        guard.listen
    );
    println!("Ctrl-C stops guard and llama-server.");
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}
