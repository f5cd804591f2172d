//! `guard bench`: runs a fixed input set against a model N times and measures what the
//! logbook records.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use sha2::{Digest as _, Sha256};

use super::{
    LogbookError,
    entry::{Entry, InputSet, Maybe, Runs, Spread},
};
use guard::{
    config::Api,
    upstream::{
        api::{self, llama, ollama, openai},
        frames::{Events, StreamFormat},
    },
    watch::energy::{EnergyReader, POWERCAP_ROOT},
};

/// What `guard bench` was asked to do.
#[derive(Clone, Debug)]
pub struct Plan {
    pub command: String,
    pub url: String,
    pub api: Api,
    pub model: String,
    pub runtime: String,
    pub runtime_version: Option<String>,
    pub launch_flags: Option<String>,
    pub input: PathBuf,
    pub repetitions: usize,
    pub class: String,
    pub server_pid: Option<i32>,
    pub model_file: Option<PathBuf>,
    /// Restarts the server for a cold start where the API cannot unload a model.
    pub restart: Option<String>,
    pub max_tokens: u32,
    pub decision: String,
    pub owner: String,
    pub retest_days: u16,
}

/// One input of the set.
#[derive(Clone, Debug)]
pub struct Input {
    pub messages: serde_json::Value,
    pub expect: Option<regex::Regex>,
    pub expect_keys: Option<Vec<String>>,
}

/// One line of an input set, as written.
#[derive(serde::Deserialize)]
struct InputLine {
    prompt: Option<String>,
    messages: Option<Vec<serde_json::Value>>,
    expect: Option<String>,
    expect_json: Option<Vec<String>>,
}

/// Reads the input set: JSONL, each line `{"prompt": ...}` or `{"messages": [...]}`, with an
/// optional `"expect"` (a regular expression the answer must match) and `"expect_json"` (a
/// list of keys the answer, parsed as JSON, must have).
pub fn read_inputs(path: &Path) -> Result<(Vec<Input>, String), LogbookError> {
    let bytes = std::fs::read(path).map_err(|source| LogbookError::Io {
        path: path.to_owned(),
        source,
    })?;
    let digest = format!("{:x}", Sha256::digest(&bytes));
    let text = String::from_utf8_lossy(&bytes);
    let bad = |line: usize, reason: String| LogbookError::Input {
        path: path.to_owned(),
        line,
        reason,
    };
    let mut inputs = Vec::new();
    for (index, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let line: InputLine =
            serde_json::from_str(line).map_err(|e| bad(index + 1, e.to_string()))?;
        let messages = match (line.messages, line.prompt) {
            (Some(messages), _) => serde_json::Value::Array(messages),
            (None, Some(prompt)) => serde_json::json!([{ "role": "user", "content": prompt }]),
            (None, None) => {
                return Err(bad(
                    index + 1,
                    "needs \"prompt\" (a string) or \"messages\" (a list)".to_owned(),
                ));
            }
        };
        let expect = line
            .expect
            .map(|p| regex::Regex::new(&p).map_err(|e| bad(index + 1, format!("expect: {e}"))))
            .transpose()?;
        inputs.push(Input {
            messages,
            expect,
            expect_keys: line.expect_json,
        });
    }
    if inputs.is_empty() {
        return Err(bad(0, "no inputs".to_owned()));
    }
    Ok((inputs, digest))
}

/// One request's measurements.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    pub ttft: Duration,
    pub total: Duration,
    pub tokens: u64,
    pub text: String,
    pub queue_ms: f64,
}

