//! Interactive never waits for batch: on the real llama-server with one slot, a flood of long
//! batch jobs (streamed and whole) is preempted for each interactive chat and goes on where it
//! stopped; every batch client gets its whole answer, in the form it asked for, and a preempted
//! answer is byte for byte the unpreempted one.

use std::time::{Duration, Instant};

use guard_testkit::{Polling, until_with};
use guard_tests::{
    body::{With as _, chat, completion, ollama_chat},
    http::{post, post_streamed},
    serial,
    servers::{GuardProcess, LlamaServer},
};
use serde_json::json;

const CONFIG: &str = "[estimate]\ninitial_service_ms = 100\n\
                      [class.interactive]\npriority = 0\nmax_queue = 8\ndeadline_ms = 10000\n\
                      [class.batch]\npriority = 10\nmax_queue = 100\npreemptible = true\n";

const PROMPTS: [&str; 6] = [
    "Write a long story about a lighthouse keeper.",
    "Explain how bread is made, step by step, in detail.",
    "List the planets of the solar system and describe each one.",
    "Write a long letter to a friend about a trip to the mountains.",
    "Describe the history of the bicycle in detail.",
    "Explain photosynthesis to a child, at length.",
];

/// What a batch job reads before its task, as extraction jobs do: long enough that a chat,
/// which shares only the template's system prompt with it, never takes its cached state (a
/// shorter job is protected too, at the cost of filler the server reads at each preemption:
/// see `Exact::pad`).
const PASSAGE: &str = "Passage: the harbour town kept its lighthouse lit through every winter. \
                       The keeper wrote the weather, the ships and the tides in a ledger each \
                       night, and the ledgers filled a shelf in the tower. Fishermen, traders \
                       and a travelling doctor passed through the town each year.\n\nTask: ";

fn batch_body(prompt: &str, stream: bool) -> serde_json::Value {
    chat(&format!("{PASSAGE}{prompt}"))
        .with("max_tokens", 160)
        .with("temperature", 0)
        .with("stream", stream)
}

/// A short streamed interactive chat.
fn say_hi() -> serde_json::Value {
    chat("Say hi.").with("max_tokens", 4).with("stream", true)
}

