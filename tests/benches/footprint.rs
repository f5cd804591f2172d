//! `cargo xtask bench footprint`: guard's own cost. RSS idle and under load, CPU per 1,000
//! requests, and the watchers' CPU at a 1 s interval (targets: RSS at most 30 MiB idle;
//! watchers at most 0.5 % of one core).

use std::time::Duration;

use guard_tests::{
    body::{With as _, ollama_chat},
    http::post,
    process_cpu_seconds, rss_bytes,
    servers::{GuardProcess, OllamaEmulator},
};

const REQUESTS: usize = 1_000;
const CLIENTS: usize = 8;
const IDLE_SECONDS: u64 = 20;

/// (RSS bytes, CPU seconds) of a process.
fn usage(pid: u32) -> (u64, f64) {
    (rss_bytes(pid), process_cpu_seconds(pid))
}

fn main() {
    let runtime = guard_tests::bench_runtime();
    runtime.block_on(async {
        let ollama = OllamaEmulator::start(&["--tokens", "3", "--token-delay-ms", "1", "--load-ms", "0"]);
        let guard = GuardProcess::start(
            ollama.addr,
            "ollama",
            "[watch]\ninterval_ms = 1000\n[class.interactive]\nmax_queue = 1000\n[class.batch]\npriority = 10\nmax_queue = 1000\n",
        );
        let pid = guard.pid();
        // Let start-up settle (eBPF load, the first watcher rounds) before measuring idle.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let (idle_rss, cpu_before) = usage(pid);
        tokio::time::sleep(Duration::from_secs(IDLE_SECONDS)).await;
        let (_, cpu_after) = usage(pid);
        let idle_share = (cpu_after - cpu_before) / IDLE_SECONDS as f64;

        let chat = ollama_chat("hi").with("stream", false);
        let (_, load_before) = usage(pid);
        let mut peak_rss = 0;
        let per_client = REQUESTS / CLIENTS;
        let mut clients = Vec::new();
        for _ in 0..CLIENTS {
            let (addr, chat) = (guard.listen, chat.clone());
            clients.push(tokio::spawn(async move {
                for _ in 0..per_client {
                    assert_eq!(post(addr, "/api/chat", &[], &chat).await.status, 200);
                }
            }));
        }
        for client in clients {
            client.await.expect("client");
            peak_rss = peak_rss.max(usage(pid).0);
        }
        let (loaded_rss, load_after) = usage(pid);
        peak_rss = peak_rss.max(loaded_rss);
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!("guard footprint (release build, eBPF attached, watchers every 1 s, in front of the Ollama emulator):");
        println!("  RSS idle {:.1} MiB (target <= 30 MiB); under load (8 clients) peak {:.1} MiB", mib(idle_rss), mib(peak_rss));
        println!(
            "  idle CPU (the watchers at a 1 s interval) {:.3} % of one core over {IDLE_SECONDS} s (target <= 0.5 %)",
            idle_share * 100.0
        );
        println!(
            "  CPU per 1,000 proxied requests (streamed-off chats through the queue): {:.3} s",
            (load_after - load_before) * 1000.0 / REQUESTS as f64
        );
    });
}