/// Whether an answer misses its expectation (a quality failure) or says nothing (abstention).
pub fn judge(input: &Input, text: &str) -> (bool, bool) {
    let trimmed = text.trim();
    let lower = trimmed.to_lowercase();
    let abstained = trimmed.is_empty()
        || [
            "i can't",
            "i cannot",
            "i'm sorry",
            "i am unable",
            "as an ai",
        ]
        .iter()
        .any(|r| lower.starts_with(r));
    let pattern_failed = input
        .expect
        .as_ref()
        .is_some_and(|re| !re.is_match(trimmed));
    let shape_failed = input.expect_keys.as_ref().is_some_and(|keys| {
        let json = trimmed
            .find('{')
            .and_then(|at| serde_json::from_str::<serde_json::Value>(&trimmed[at..]).ok());
        !json.is_some_and(|j| keys.iter().all(|k| j.get(k).is_some()))
    });
    (pattern_failed || shape_failed, abstained)
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Sends one streaming chat and measures it.
async fn stream_once(
    client: &HttpClient,
    plan: &Plan,
    input: &Input,
) -> Result<Sample, LogbookError> {
    let (path, request) = chat_request(plan, input)?;
    let sent = Instant::now();
    let response = client
        .request(request)
        .await
        .map_err(|e| LogbookError::request(path, e))?;
    let status = response.status();
    let queue_ms = response
        .headers()
        .get("x-guard-queue-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(0.0);
    if !status.is_success() {
        let said = response
            .into_body()
            .collect()
            .await
            .map_err(|e| LogbookError::request(path, e))?
            .to_bytes();
        return Err(LogbookError::Answer {
            path: path.to_owned(),
            status,
            said: guard::quote::quote(&String::from_utf8_lossy(&said)),
        });
    }
    let mut sample = read_stream(plan.api, response.into_body(), sent)
        .await
        .map_err(|e| LogbookError::request(path, e))?;
    sample.queue_ms = queue_ms;
    Ok(sample)
}

/// The streaming chat request of the plan's API for one input, and its path.
fn chat_request(
    plan: &Plan,
    input: &Input,
) -> Result<(&'static str, http::Request<Full<Bytes>>), LogbookError> {
    let (path, body) = match plan.api {
        Api::Openai => (
            "/v1/chat/completions",
            serde_json::json!({ "model": plan.model, "messages": input.messages, "stream": true, "max_tokens": plan.max_tokens }),
        ),
        Api::Ollama => (
            "/api/chat",
            serde_json::json!({ "model": plan.model, "messages": input.messages, "stream": true, "options": { "num_predict": plan.max_tokens } }),
        ),
    };
    let request = http::Request::post(format!("{}{path}", plan.url.trim_end_matches('/')))
        .header("content-type", "application/json")
        .header("x-guard-class", &plan.class)
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| LogbookError::request(path, e))?;
    Ok((path, request))
}

/// Reads a streamed answer event by event: its text, its tokens, when its first text came.
async fn read_stream(
    api: Api,
    mut body: hyper::body::Incoming,
    sent: Instant,
) -> Result<Sample, hyper::Error> {
    let mut sample = Sample::default();
    let mut first = None;
    let mut events = Events::new(match api {
        Api::Openai => StreamFormat::Sse,
        Api::Ollama => StreamFormat::Ndjson,
    });
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        events.push(&data, |json| {
            let Some(piece) = token_text(api, json, &mut sample.tokens) else {
                return;
            };
            if !piece.is_empty() {
                first.get_or_insert_with(|| sent.elapsed());
                sample.text.push_str(&piece);
            }
        });
    }
    sample.total = sent.elapsed();
    sample.ttft = first.unwrap_or(sample.total);
    Ok(sample)
}

/// The text one stream event carries; counts tokens (one per content piece, or the server's
/// own count where it gives one at the end).
fn token_text(api: Api, json: &[u8], tokens: &mut u64) -> Option<String> {
    let (piece, counted) = match api {
        Api::Openai => {
            let chunk: openai::ChatChunk = api::parse(json)?;
            let counted = chunk.generated_tokens();
            (chunk.text().map(str::to_owned), counted)
        }
        Api::Ollama => {
            let chunk: ollama::Chunk = api::parse(json)?;
            (chunk.text().map(str::to_owned), chunk.eval_count)
        }
    };
    match counted {
        Some(n) => *tokens = n,
        None if piece.as_deref().is_some_and(|p| !p.is_empty()) => *tokens += 1,
        None => {}
    }
    piece
}