/// The text of an answer: one chat completion, or the deltas of a stream.
fn text_of(stream: bool, body: &[u8]) -> String {
    if !stream {
        let answer: serde_json::Value = serde_json::from_slice(body).expect("json answer");
        return answer["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_owned();
    }
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// Time to the first byte of a short streamed interactive chat.
async fn interactive_ttft(addr: std::net::SocketAddr) -> Duration {
    let sent = Instant::now();
    let answer = post_streamed(addr, "/v1/chat/completions", &[], &say_hi()).await;
    assert_eq!(answer.status, 200);
    let first = answer.frames.first().expect("a frame").0;
    first.duration_since(sent)
}

fn p95(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[(samples.len() * 95).div_ceil(100) - 1]
}

/// Interactive chats' times to first byte while the batch flood is on: up to twenty, each
/// begun while a batch job runs, and at least eight. Twenty where the flood lasts (it does on
/// two cores): the nearest-rank p95 is then the second slowest, so one chat that met a resumed
/// job's prompt read (the server cannot stop within a prompt batch) on a loaded machine is not
/// the figure.
async fn ttft_during_the_flood(guard: &GuardProcess) -> Vec<Duration> {
    let mut busy = Vec::new();
    while busy.len() < 20 && guard.metric("guard_inflight{class=\"batch\"}").await >= 1.0 {
        busy.push(interactive_ttft(guard.listen).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(busy.len() >= 8, "the flood outlasted {} chats", busy.len());
    busy
}

#[tokio::test(flavor = "multi_thread")]
async fn interactive_preempts_batch_which_goes_on_where_it_stopped() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    // The batch jobs' prompts have been read before, as a pipeline's shared passage is: a chat
    // arriving as a job starts waits for the server to read what it has not (it cannot stop
    // within a prompt batch), not the whole passage.
    for prompt in PROMPTS {
        let mut body = batch_body(prompt, false);
        body["max_tokens"] = json!(1);
        assert_eq!(
            post(llama.addr, "/v1/chat/completions", &[], &body)
                .await
                .status,
            200
        );
    }
    let guard = GuardProcess::start(llama.addr, "openai", CONFIG);
    let mut idle = Vec::new();
    for _ in 0..5 {
        idle.push(interactive_ttft(guard.listen).await);
    }
    let idle_p95 = p95(idle);

    let batch = [("x-guard-class", "batch")];
    let mut jobs = Vec::new();
    for (n, prompt) in PROMPTS.iter().enumerate() {
        let (addr, stream) = (guard.listen, n % 2 == 0);
        let body = batch_body(prompt, stream);
        jobs.push(tokio::spawn(async move {
            let answer = post_streamed(addr, "/v1/chat/completions", &batch, &body).await;
            let bytes = answer.bytes();
            (answer.status, stream, bytes)
        }));
    }
    guard
        .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
        .await;
    let busy = ttft_during_the_flood(&guard).await;
    let busy_p95 = p95(busy.clone());
    for (n, job) in jobs.into_iter().enumerate() {
        let (status, stream, body) = job.await.expect("batch job");
        assert_eq!(status, 200, "job {n}");
        let text = text_of(stream, &body);
        assert!(!text.is_empty(), "job {n} has an answer");
    }
    let text = guard.metrics_text().await;
    let m = |series: &str| guard_tests::metric(&text, series).unwrap_or(0.0);
    let preempted = m("guard_preempted_total{class=\"batch\"}");
    eprintln!(
        "idle p95 {idle_p95:?}, during the flood p95 {busy_p95:?} ({busy:?}); {preempted} preemptions"
    );
    assert!(preempted >= 1.0, "batch was preempted");
    assert_eq!(
        m("guard_preempt_resumes_total{class=\"batch\",kind=\"exact\"}"),
        preempted,
        "every resume on llama-server is exact"
    );
    assert_eq!(
        m("guard_jobs_total{class=\"batch\",result=\"valid\"}"),
        PROMPTS.len() as f64,
        "every batch job is whole"
    );
    assert!(
        busy_p95 <= idle_p95 + Duration::from_millis(150),
        "interactive p95 {busy_p95:?} against {idle_p95:?} idle"
    );
}

/// Five answers about the sea through guard, each whole: three interactive (a whole chat, a
/// streamed chat, llama-server's `/completion`) and two batch (whole and streamed).
async fn ask_about_the_sea(addr: std::net::SocketAddr) {
    let sea = |stream: bool, tokens: u64| {
        chat("Tell me about the sea.")
            .with("max_tokens", tokens)
            .with("stream", stream)
    };
    let batch = [("x-guard-class", "batch")];
    assert_eq!(
        post(addr, "/v1/chat/completions", &[], &sea(false, 7))
            .await
            .status,
        200
    );
    assert_eq!(
        post_streamed(addr, "/v1/chat/completions", &[], &sea(true, 9))
            .await
            .status,
        200
    );
    let the_sea_is = json!({ "prompt": "The sea is", "n_predict": 11 });
    assert_eq!(
        post(addr, "/completion", &[], &the_sea_is).await.status,
        200
    );
    assert_eq!(
        post(addr, "/v1/chat/completions", &batch, &sea(false, 5))
            .await
            .status,
        200
    );
    assert_eq!(
        post_streamed(addr, "/v1/chat/completions", &batch, &sea(true, 6))
            .await
            .status,
        200
    );
}

/// The server dies halfway through a long interactive answer: guard counts that job invalid.
async fn a_job_cut_halfway_is_invalid(guard: &GuardProcess, llama: &mut LlamaServer) {
    let long = completion("Write a long story.", 2000).with("stream", true);
    let (response, _sender, _connection) =
        guard_tests::http::open_post(guard.listen, "/completion", &[], &long)
            .await
            .expect("the long answer begins");
    let mut body = response.into_body();
    // Its first tokens have come: the server is generating it now.
    let first = http_body_util::BodyExt::frame(&mut body).await;
    assert!(first.is_some_and(|f| f.is_ok()), "a first frame");
    llama.crash();
    while let Some(Ok(_)) = http_body_util::BodyExt::frame(&mut body).await {}
    guard
        .wait_for_metric(
            "guard_jobs_total{class=\"interactive\",result=\"invalid\"}",
            1.0,
        )
        .await;
}

/// guard's token counts are the server's own; a job the server stops halfway is not a job done.
#[tokio::test(flavor = "multi_thread")]
async fn tokens_are_the_servers_own_count_and_a_cut_job_is_invalid() {
    let _serial = serial().await;
    let mut llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", CONFIG);
    let before = llama.metric("tokens_predicted_total").await;
    ask_about_the_sea(guard.listen).await;
    let served = llama.metric("tokens_predicted_total").await - before;
    let text = guard.metrics_text().await;
    let m = |series: &str| guard_tests::metric(&text, series).unwrap_or(0.0);
    let counted = m("guard_tokens_total{class=\"interactive\",kind=\"generated\"}")
        + m("guard_tokens_total{class=\"batch\",kind=\"generated\"}");
    assert_eq!(counted, served, "guard counts what llama-server generated");
    assert_eq!(
        m("guard_jobs_total{class=\"interactive\",result=\"valid\"}"),
        3.0
    );
    assert_eq!(m("guard_jobs_total{class=\"batch\",result=\"valid\"}"), 2.0);
    assert!(m("guard_generation_tokens_per_second_count{class=\"interactive\"}") >= 3.0);

    // The server dies halfway through a long answer: that job is invalid.
    a_job_cut_halfway_is_invalid(&guard, &mut llama).await;
}

/// Two flows in one class (`fair_by`): fifty jobs of one tenant queued, then five of another;
/// the five are all served within the next ten dispatches.
#[tokio::test(flavor = "multi_thread")]
async fn a_small_flow_gets_its_turns_beside_a_large_one() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let config = "[class.interactive]\npriority = 0\nmax_queue = 8\n\
                  [class.batch]\npriority = 10\nmax_queue = 100\nfair_by = \"header:x-tenant\"\n";
    let guard = GuardProcess::start(llama.addr, "openai", config);
    let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let send = |tenant: &'static str| {
        let (addr, done) = (guard.listen, std::sync::Arc::clone(&done));
        tokio::spawn(async move {
            let body = completion("Count to ten:", 16);
            let headers = [("x-guard-class", "batch"), ("x-tenant", tenant)];
            let answer = post(addr, "/completion", &headers, &body).await;
            assert_eq!(answer.status, 200);
            done.lock().expect("order").push(tenant);
        })
    };
    let mut jobs: Vec<_> = (0..50).map(|_| send("a")).collect();
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", 45.0)
        .await;
    let before = done.lock().expect("order").len();
    jobs.extend((0..5).map(|_| send("b")));
    for job in jobs {
        job.await.expect("job");
    }
    let order = done.lock().expect("order").clone();
    let last_b = order.iter().rposition(|t| *t == "b").expect("b served");
    // One `a` may be running as the five arrive: then ten dispatches.
    assert!(
        last_b < before + 11,
        "the last of the small flow came at {last_b}, {before} were done before it arrived: {order:?}"
    );
}

/// `expect = "json"`: a job counts as valid only when its answer's text is JSON, streamed or
/// whole; the last hour's jobs and tokens show in /status.
#[tokio::test(flavor = "multi_thread")]
async fn a_class_that_expects_json_counts_only_json_answers() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let config = CONFIG.replace("preemptible = true\n", "expect = \"json\"\n");
    let guard = GuardProcess::start(llama.addr, "openai", &config);
    let batch = [("x-guard-class", "batch")];
    let json_only = json!({ "prompt": "Answer:", "grammar": "root ::= \"{\\\"ok\\\": true}\"", "n_predict": 20 });
    let prose = completion("Once upon a time", 8);
    for (body, stream) in [
        (&json_only, false),
        (&json_only, true),
        (&prose, false),
        (&prose, true),
    ] {
        let mut body = body.clone();
        body["stream"] = json!(stream);
        let answer = post_streamed(guard.listen, "/completion", &batch, &body).await;
        assert_eq!(answer.status, 200);
    }
    let text = guard.metrics_text().await;
    let m = |series: &str| guard_tests::metric(&text, series).unwrap_or(0.0);
    assert_eq!(
        m("guard_jobs_total{class=\"batch\",result=\"valid\"}"),
        2.0,
        "the two JSON answers"
    );
    assert_eq!(
        m("guard_jobs_total{class=\"batch\",result=\"invalid\"}"),
        2.0,
        "the two in prose"
    );
    let status = guard.status().await;
    assert_eq!(status["last_hour"]["batch"]["valid_jobs"], 2, "{status}");
    assert_eq!(status["last_hour"]["batch"]["invalid_jobs"], 2, "{status}");
    assert!(
        status["last_hour"]["batch"]["generated_tokens"]
            .as_u64()
            .unwrap_or(0)
            >= 16
    );
}

