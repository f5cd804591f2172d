//! Interactive never waits for batch: on the real llama-server with one slot, a flood of long
//! batch jobs (streamed and whole) is preempted for each interactive chat and goes on where it
//! stopped; every batch client gets its whole answer, in the form it asked for.

use std::time::{Duration, Instant};

use guard_tests::{
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

fn batch_body(prompt: &str, stream: bool) -> serde_json::Value {
    json!({
        "messages": [{ "role": "user", "content": prompt }],
        "max_tokens": 160,
        "temperature": 0,
        "stream": stream,
    })
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
    let body = json!({
        "messages": [{ "role": "user", "content": "Say hi." }],
        "max_tokens": 4,
        "stream": true,
    });
    let sent = Instant::now();
    let answer = post_streamed(addr, "/v1/chat/completions", &[], &body).await;
    assert_eq!(answer.status, 200);
    let first = answer.frames.first().expect("a frame").0;
    first.duration_since(sent)
}

fn p95(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[(samples.len() * 95).div_ceil(100) - 1]
}

#[tokio::test(flavor = "multi_thread")]
async fn interactive_preempts_batch_which_goes_on_where_it_stopped() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    // What each batch job answers when nothing interrupts it.
    let mut reference = Vec::new();
    for prompt in PROMPTS {
        let answer = post(
            llama.addr,
            "/v1/chat/completions",
            &[],
            &batch_body(prompt, false),
        )
        .await;
        reference.push(text_of(false, &answer.body));
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
            let bytes: Vec<u8> = answer.frames.iter().flat_map(|(_, b)| b.to_vec()).collect();
            (answer.status, stream, bytes)
        }));
    }
    guard
        .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
        .await;
    let mut busy = Vec::new();
    for _ in 0..8 {
        busy.push(interactive_ttft(guard.listen).await);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let busy_p95 = p95(busy.clone());
    let mut same = 0;
    for (n, job) in jobs.into_iter().enumerate() {
        let (status, stream, body) = job.await.expect("batch job");
        assert_eq!(status, 200, "job {n}");
        let text = text_of(stream, &body);
        assert!(!text.is_empty(), "job {n} has an answer");
        if text == reference[n] {
            same += 1;
        } else {
            eprintln!("job {n} differs:\n  {:?}\n  {:?}", reference[n], text);
        }
    }
    let preempted = guard.metric("guard_preempted_total{class=\"batch\"}").await;
    eprintln!(
        "idle p95 {idle_p95:?}, during the flood p95 {busy_p95:?} ({busy:?}); \
         {preempted} preemptions; {same} of {} answers as uninterrupted",
        PROMPTS.len()
    );
    assert!(preempted >= 1.0, "batch was preempted");
    assert!(
        busy_p95 <= idle_p95 + Duration::from_millis(150),
        "interactive p95 {busy_p95:?} against {idle_p95:?} idle"
    );
    assert!(
        same * 2 > PROMPTS.len(),
        "most resumed answers are the uninterrupted ones"
    );
}

/// guard's token counts are the server's own; a job the server stops halfway is not a job done.
#[tokio::test(flavor = "multi_thread")]
async fn tokens_are_the_servers_own_count_and_a_cut_job_is_invalid() {
    let _serial = serial().await;
    let mut llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", CONFIG);
    let before = llama.metric("tokens_predicted_total").await;
    let chat = |stream: bool, tokens: u64| {
        json!({
            "messages": [{ "role": "user", "content": "Tell me about the sea." }],
            "max_tokens": tokens,
            "stream": stream,
        })
    };
    let batch = [("x-guard-class", "batch")];
    assert_eq!(
        post(guard.listen, "/v1/chat/completions", &[], &chat(false, 7))
            .await
            .status,
        200
    );
    assert_eq!(
        post_streamed(guard.listen, "/v1/chat/completions", &[], &chat(true, 9))
            .await
            .status,
        200
    );
    let completion = json!({ "prompt": "The sea is", "n_predict": 11 });
    assert_eq!(
        post(guard.listen, "/completion", &[], &completion)
            .await
            .status,
        200
    );
    assert_eq!(
        post(
            guard.listen,
            "/v1/chat/completions",
            &batch,
            &chat(false, 5)
        )
        .await
        .status,
        200
    );
    assert_eq!(
        post_streamed(guard.listen, "/v1/chat/completions", &batch, &chat(true, 6))
            .await
            .status,
        200
    );
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
    let long = json!({
        "prompt": "Write a long story.",
        "n_predict": 2000,
        "ignore_eos": true,
        "stream": true,
    });
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
            let body = json!({ "prompt": "Count to ten:", "n_predict": 16, "ignore_eos": true });
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
    let prose = json!({ "prompt": "Once upon a time", "n_predict": 8, "ignore_eos": true });
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
    let status = guard_tests::http::get(guard.metrics, "/status")
        .await
        .expect("status")
        .json();
    assert_eq!(status["last_hour"]["batch"]["valid_jobs"], 2, "{status}");
    assert_eq!(status["last_hour"]["batch"]["invalid_jobs"], 2, "{status}");
    assert!(
        status["last_hour"]["batch"]["generated_tokens"]
            .as_u64()
            .unwrap_or(0)
            >= 16
    );
}
