//! Beyond one box, with real HAProxy from Debian: two guards, each before its own one-slot
//! upstream, behind HAProxy's round robin. With agent-check, HAProxy keeps new work away from a
//! box whose queue is full or whose protected class is at risk, and comes back when it clears;
//! without it, that box answers 503. The model-server view counts exactly what waits and runs.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use guard_testkit::{Mode, Polling, Script, Upstream, until_with};
use guard_tests::{
    free_addr,
    http::{get, raw_request},
    peers::Peer,
    scripted::{PATH, post_script},
    servers::GuardProcess,
};
use tokio::net::TcpStream;

/// How long HAProxy may take to act on what an agent said (checks every 200 ms).
const SEEN_BOUND: Duration = Duration::from_secs(10);
/// Waiting for what HAProxy or an agent should show.
const SEEN: Polling = Polling::within(SEEN_BOUND, Duration::from_millis(20));

/// One box (a node): an upstream with one slot, guard in front with its agent on.
struct Node {
    upstream: Upstream,
    guard: GuardProcess,
    agent: SocketAddr,
}

impl Node {
    async fn start(extra: &str) -> Self {
        let upstream = Upstream::start().await;
        let agent = free_addr();
        let config = format!(
            "[upstream]\nmax_concurrency = 1\n[cluster]\nagent_listen = \"{agent}\"\n{extra}"
        );
        let guard = GuardProcess::start(upstream.addr(), "openai", &config);
        Self {
            upstream,
            guard,
            agent,
        }
    }

    /// What its agent answers now.
    async fn agent_line(&self) -> String {
        use tokio::io::AsyncReadExt as _;
        let mut stream = TcpStream::connect(self.agent)
            .await
            .expect("connect to the agent");
        let mut line = String::new();
        stream
            .read_to_string(&mut line)
            .await
            .expect("read the agent's line");
        line
    }

    /// Requests its upstream has seen.
    fn served(&self) -> usize {
        self.upstream.started()
    }

    /// A request that holds its place (the upstream never answers) until the returned
    /// connection is dropped (its client leaves).
    async fn hold(&self) -> TcpStream {
        let hang = Script::new(Mode::Hang).json();
        raw_request(self.guard.listen, PATH, &[], &hang).await
    }
}

const ONE_PLACE: &str =
    "[class.interactive]\nmax_queue = 1\n[class.batch]\npriority = 10\nmax_queue = 1\n";

/// HAProxy's view of a server: its status and weight, from the stats page's CSV.
async fn haproxy_sees(stats: SocketAddr, server: &str) -> (String, String) {
    let page = get(stats, "/stats;csv")
        .await
        .map(|r| r.text())
        .unwrap_or_default();
    let header: Vec<&str> = page
        .lines()
        .next()
        .unwrap_or_default()
        .trim_start_matches("# ")
        .split(',')
        .collect();
    let column = |name: &str| header.iter().position(|h| *h == name).expect(name);
    let (status, weight) = (column("status"), column("weight"));
    page.lines()
        .map(|l| l.split(',').collect::<Vec<_>>())
        .find(|cells| cells.get(1) == Some(&server))
        .map(|cells| (cells[status].to_owned(), cells[weight].to_owned()))
        .unwrap_or_default()
}

/// One request that completes at once, sent through the balancer; its status.
async fn through(front: SocketAddr) -> u16 {
    post_script(front, &Script::new(Mode::Complete))
        .await
        .status
}

/// Fills box A's queue (one running, one waiting), then sends 50 requests through HAProxy;
/// returns their statuses and what each box's upstream saw of them.
async fn fifty_with_a_full(agent_check: bool) -> (Vec<u16>, usize, usize, Fleet) {
    let fleet = Fleet::start(agent_check).await;
    let holders = [fleet.a.hold().await, fleet.a.hold().await];
    fleet
        .a
        .guard
        .wait_for_metric("guard_queue_depth{class=\"interactive\"}", 1.0)
        .await;
    if agent_check {
        assert_eq!(fleet.a.agent_line().await, "drain\n");
        until_with(SEEN, "HAProxy drains box A", async || {
            haproxy_sees(fleet.stats, "box0")
                .await
                .0
                .starts_with("DRAIN")
        })
        .await;
    }
    let (a_before, b_before) = (fleet.a.served(), fleet.b.served());
    let mut statuses = Vec::new();
    for _ in 0..50 {
        statuses.push(through(fleet.haproxy.addr).await);
    }
    let (a, b) = (fleet.a.served() - a_before, fleet.b.served() - b_before);
    (
        statuses,
        a,
        b,
        Fleet {
            holders: holders.into(),
            ..fleet
        },
    )
}

struct Fleet {
    a: Node,
    b: Node,
    haproxy: Peer,
    stats: SocketAddr,
    holders: Vec<TcpStream>,
}