/// The exact-resume tests: a batch class that is preempted only where it goes on exactly.
const EXACT: &str = "[estimate]\ninitial_service_ms = 100\n\
                     [class.interactive]\npriority = 0\nmax_queue = 8\n\
                     [class.batch]\npriority = 10\nmax_queue = 100\npreemptible = \"exact-only\"\n";

/// Where a job is when the interactive chat comes.
#[derive(Clone, Copy, Debug)]
enum At {
    /// Still reading its (long) prompt.
    Prompt,
    /// Three tokens in.
    Early,
    /// Two thirds of its tokens in.
    Late,
}

/// One job shape: its endpoint and body, and whether its client streams.
struct Job {
    path: &'static str,
    body: serde_json::Value,
    stream: bool,
}

impl Job {
    fn shapes() -> [Self; 4] {
        [
            Self {
                path: "/v1/chat/completions",
                body: chat("Tell me a short story about a cat.")
                    .with("max_tokens", 150)
                    .with("temperature", 0),
                stream: false,
            },
            // No token limit: it ends at its own stop (50 to 110 tokens).
            Self {
                path: "/v1/chat/completions",
                body: chat("Explain in a short paragraph why the sky is blue.")
                    .with("temperature", 0)
                    .with("stream", true),
                stream: true,
            },
            Self {
                path: "/completion",
                body: json!({ "prompt": "Once upon a time, in a quiet village,", "n_predict": 120,
                              "temperature": 0, "stream": true }),
                stream: true,
            },
            Self {
                path: "/v1/completions",
                body: json!({ "prompt": "The history of the bicycle begins", "max_tokens": 100,
                              "temperature": 0 }),
                stream: false,
            },
        ]
    }