/// Samples peak RSS of the server, peak GPU memory and energy while the run goes on.
struct Meters {
    stop: Arc<AtomicBool>,
    peak_rss: Arc<AtomicU64>,
    /// Joules over the run, from guard's own energy reader (NVML, else RAPL).
    thread: Option<std::thread::JoinHandle<Option<f64>>>,
    gpu: bool,
    peak_gpu: Arc<AtomicU64>,
    started: Instant,
}

impl Meters {
    fn start(pid: Option<i32>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak_rss = Arc::new(AtomicU64::new(0));
        let peak_gpu = Arc::new(AtomicU64::new(0));
        let nvml = nvml_wrapper::Nvml::init().ok().map(Arc::new);
        let gpu = nvml.is_some();
        // Counts from here; read while the run goes on, so that no counter wraps unseen.
        let mut energy = EnergyReader::new(nvml.clone(), Path::new(POWERCAP_ROOT));
        let thread = {
            let (stop, peak_rss, peak_gpu) = (
                Arc::clone(&stop),
                Arc::clone(&peak_rss),
                Arc::clone(&peak_gpu),
            );
            std::thread::spawn(move || {
                let mut joules = None;
                loop {
                    if let Some(rss) = pid.and_then(rss_bytes) {
                        peak_rss.fetch_max(rss, Ordering::Relaxed);
                    }
                    if let Some(used) = nvml.as_deref().and_then(gpu_memory_used) {
                        peak_gpu.fetch_max(used, Ordering::Relaxed);
                    }
                    joules = energy.read().or(joules);
                    if stop.load(Ordering::Relaxed) {
                        return joules;
                    }
                    // A sampling period, not a wait for an event.
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        Self {
            stop,
            peak_rss,
            thread: Some(thread),
            gpu,
            peak_gpu,
            started: Instant::now(),
        }
    }

    /// (peak RSS, peak GPU memory, energy J, mean power W).
    fn finish(mut self) -> (Maybe, Maybe, Maybe, Maybe) {
        self.stop.store(true, Ordering::Relaxed);
        let joules = self
            .thread
            .take()
            .and_then(|thread| thread.join().ok())
            .flatten();
        let seconds = self.started.elapsed().as_secs_f64();
        let rss = self.peak_rss.load(Ordering::Relaxed);
        let rss = if rss > 0 {
            Maybe::Value(rss as f64)
        } else {
            Maybe::unavailable()
        };
        let gpu = if self.gpu {
            Maybe::Value(self.peak_gpu.load(Ordering::Relaxed) as f64)
        } else {
            Maybe::unavailable()
        };
        let energy = joules.map_or_else(Maybe::unavailable, Maybe::Value);
        let power = joules.map_or_else(Maybe::unavailable, |j| Maybe::Value(j / seconds.max(1e-3)));
        (rss, gpu, energy, power)
    }
}

fn rss_bytes(pid: i32) -> Option<u64> {
    let stat = procfs::process::Process::new(pid).ok()?.stat().ok()?;
    Some(stat.rss * procfs::page_size())
}

fn gpu_memory_used(nvml: &nvml_wrapper::Nvml) -> Option<u64> {
    let count = nvml.device_count().ok()?;
    (0..count)
        .map(|i| Some(nvml.device_by_index(i).ok()?.memory_info().ok()?.used))
        .sum()
}

/// Runs the plan and returns the entry (not yet appended).
pub async fn run(plan: &Plan) -> Result<Entry, LogbookError> {
    let (inputs, digest) = read_inputs(&plan.input)?;
    // A fresh connection per request: servers may close a connection after a stream, and a
    // reused dead one would fail the run.
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http();
    let server = Server::describe(&client, plan).await;
    let cold_start = cold_start(&client, plan, &inputs[0]).await?;
    let meters = Meters::start(server.pid);
    let measured = Measured::repeat(&client, plan, &inputs).await?;
    let metered = meters.finish();
    let input_set = InputSet {
        path: plan.input.display().to_string(),
        sha256: digest,
        inputs: inputs.len(),
    };
    Ok(entry(
        plan, server, input_set, cold_start, measured, metered,
    ))
}

/// What the server says of itself, read once before the run.
struct Server {
    pid: Option<i32>,
    runtime_version: Option<String>,
    launch_flags: String,
    model_digest: String,
}

impl Server {
    async fn describe(client: &HttpClient, plan: &Plan) -> Self {
        let pid = plan.server_pid.or_else(|| {
            let port = plan.url.parse::<http::Uri>().ok()?.port_u16()?;
            guard::watch::host::listening_pid(port)
        });
        let (runtime_version, server_model) = describe_server(client, plan).await;
        let launch_flags = plan
            .launch_flags
            .clone()
            .or_else(|| pid.and_then(command_line))
            .unwrap_or_else(|| "unknown".to_owned());
        let model_digest = model_digest(client, plan, server_model.as_deref()).await;
        Self {
            pid,
            runtime_version,
            launch_flags,
            model_digest,
        }
    }
}

/// The repeated requests' figures: one list a repetition, one value a request.
#[derive(Default)]
struct Measured {
    ttft: Vec<Vec<f64>>,
    completion: Vec<Vec<f64>>,
    rate: Vec<Vec<f64>>,
    queue: Vec<Vec<f64>>,
    failures: usize,
    abstentions: usize,
    /// The first request's TTFT, the model loaded.
    warm: Option<Duration>,
}

impl Measured {
    /// Sends every input, `plan.repetitions` times, with a progress bar.
    async fn repeat(
        client: &HttpClient,
        plan: &Plan,
        inputs: &[Input],
    ) -> Result<Self, LogbookError> {
        let progress = indicatif::ProgressBar::new((plan.repetitions * inputs.len()) as u64);
        progress.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {pos}/{len} {elapsed_precise}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        progress.set_message("guard bench");
        let mut measured = Self::default();
        for _ in 0..plan.repetitions {
            for list in [
                &mut measured.ttft,
                &mut measured.completion,
                &mut measured.rate,
                &mut measured.queue,
            ] {
                list.push(Vec::new());
            }
            for input in inputs {
                let sample = stream_once(client, plan, input).await?;
                measured.add(input, &sample);
                progress.inc(1);
            }
        }
        progress.finish_and_clear();
        Ok(measured)
    }

    /// One request's sample, into the current repetition's lists.
    fn add(&mut self, input: &Input, sample: &Sample) {
        self.warm.get_or_insert(sample.ttft);
        let (failed, abstained) = judge(input, &sample.text);
        self.failures += usize::from(failed);
        self.abstentions += usize::from(abstained);
        let last = |lists: &mut Vec<Vec<f64>>, value: f64| {
            if let Some(list) = lists.last_mut() {
                list.push(value);
            }
        };
        last(&mut self.ttft, ms(sample.ttft));
        last(&mut self.completion, ms(sample.total));
        let decode = (sample.total - sample.ttft).as_secs_f64();
        if decode > 0.0 && sample.tokens > 1 {
            last(&mut self.rate, (sample.tokens - 1) as f64 / decode);
        }
        last(&mut self.queue, sample.queue_ms);
    }
}

/// The logbook entry of a finished run.
fn entry(
    plan: &Plan,
    server: Server,
    input_set: InputSet,
    cold_start_ms: Maybe,
    measured: Measured,
    (peak_rss, peak_gpu, energy, power): (Maybe, Maybe, Maybe, Maybe),
) -> Entry {
    // Whole seconds: the entry's id and its listing need no more.
    let now = jiff::Timestamp::from_second(jiff::Timestamp::now().as_second())
        .unwrap_or_else(|_| jiff::Timestamp::now());
    let id = format!(
        "{:x}",
        Sha256::digest(format!("{now}{}{}", plan.command, std::process::id()))
    )[..12]
        .to_owned();
    Entry {
        id,
        recorded_at: now,
        command: plan.command.clone(),
        model: plan.model.clone(),
        model_digest: server.model_digest,
        runtime: plan.runtime.clone(),
        runtime_version: plan
            .runtime_version
            .clone()
            .or(server.runtime_version)
            .unwrap_or_else(|| "unknown".to_owned()),
        launch_flags: server.launch_flags,
        api: plan.api,
        url: plan.url.clone(),
        workload_class: plan.class.clone(),
        input_set,
        repetitions: plan.repetitions,
        cold_start_ms,
        warm_start_ms: measured.warm.map_or(0.0, ms),
        ttft_samples_ms: measured.ttft.iter().flatten().copied().collect(),
        ttft_ms: Spread::of(&measured.ttft),
        completion_ms: Spread::of(&measured.completion),
        decode_tokens_per_second: Spread::of(&measured.rate),
        queue_delay_ms: Spread::of(&measured.queue),
        runs: Runs {
            ttft_ms: measured.ttft,
            completion_ms: measured.completion,
            decode_tokens_per_second: measured.rate,
            queue_delay_ms: measured.queue,
        },
        peak_server_rss_bytes: peak_rss,
        peak_gpu_memory_bytes: peak_gpu,
        energy_joules: energy,
        mean_power_watts: power,
        quality_failures: measured.failures,
        abstentions: measured.abstentions,
        decision: plan.decision.clone(),
        owner: plan.owner.clone(),
        retest_date: super::date_after(now, plan.retest_days),
    }
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// The cold start: unload the model (Ollama: keep_alive 0) or restart the server, then time
/// the first request's TTFT.
async fn cold_start(
    client: &HttpClient,
    plan: &Plan,
    input: &Input,
) -> Result<Maybe, LogbookError> {
    match (plan.api, &plan.restart) {
        (_, Some(restart)) => {
            let status = std::process::Command::new("sh")
                .args(["-c", restart])
                .status();
            if !status.is_ok_and(|s| s.success()) {
                return Err(LogbookError::Restart {
                    command: restart.clone(),
                });
            }
            wait_ready(client, plan).await?;
        }
        (Api::Ollama, None) => {
            let unload = serde_json::json!({ "model": plan.model, "keep_alive": 0 });
            post_json(client, plan, "/api/generate", &unload).await?;
        }
        (Api::Openai, None) => return Ok(Maybe::unavailable()),
    }
    Ok(Maybe::Value(ms(stream_once(client, plan, input)
        .await?
        .ttft)))
}

async fn wait_ready(client: &HttpClient, plan: &Plan) -> Result<(), LogbookError> {
    let started = Instant::now();
    let health = match plan.api {
        Api::Openai => "/health",
        Api::Ollama => "/api/version",
    };
    const WAIT: Duration = Duration::from_secs(120);
    while started.elapsed() < WAIT {
        if get_json::<serde::de::IgnoredAny>(client, plan, health)
            .await
            .is_some()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(LogbookError::NotBack { waited: WAIT })
}

/// Posts `body` and waits for the whole answer, which only says the request is done.
async fn post_json(
    client: &HttpClient,
    plan: &Plan,
    path: &str,
    body: &serde_json::Value,
) -> Result<(), LogbookError> {
    let request = http::Request::post(format!("{}{path}", plan.url.trim_end_matches('/')))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| LogbookError::request(path, e))?;
    let response = client
        .request(request)
        .await
        .map_err(|e| LogbookError::request(path, e))?;
    response
        .into_body()
        .collect()
        .await
        .map_err(|e| LogbookError::request(path, e))?;
    Ok(())
}

async fn get_json<T: serde::de::DeserializeOwned>(
    client: &HttpClient,
    plan: &Plan,
    path: &str,
) -> Option<T> {
    let uri: http::Uri = format!("{}{path}", plan.url.trim_end_matches('/'))
        .parse()
        .ok()?;
    let response = client.get(uri).await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let bytes = response.into_body().collect().await.ok()?.to_bytes();
    api::parse(&bytes)
}

/// The server's version, and (llama-server) the model file it serves.
async fn describe_server(client: &HttpClient, plan: &Plan) -> (Option<String>, Option<String>) {
    match plan.api {
        Api::Ollama => {
            let version: Option<ollama::Version> = get_json(client, plan, "/api/version").await;
            (version.and_then(|v| v.version), None)
        }
        Api::Openai => {
            let props: llama::Props = get_json(client, plan, "/props").await.unwrap_or_default();
            (props.build_info, props.model_path)
        }
    }
}

/// The model's digest: Ollama's own, or the sha256 of the model file.
async fn model_digest(client: &HttpClient, plan: &Plan, server_model: Option<&str>) -> String {
    if plan.api == Api::Ollama
        && let Some(tags) = get_json::<ollama::Tags>(client, plan, "/api/tags").await
        && let Some(digest) = tags
            .models
            .into_iter()
            .find(|m| m.name == plan.model || m.model.as_deref() == Some(plan.model.as_str()))
            .and_then(|m| m.digest)
    {
        return digest;
    }
    let file = plan
        .model_file
        .clone()
        .or_else(|| server_model.map(PathBuf::from));
    file.and_then(|f| std::fs::read(f).ok()).map_or_else(
        || "unknown".to_owned(),
        |bytes| format!("sha256:{:x}", Sha256::digest(&bytes)),
    )
}

/// The server's exact command line, from /proc.
fn command_line(pid: i32) -> Option<String> {
    let args = procfs::process::Process::new(pid).ok()?.cmdline().ok()?;
    (!args.is_empty()).then(|| args.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(expect: Option<&str>, keys: Option<&[&str]>) -> Input {
        Input {
            messages: serde_json::json!([]),
            expect: expect.map(|e| regex::Regex::new(e).expect("regex")),
            expect_keys: keys.map(|k| k.iter().map(|s| (*s).to_owned()).collect()),
        }
    }

    #[test]
    fn answers_are_judged_against_their_expectations() {
        assert_eq!(
            judge(&input(Some("(?i)paris"), None), "It is Paris."),
            (false, false)
        );
        assert_eq!(
            judge(&input(Some("(?i)paris"), None), "It is Rome."),
            (true, false)
        );
        assert_eq!(
            judge(&input(None, Some(&["name"])), "Here: {\"name\": \"Ada\"}"),
            (false, false)
        );
        assert_eq!(
            judge(&input(None, Some(&["name"])), "{\"title\": 1}"),
            (true, false)
        );
        assert_eq!(judge(&input(None, None), "  "), (false, true));
        assert_eq!(
            judge(&input(None, None), "I'm sorry, I can't help."),
            (false, true)
        );
    }

    #[test]
    fn stream_lines_give_text_and_tokens() {
        let mut tokens = 0;
        let sse = StreamFormat::Sse;
        let line = b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}";
        let json = sse.payload(line).expect("a data event");
        assert_eq!(
            token_text(Api::Openai, json, &mut tokens).as_deref(),
            Some("Hi")
        );
        assert_eq!(sse.payload(b"data: [DONE]"), None);
        assert_eq!(tokens, 1);
        let last = b"{\"message\":{\"content\":\"\"},\"done\":true,\"eval_count\":12}";
        let _ = token_text(Api::Ollama, last, &mut tokens);
        assert_eq!(tokens, 12, "the server's own count wins");
    }

    #[test]
    fn the_input_set_is_read_and_hashed() {
        let dir = std::env::temp_dir().join(format!("guard-inputs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("set.jsonl");
        std::fs::write(&file, "{\"prompt\": \"a\", \"expect\": \"x\"}\n\n{\"messages\": [{\"role\":\"user\",\"content\":\"b\"}]}\n").expect("write");
        let (inputs, digest) = read_inputs(&file).expect("read");
        assert_eq!(inputs.len(), 2);
        assert_eq!(digest.len(), 64);
        std::fs::write(&file, "{\"text\": \"a\"}\n").expect("write");
        let err = read_inputs(&file).expect_err("no prompt");
        assert!(err.to_string().contains(":1:"), "{err}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
