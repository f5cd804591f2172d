//! The eBPF program on the real kernel: close and reset events with the right 4-tuple and
//! states for IPv4 and IPv6, nothing from unwatched ports, connect owners with pid, uid and
//! cgroup, no event lost among 10,000 connections, fields read where the loader says they are,
//! and a departed client reaped end to end. `cargo xtask kernels` runs this binary inside each
//! kernel of the matrix and reads the `burst:` line it prints.

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    process::{Command, Stdio},
};

use guard::reap::{ConnEvent, EbpfTracker, Layout, TcpState};
use guard_testkit::Upstream;
use guard_tests::{
    ChildGuard, TestCgroup, cgroup2_root, collect_until, collect_until_within,
    http::{Leave, leave},
    require_root,
    scripted::hang_then_leave,
    servers::GuardProcess,
};

fn listener(ip: &str) -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind(format!("{ip}:0")).expect("bind");
    let addr = listener.local_addr().expect("local addr");
    (listener, addr)
}

/// Connects to `server` and returns (client, accepted) ends.
fn connect(listener: &TcpListener, server: SocketAddr) -> (TcpStream, TcpStream) {
    let client = TcpStream::connect(server).expect("connect");
    let (accepted, _) = listener.accept().expect("accept");
    (client, accepted)
}

fn is_change(
    event: &ConnEvent,
    local: SocketAddr,
    remote: SocketAddr,
    old: TcpState,
    new: TcpState,
) -> bool {
    event.local == local && event.remote == remote && event.old == old && event.new == new
}

async fn close_is_reported(ip: &str, use_reset: bool) {
    require_root();
    let (listener, server) = listener(ip);
    let (tracker, mut events) = EbpfTracker::attach(&[server.port()]).expect("attach");
    let (client, accepted) = connect(&listener, server);
    let client_addr = client.local_addr().expect("client addr");
    let expected_server_side = if use_reset {
        TcpState::Close
    } else {
        TcpState::CloseWait
    };
    if use_reset {
        leave(client, Leave::Reset);
    } else {
        drop(client);
    }
    let seen = collect_until(&mut events, |seen| {
        seen.iter().any(|e| {
            is_change(
                e,
                server,
                client_addr,
                TcpState::Established,
                expected_server_side,
            )
        })
    })
    .await;
    // The client's own socket reports the same connection from its side.
    let client_side = if use_reset {
        TcpState::Close
    } else {
        TcpState::FinWait1
    };
    assert!(
        seen.iter()
            .any(|e| is_change(e, client_addr, server, TcpState::Established, client_side)),
        "client side {client_side:?} missing from {seen:?}"
    );
    let gone: Vec<_> = seen
        .iter()
        .filter(|e| e.is_client_gone(&[server.port()]))
        .collect();
    assert_eq!(gone.len(), 1, "exactly one client-gone event: {seen:?}");
    assert_eq!(gone[0].remote, client_addr);
    assert!(gone[0].at <= guard::reap::event::monotonic_now());
    assert_eq!(tracker.ring_drops(), 0);
    drop(accepted);
}