    /// The same job, its prompt unique to run `n` (so that no server has it cached) and, where
    /// `long`, behind a preamble that takes the server seconds to read.
    fn variant(&self, n: usize, long: bool) -> Self {
        let preamble = match long {
            true => "Read this note and then answer. The note: a river runs past a mill and \
                     the miller counts the sacks of grain each morning. "
                .repeat(30),
            false => String::new(),
        };
        let prompt = |text: &str| json!(format!("Request {n}. {preamble}{text}"));
        let mut body = self.body.clone();
        if let Some(content) = body.pointer_mut("/messages/0/content") {
            *content = prompt(content.as_str().unwrap_or_default());
        } else if let Some(text) = body.get_mut("prompt") {
            *text = prompt(text.as_str().unwrap_or_default());
        }
        Self {
            path: self.path,
            body,
            stream: self.stream,
        }
    }

    fn variant_of_itself(&self) -> Self {
        Self {
            path: self.path,
            body: self.body.clone(),
            stream: self.stream,
        }
    }

    async fn send(&self, addr: std::net::SocketAddr, headers: &[(&str, &str)]) -> (u16, String) {
        let answer = post_streamed(addr, self.path, headers, &self.body).await;
        let bytes = answer.bytes();
        (answer.status, comparable(self.stream, &bytes))
    }
}

/// An answer without what differs between any two runs of the same request straight to
/// llama-server (its id and creation second, the server's timings and prompt-cache counts,
/// the token budget it echoes in its settings): the rest, every event in order, is compared
/// byte for byte.
fn comparable(stream: bool, body: &[u8]) -> String {
    fn strip(payload: &str) -> String {
        let Ok(mut value) = serde_json::from_str::<serde_json::Value>(payload) else {
            return payload.to_owned();
        };
        if let Some(map) = value.as_object_mut() {
            for key in ["id", "created", "timings", "tokens_cached", "id_slot"] {
                map.remove(key);
            }
            if let Some(usage) = map.get_mut("usage").and_then(|u| u.as_object_mut()) {
                usage.remove("prompt_tokens_details");
            }
            if let Some(settings) = map
                .get_mut("generation_settings")
                .and_then(|s| s.as_object_mut())
            {
                settings.remove("n_predict");
                settings.remove("max_tokens");
                settings.remove("timings_per_token");
            }
        }
        value.to_string()
    }
    let text = String::from_utf8_lossy(body);
    if !stream {
        return strip(&text);
    }
    text.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .map(strip)
        .collect::<Vec<_>>()
        .join("\n")
}

