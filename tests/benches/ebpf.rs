//! `cargo xtask bench ebpf`: how fast a client's close reaches guard through the kernel.
//!
//! Prints, from one run: delivery latency from the client's close() returning to the event in
//! user space (and from the kernel's own timestamp), p50 and p99; sustained events per second;
//! and CPU per event, as the CPU of the same connection loop with the program attached minus
//! without it.

use std::{
    net::{SocketAddr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use guard::reap::{EbpfTracker, event::monotonic_now};
use guard_tests::require_root;

const LATENCY_SAMPLES: usize = 2_000;
const RATE_SECONDS: f64 = 3.0;

fn main() {
    require_root();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        latency().await;
        rate_and_cpu().await;
    });
}

async fn latency() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let server = listener.local_addr().expect("addr");
    let (_tracker, mut events) = EbpfTracker::attach(&[server.port()]).expect("attach");
    let mut from_close = Vec::with_capacity(LATENCY_SAMPLES);
    let mut from_kernel = Vec::with_capacity(LATENCY_SAMPLES);
    for _ in 0..LATENCY_SAMPLES {
        let client = TcpStream::connect(server).expect("connect");
        let (accepted, _) = listener.accept().expect("accept");
        let client_addr = client.local_addr().expect("addr");
        drop(client);
        let closed = monotonic_now();
        loop {
            let event = events.recv().await.expect("event stream open");
            if event.is_client_gone(&[server.port()]) && event.remote == client_addr {
                let now = monotonic_now();
                from_close.push(now.saturating_sub(closed));
                from_kernel.push(now.saturating_sub(event.at));
                break;
            }
        }
        drop(accepted);
    }
    println!("eBPF close-event delivery, {LATENCY_SAMPLES} connections on loopback:");
    print_percentiles("  close() returned -> event in user space", &mut from_close);
    print_percentiles(
        "  kernel state change -> event in user space",
        &mut from_kernel,
    );
}

async fn rate_and_cpu() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let server = listener.local_addr().expect("addr");

    let (without_cpu, without_connections) = churn(&listener, server);
    let (tracker, mut events) = EbpfTracker::attach(&[server.port()]).expect("attach");
    let counter = tokio::spawn(async move {
        let mut received = 0u64;
        while events.recv().await.is_some() {
            received += 1;
        }
        received
    });
    let started = Instant::now();
    let churn_task = tokio::task::spawn_blocking(move || {
        let result = churn(&listener, server);
        (result, listener)
    });
    let ((with_cpu, with_connections), _listener) = churn_task.await.expect("churn");
    let elapsed = started.elapsed();
    let sent = tracker.events_sent();
    let drops = tracker.ring_drops();
    drop(tracker);
    let received = counter.await.expect("counter");

    let per_conn_without = without_cpu.as_secs_f64() / without_connections as f64;
    let per_conn_with = with_cpu.as_secs_f64() / with_connections as f64;
    let events_per_conn = sent as f64 / with_connections as f64;
    let cpu_per_event = (per_conn_with - per_conn_without).max(0.0) / events_per_conn;
    println!("Sustained, one thread opening and closing connections for {RATE_SECONDS} s:");
    println!(
        "  events: {sent} sent by the kernel, {received} received, {drops} dropped; {:.0} events/s ({events_per_conn:.1} per connection)",
        received as f64 / elapsed.as_secs_f64()
    );
    println!(
        "  connections/s: {:.0} without eBPF, {:.0} with (ratio {:.2})",
        without_connections as f64 / RATE_SECONDS,
        with_connections as f64 / RATE_SECONDS,
        with_connections as f64 / without_connections as f64
    );
    println!(
        "  process CPU per connection: {:.2} us without, {:.2} us with (ratio {:.2}); CPU per event: {:.3} us",
        per_conn_without * 1e6,
        per_conn_with * 1e6,
        per_conn_with / per_conn_without,
        cpu_per_event * 1e6
    );
}

/// Opens and closes connections for RATE_SECONDS; returns the process CPU used and the count.
fn churn(listener: &TcpListener, server: SocketAddr) -> (Duration, usize) {
    let cpu_before = process_cpu();
    let started = Instant::now();
    let mut connections = 0;
    while started.elapsed().as_secs_f64() < RATE_SECONDS {
        let client = TcpStream::connect(server).expect("connect");
        let (accepted, _) = listener.accept().expect("accept");
        drop(client);
        drop(accepted);
        connections += 1;
    }
    (process_cpu().saturating_sub(cpu_before), connections)
}

/// User plus system CPU time of this process (the eBPF program runs in its context).
fn process_cpu() -> Duration {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .expect("getrusage");
    let micros = |tv: nix::sys::time::TimeVal| {
        Duration::from_secs(tv.tv_sec() as u64) + Duration::from_micros(tv.tv_usec() as u64)
    };
    micros(usage.user_time()) + micros(usage.system_time())
}

fn print_percentiles(label: &str, samples: &mut [Duration]) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "{label}: p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        at(0.50).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
        at(1.0).as_secs_f64() * 1e6
    );
}