#[tokio::test(flavor = "multi_thread")]
async fn fin_on_ipv4_is_reported_with_its_4_tuple() {
    close_is_reported("127.0.0.1", false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn reset_on_ipv4_is_reported_with_its_4_tuple() {
    close_is_reported("127.0.0.1", true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn fin_on_ipv6_is_reported_with_its_4_tuple() {
    close_is_reported("[::1]", false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn reset_on_ipv6_is_reported_with_its_4_tuple() {
    close_is_reported("[::1]", true).await;
}

/// The loader hands the program the record's layout (read from the running kernel's format
/// file): told that `sport` and `dport` sit in each other's place, the program reads them so,
/// and the server's own socket reports the connection with its ends swapped.
#[tokio::test(flavor = "multi_thread")]
async fn the_program_reads_fields_where_the_loader_says() {
    require_root();
    let (listener, server) = listener("127.0.0.1");
    let swapped = Layout {
        sport: Layout::KNOWN.dport,
        dport: Layout::KNOWN.sport,
        ..Layout::KNOWN
    };
    let (_tracker, mut events) = EbpfTracker::load_with_layout(&[server.port()], swapped)
        .and_then(guard::reap::Loaded::start)
        .expect("load and attach");
    let (client, accepted) = connect(&listener, server);
    let client_port = client.local_addr().expect("client addr").port();
    drop(client);
    // Only the server's socket goes to CLOSE_WAIT on the client's FIN.
    let seen = collect_until(&mut events, |seen| {
        seen.iter().any(|e| e.new == TcpState::CloseWait)
    })
    .await;
    let server_side = seen
        .iter()
        .find(|e| e.new == TcpState::CloseWait)
        .expect("the server side's close");
    assert_eq!(
        (server_side.local.port(), server_side.remote.port()),
        (client_port, server.port()),
        "{seen:?}"
    );
    drop(accepted);
}

#[tokio::test(flavor = "multi_thread")]
async fn unwatched_port_produces_nothing() {
    require_root();
    let (watched, watched_addr) = listener("127.0.0.1");
    let (unwatched, unwatched_addr) = listener("127.0.0.1");
    let (_tracker, mut events) = EbpfTracker::attach(&[watched_addr.port()]).expect("attach");
    let (client, accepted) = connect(&unwatched, unwatched_addr);
    drop(client);
    drop(accepted);
    // A close on the watched port after the unwatched one is done: the ring buffer is ordered,
    // so by the time its event arrives, any event of the unwatched connection would have too.
    let (sentinel, sentinel_accepted) = connect(&watched, watched_addr);
    let sentinel_addr = sentinel.local_addr().expect("addr");
    drop(sentinel);
    let seen = collect_until(&mut events, |seen| {
        seen.iter()
            .any(|e| e.is_client_gone(&[watched_addr.port()]) && e.remote == sentinel_addr)
    })
    .await;
    let port = unwatched_addr.port();
    let leaked: Vec<_> = seen
        .iter()
        .filter(|e| e.local.port() == port || e.remote.port() == port)
        .collect();
    assert!(
        leaked.is_empty(),
        "events from an unwatched port: {leaked:?}"
    );
    drop(sentinel_accepted);
}

#[tokio::test(flavor = "multi_thread")]
async fn connecting_process_is_recorded_with_pid_uid_and_cgroup() {
    require_root();
    let (listener, server) = listener("127.0.0.1");
    let (tracker, _events) = EbpfTracker::attach(&[server.port()]).expect("attach");
    let cgroup = TestCgroup::new(&cgroup2_root(), "guard-test-owner");

    // The client waits for a line before connecting, so it can be moved into the cgroup first.
    let script = format!(
        "import socket, sys\nsys.stdin.readline()\ns = socket.create_connection(('127.0.0.1', {}))\nprint(s.getsockname()[1], flush=True)\nsys.stdin.readline()\n",
        server.port()
    );
    // Another user than this test's, so that the uid recorded is the client's own.
    const CLIENT_UID: u32 = 65534;
    let mut child = ChildGuard(
        std::os::unix::process::CommandExt::uid(&mut Command::new("python3"), CLIENT_UID)
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn python3"),
    );
    let pid = child.0.id();
    cgroup.add(pid);
    let mut stdin = child.0.stdin.take().expect("stdin");
    writeln!(stdin).expect("tell the client to connect");
    let mut port = String::new();
    BufReader::new(child.0.stdout.take().expect("stdout"))
        .read_line(&mut port)
        .expect("read client port");
    let (accepted, peer) = listener.accept().expect("accept");
    assert_eq!(peer.port().to_string(), port.trim());

    let owner = tracker.owner(peer).expect("the connect owner is recorded");
    assert_eq!(owner.tgid, pid, "tgid is the client process");
    assert_eq!(owner.pid, pid, "the main thread connected");
    assert_eq!(owner.uid, CLIENT_UID, "the client's real uid");
    assert_eq!(
        owner.cgroup_id,
        cgroup.id(),
        "cgroup id is the test cgroup's inode"
    );

    // A connection from this test process is recorded as ours, in our own cgroup.
    let (own, _own_accepted) = connect(&listener, server);
    let own_owner = tracker
        .owner(own.local_addr().expect("addr"))
        .expect("our own connect is recorded");
    assert_eq!(own_owner.tgid, std::process::id());
    assert_ne!(own_owner.cgroup_id, cgroup.id());
    drop(stdin);
    drop(accepted);
    drop(child);
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_connections_lose_no_event() {
    require_root();
    const CONNECTIONS: usize = 10_000;
    let (listener, server) = listener("127.0.0.1");
    let (tracker, mut events) = EbpfTracker::attach(&[server.port()]).expect("attach");
    // Loopback reuses a client port still in TIME_WAIT (net.ipv4.tcp_tw_reuse = 2), so one
    // address can stand for several connections: compare counts per address, not sets.
    let opener = std::thread::spawn(move || {
        let mut clients: HashMap<SocketAddr, usize> = HashMap::new();
        for _ in 0..CONNECTIONS {
            let (client, accepted) = connect(&listener, server);
            *clients
                .entry(client.local_addr().expect("addr"))
                .or_default() += 1;
            drop(client);
            // Close the server's end only once the client's FIN has reached it: otherwise,
            // where softirqs run late (one emulated CPU), the server may close first and
            // its socket never passes through CLOSE_WAIT.
            let mut accepted = accepted;
            let read = std::io::Read::read(&mut accepted, &mut [0u8; 1]).expect("read");
            assert_eq!(read, 0, "the client sent nothing before its FIN");
            drop(accepted);
        }
        clients
    });
    let mut gone: HashMap<SocketAddr, usize> = HashMap::new();
    let mut gone_total = 0;
    // A bound, not a wait: it ends when the last close arrives (a second here, most of a
    // minute in an emulated guest).
    let bound = std::time::Duration::from_secs(300);
    collect_until_within(&mut events, bound, |seen: &[ConnEvent]| {
        if let Some(last) = seen.last()
            && last.is_client_gone(&[server.port()])
        {
            *gone.entry(last.remote).or_default() += 1;
            gone_total += 1;
        }
        gone_total >= CONNECTIONS
    })
    .await;
    let clients = opener.join().expect("opener thread");
    println!(
        "burst: {gone_total} close events of {CONNECTIONS} connections, {} ring drops",
        tracker.ring_drops()
    );
    assert_eq!(
        gone, clients,
        "every close was reported once, for the right client"
    );
    assert_eq!(tracker.ring_drops(), 0, "no ring-buffer drops");
    assert!(tracker.events_sent() >= CONNECTIONS as u64 * 2);
}

/// The whole path on this kernel: guard with its program attached, a request running at a
/// tiny upstream, the client resets, and guard reaps the request (no user-space watcher runs
/// while the program is attached).
#[tokio::test(flavor = "multi_thread")]
async fn a_departed_client_is_reaped_end_to_end() {
    require_root();
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(upstream.addr(), "openai", "");
    let attached = guard.metric("guard_ebpf_attached").await;
    assert_eq!(attached, 1.0, "{}", guard.metrics_text().await);
    hang_then_leave(&upstream, guard.listen).await;
    guard
        .wait_for_metric(
            "guard_reaped_total{class=\"interactive\",stage=\"running\"}",
            1.0,
        )
        .await;
    assert_eq!(guard.metric("guard_ebpf_ring_drops_total").await, 0.0);
}