/// Waits until llama-server's one slot has generated `tokens` of its running task.
async fn decoded(llama: std::net::SocketAddr, tokens: u64) {
    let polling = Polling::within(Duration::from_secs(60), Duration::from_millis(5));
    until_with(polling, &format!("{tokens} tokens"), async || {
        let slots = guard_tests::http::get(llama, "/slots")
            .await
            .expect("slots")
            .json();
        let n = slots[0]["next_token"][0]["n_decoded"].as_u64().unwrap_or(0);
        slots[0]["is_processing"] == true && n >= tokens
    })
    .await;
}

/// Sends a batch job through guard and returns once llama-server has generated five of its
/// tokens; the job's answer comes from the handle.
async fn running_batch_job(
    guard: &GuardProcess,
    llama: std::net::SocketAddr,
    path: &'static str,
    body: &serde_json::Value,
) -> tokio::task::JoinHandle<guard_tests::http::Response> {
    let (addr, body) = (guard.listen, body.clone());
    let job =
        tokio::spawn(async move { post(addr, path, &[("x-guard-class", "batch")], &body).await });
    guard
        .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
        .await;
    decoded(llama, 5).await;
    job
}

/// Every job shape (a whole chat with a token limit, a streamed chat without one, llama-server's
/// `/completion` streamed, `/v1/completions` whole), preempted while it reads its prompt, early
/// and late: the client's answer is, byte for byte, the one the same request gets straight from
/// a llama-server in the same state: a second one, started alike for each run. (llama-server's
/// own answers depend on its cache: a prompt it reads in one batch and the same prompt found in
/// its cache, its last token evaluated again alone, can tip a near tie apart at temperature 0;
/// so each run starts both servers fresh.) Each resume goes on from the exact token ids and
/// reads at most 16 prompt tokens again, by llama-server's own count.
#[tokio::test(flavor = "multi_thread")]
async fn a_preempted_answer_is_byte_for_byte_the_unpreempted_one() {
    let _serial = serial().await;
    let chat = say_hi();
    let mut n = 0;
    let only = std::env::var("GUARD_TEST_SHAPE").ok();
    for shape in Job::shapes() {
        if only.as_deref().is_some_and(|path| path != shape.path) {
            continue;
        }
        for at in [At::Prompt, At::Early, At::Late] {
            n += 1;
            let job = shape.variant(n, matches!(at, At::Prompt));
            preempt_and_compare(&job, at, &chat).await;
        }
    }
}

/// One run of [`a_preempted_answer_is_byte_for_byte_the_unpreempted_one`]: `job` straight to a
/// fresh llama-server, then through guard in front of another, preempted `at` by `chat`.
async fn preempt_and_compare(job: &Job, at: At, chat: &serde_json::Value) {
    let batch = [("x-guard-class", "batch")];
    let (llama, reference) = tokio::join!(LlamaServer::start(1), LlamaServer::start(1));
    let guard = GuardProcess::start(llama.addr, "openai", EXACT);
    let straight = job.send(reference.addr, &[]).await;
    let length = reference.metric("tokens_predicted_total").await as u64;
    let before = Preemptions::of(&guard.metrics_text().await);
    let read_before = llama.metric("prompt_tokens_total").await;
    let running = {
        let (addr, job) = (guard.listen, job.variant_of_itself());
        tokio::spawn(async move { job.send(addr, &batch).await })
    };
    guard
        .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
        .await;
    match at {
        At::Prompt => {}
        At::Early => decoded(llama.addr, 3).await,
        At::Late => decoded(llama.addr, length * 2 / 3).await,
    }
    let answered = post_streamed(guard.listen, "/v1/chat/completions", &[], chat).await;
    assert_eq!(answered.status, 200);
    let through = running.await.expect("batch job");
    let what = format!("{} at {at:?}", job.path);
    assert_eq!(through.0, 200, "{what}");
    assert_same_answer(&what, &through.1, &straight.1);
    let after = Preemptions::of(&guard.metrics_text().await);
    let preempted = after.preempted - before.preempted;
    let exact = after.exact - before.exact;
    assert_eq!((preempted, exact), (1.0, 1.0), "{what}: one exact resume");
    let reread = after.reread - before.reread;
    assert!(reread <= 16.0, "{what}: {reread} tokens read again");
    // guard's counts are llama-server's own: what it read in all is the job's prompt, the
    // chat's, what the resume read again and any padding, each as guard counted it.
    let read = llama.metric("prompt_tokens_total").await - read_before;
    let counted = after.counted - before.counted;
    assert_eq!(
        read, counted,
        "{what}: llama-server read {read}, guard counted {counted}"
    );
    eprintln!("{what}: {reread} prompt tokens read again");
}