impl Fleet {
    async fn start(agent_check: bool) -> Self {
        let (a, b) = (Node::start(ONE_PLACE).await, Node::start(ONE_PLACE).await);
        let stats = free_addr();
        let agent = |b: &Node| agent_check.then_some(b.agent);
        let haproxy = Peer::haproxy_balancer(
            &[(a.guard.listen, agent(&a)), (b.guard.listen, agent(&b))],
            stats,
        );
        for server in ["box0", "box1"] {
            until_with(SEEN, "HAProxy sees both boxes up", async || {
                haproxy_sees(stats, server).await.0 == "UP"
            })
            .await;
        }
        Self {
            a,
            b,
            haproxy,
            stats,
            holders: Vec::new(),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn haproxy_keeps_work_away_from_a_full_box_and_comes_back_when_it_clears() {
    guard_tests::require_root();
    let (statuses, a, b, fleet) = fifty_with_a_full(true).await;
    println!(
        "agent-check on: 50 requests: {} answered 200, box A saw {a}, box B saw {b}",
        statuses.iter().filter(|s| **s == 200).count()
    );
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!((a, b), (0, 50));
    // A clears: its clients leave, guard reaps them, its agent says up again.
    let mut fleet = fleet;
    fleet.holders.clear();
    let cleared = Instant::now();
    until_with(SEEN, "box A clears", async || {
        fleet.a.agent_line().await.starts_with("up ready")
    })
    .await;
    let before = fleet.a.served();
    while fleet.a.served() == before {
        assert_eq!(through(fleet.haproxy.addr).await, 200);
        assert!(
            cleared.elapsed() < SEEN_BOUND,
            "HAProxy never came back to box A"
        );
    }
    println!(
        "HAProxy sent to box A again {} ms after it cleared",
        cleared.elapsed().as_millis()
    );
    assert!(
        cleared.elapsed() < Duration::from_secs(1),
        "{:?}",
        cleared.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn without_agent_check_the_full_box_answers_503() {
    guard_tests::require_root();
    let (statuses, a, b, _fleet) = fifty_with_a_full(false).await;
    let refused = statuses.iter().filter(|s| **s == 503).count();
    println!(
        "agent-check off: 50 requests: {refused} answered 503, box A's upstream saw {a}, box B's {b}"
    );
    assert!(
        refused > 0,
        "round robin reaches the full box: {statuses:?}"
    );
    assert_eq!(refused + b, 50);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_box_whose_protected_class_is_at_risk_drains() {
    guard_tests::require_root();
    // A protected request waiting a tenth of its 5 s deadline is a risk.
    let at_risk = "[risk]\nwait_fraction = 0.1\n[class.interactive]\ndeadline_ms = 5000\nmax_queue = 4\n[class.batch]\npriority = 10\nmax_queue = 4\n";
    let fleet_a = Node::start(at_risk).await;
    let b = Node::start(ONE_PLACE).await;
    let stats = free_addr();
    let haproxy = Peer::haproxy_balancer(
        &[
            (fleet_a.guard.listen, Some(fleet_a.agent)),
            (b.guard.listen, Some(b.agent)),
        ],
        stats,
    );
    until_with(SEEN, "HAProxy sees box A up", async || {
        haproxy_sees(stats, "box0").await.0 == "UP"
    })
    .await;
    let _running = fleet_a.hold().await;
    let _waiting = fleet_a.hold().await;
    until_with(SEEN, "box A's agent drains", async || {
        fleet_a.agent_line().await == "drain\n"
    })
    .await;
    let status = get(fleet_a.guard.metrics, "/status")
        .await
        .expect("status")
        .text();
    assert!(
        status.contains("\"wait\""),
        "the risk is the wait: {status}"
    );
    until_with(SEEN, "HAProxy drains box A", async || {
        haproxy_sees(stats, "box0").await.0.starts_with("DRAIN")
    })
    .await;
    let before = fleet_a.served();
    for _ in 0..10 {
        assert_eq!(through(haproxy.addr).await, 200);
    }
    assert_eq!(
        fleet_a.served(),
        before,
        "HAProxy sent work to a box at risk"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_model_server_view_counts_what_waits_and_runs() {
    guard_tests::require_root();
    let a = Node::start("[class.interactive]\nmax_queue = 8\n").await;
    let view = async || {
        let text = get(a.guard.metrics, "/metrics/model-server")
            .await
            .expect("model-server view")
            .text();
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or(-1.0)
        };
        (
            value("vllm:num_requests_waiting"),
            value("vllm:num_requests_running"),
            value("vllm:kv_cache_usage_perc"),
        )
    };
    assert_eq!(view().await, (0.0, 0.0, 0.0));
    let mut held = Vec::new();
    for n in 1..=4u32 {
        held.push(a.hold().await);
        // The first runs, the others wait: both counts settled before the view is read.
        a.guard
            .wait_for_metric("guard_inflight{class=\"interactive\"}", 1.0)
            .await;
        a.guard
            .wait_for_metric("guard_queue_depth{class=\"interactive\"}", f64::from(n - 1))
            .await;
        let (waiting, running, usage) = view().await;
        assert_eq!(
            (waiting, running),
            (f64::from(n - 1), 1.0),
            "after {n} requests"
        );
        assert_eq!(usage, 1.0, "one slot, taken");
    }
    let status = get(a.guard.metrics, "/status")
        .await
        .expect("status")
        .text();
    assert!(
        status.contains("\"waiting\":3") && status.contains("\"running\":1"),
        "{status}"
    );
}