/// guard's batch preemption counts and the prompt tokens it counted computed, from its metrics.
struct Preemptions {
    preempted: f64,
    exact: f64,
    reread: f64,
    /// Prompt tokens computed, batch and interactive together.
    counted: f64,
}

impl Preemptions {
    fn of(text: &str) -> Self {
        let m = |series: &str| guard_tests::metric(text, series).unwrap_or(0.0);
        Self {
            preempted: m("guard_preempted_total{class=\"batch\"}"),
            exact: m("guard_preempt_resumes_total{class=\"batch\",kind=\"exact\"}"),
            reread: m("guard_preempt_reread_tokens_total{class=\"batch\"}"),
            counted: m("guard_prompt_tokens_total{class=\"batch\",source=\"computed\"}")
                + m("guard_prompt_tokens_total{class=\"interactive\",source=\"computed\"}"),
        }
    }
}

/// Panics, saying at which event, where the answer through guard differs from the straight one.
fn assert_same_answer(what: &str, through: &str, straight: &str) {
    if through != straight {
        let (ours, theirs): (Vec<_>, Vec<_>) =
            (through.lines().collect(), straight.lines().collect());
        let at = ours.iter().zip(&theirs).position(|(a, b)| a != b);
        let line =
            |lines: &[&str], n: Option<usize>| n.and_then(|n| lines.get(n)).map(|l| l.to_string());
        panic!(
            "{what}: the answer differs at event {at:?} of {} (straight {}):\n  through guard: {:?}\n  straight:      {:?}",
            ours.len(),
            theirs.len(),
            line(&ours, at),
            line(&theirs, at),
        );
    }
}

/// llama-server dies while a preempted request waits to go on, and comes back with an empty
/// cache: the client gets a clean error in its API's shape, never a cut answer passed off as
/// whole, and the job counts as invalid; the next job goes through the restarted server whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_request_whose_server_dies_fails_cleanly() {
    let _serial = serial().await;
    let mut llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", EXACT);
    let batch = [("x-guard-class", "batch")];
    let body = chat("Tell me a short story about a cat.")
        .with("max_tokens", 150)
        .with("temperature", 0);
    let job = running_batch_job(&guard, llama.addr, "/v1/chat/completions", &body).await;
    // A long interactive answer holds the slot while the batch job waits.
    let long = chat("Write a long story.")
        .with("max_tokens", 1000)
        .with("stream", true);
    let (head, _sender, _connection) =
        guard_tests::http::open_post(guard.listen, "/v1/chat/completions", &[], &long)
            .await
            .expect("the interactive answer begins");
    assert_eq!(head.status(), 200);
    guard
        .wait_for_metric("guard_preempted_total{class=\"batch\"}", 1.0)
        .await;
    llama.crash();
    let answer = job.await.expect("batch job");
    assert_eq!(answer.status, 502, "{}", answer.text());
    let error = answer.json();
    assert!(
        error["error"]["message"].is_string() && error.get("choices").is_none(),
        "an OpenAI error, not an answer: {error}"
    );
    guard
        .wait_for_metric("guard_jobs_total{class=\"batch\",result=\"invalid\"}", 1.0)
        .await;
    llama.restart().await;
    let again = post(guard.listen, "/v1/chat/completions", &batch, &body).await;
    assert_eq!(again.status, 200, "{}", again.text());
    let text = again.json()["choices"][0]["message"]["content"]
        .as_str()
        .map(str::to_owned);
    assert!(text.is_some_and(|t| !t.is_empty()));
    assert_eq!(
        guard
            .metric("guard_jobs_total{class=\"batch\",result=\"valid\"}")
            .await,
        1.0
    );
}

/// `preemptible = "exact-only"`: a request that can go on from its exact token ids is stopped
/// for a chat, one that cannot (a grammar constrains it) runs to its end; `/status` says how the
/// class's requests go on.
#[tokio::test(flavor = "multi_thread")]
async fn an_exact_only_class_stops_only_what_goes_on_exactly() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", EXACT);
    let status = || async { guard.status().await["preemption"]["batch"].clone() };
    assert_eq!(
        status().await,
        json!({"preemptible": "exact-only", "resume": null})
    );
    // guard doctor says how the class's requests go on, from the same config.
    let doctor = std::process::Command::new(guard_tests::guard_bin())
        .args(["doctor", "--config"])
        .arg(&guard.config_path)
        .output()
        .expect("guard doctor");
    let said = String::from_utf8_lossy(&doctor.stdout);
    let line = said
        .lines()
        .find(|l| l.contains("preempted requests go on"))
        .unwrap_or_default();
    assert!(
        line.contains("from the exact token ids: llama-server"),
        "{said}"
    );
    let chat = say_hi();
    let constrained = json!({ "prompt": "Letters:", "grammar": "root ::= [a-z ]+",
                              "n_predict": 60, "ignore_eos": true, "temperature": 0 });
    let plain = completion("Letters:", 60).with("temperature", 0);
    for (body, stopped, resume) in [(&constrained, 0.0, "off"), (&plain, 1.0, "exact")] {
        let job = running_batch_job(&guard, llama.addr, "/completion", body).await;
        assert_eq!(status().await["resume"], resume);
        let answered = post_streamed(guard.listen, "/v1/chat/completions", &[], &chat).await;
        assert_eq!(answered.status, 200);
        assert_eq!(job.await.expect("batch job").status, 200);
        assert_eq!(
            guard.metric("guard_preempted_total{class=\"batch\"}").await,
            stopped,
            "{resume}"
        );
    }
}

/// On Ollama's API (the emulator that follows its documented API: Ollama itself cannot be
/// installed here), there are no token ids: a preemptible class's chat goes on from its text,
/// and an `"exact-only"` class's is never stopped; `/status` says which.
#[tokio::test(flavor = "multi_thread")]
async fn on_ollama_a_preempted_chat_goes_on_from_its_text_or_is_never_stopped() {
    let _serial = serial().await;
    let ollama =
        guard_tests::servers::OllamaEmulator::start(&["--tokens", "40", "--token-delay-ms", "25"]);
    for (setting, stopped, kind) in [("\"exact-only\"", 0.0, "off"), ("true", 1.0, "text")] {
        let config = EXACT.replace("\"exact-only\"", setting);
        let guard = GuardProcess::start(ollama.addr, "ollama", &config);
        let job = {
            let (addr, body) = (guard.listen, ollama_chat("a long answer"));
            tokio::spawn(async move {
                post_streamed(addr, "/api/chat", &[("x-guard-class", "batch")], &body).await
            })
        };
        guard
            .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
            .await;
        let answered = post_streamed(guard.listen, "/api/chat", &[], &ollama_chat("hi")).await;
        assert_eq!(answered.status, 200);
        let job = job.await.expect("batch job");
        assert_eq!(job.status, 200);
        let text = guard.metrics_text().await;
        let m = |series: &str| guard_tests::metric(&text, series).unwrap_or(0.0);
        assert_eq!(
            m("guard_preempted_total{class=\"batch\"}"),
            stopped,
            "{setting}"
        );
        let resumes = format!("guard_preempt_resumes_total{{class=\"batch\",kind=\"{kind}\"}}");
        assert_eq!(m(&resumes), stopped, "{setting}");
        assert_eq!(
            m("guard_jobs_total{class=\"batch\",result=\"valid\"}"),
            1.0,
            "{setting}: the job is whole"
        );
        let status = guard.status().await;
        assert_eq!(status["preemption"]["batch"]["resume"], kind, "{status}");
    }
}
