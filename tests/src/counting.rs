//! A counting upstream: a real TCP server that plays what each request's body asks for
//! (a completion, a stream, a hang, a reset, a 500, a flood) and records, from its own side,
//! how many exchanges it has in flight at once and when each began and last wrote.
//!
//! An exchange is in flight from its request's last byte until its answer's last byte is
//! handed to the kernel (counted just before: guard may read it and send the next request
//! on the same kept-alive connection before this task runs again) or the connection is seen
//! closed. When a request arrives, the server first looks at every open exchange's socket,
//! its own included (a non-blocking peek), so a close that guard made before sending it is
//! counted before it: the peak is what guard really had open.

use std::{
    collections::HashMap,
    net::SocketAddr,
    os::fd::{AsRawFd as _, RawFd},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde::Deserialize;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream, tcp::OwnedReadHalf},
};

/// What one request asks the server to do, as its JSON body.
#[derive(Clone, Debug, Default, serde::Serialize, Deserialize)]
#[serde(default)]
pub struct Play {
    /// complete | stream | hang | reset | fail500 | flood
    pub mode: String,
    pub frames: u64,
    pub gap_ms: u64,
    /// Bytes per frame (flood).
    pub bytes: usize,
    /// The client's own tag for the request: the server sees each at most once.
    pub id: u64,
}

/// One exchange as the server saw it.
#[derive(Clone, Debug)]
pub struct Exchange {
    pub id: u64,
    /// The request line and headers as they arrived.
    pub head: String,
    pub mode: String,
    pub started: Instant,
    pub last_write: Option<Instant>,
    pub ended: Option<Instant>,
}

#[derive(Default)]
struct State {
    /// Open exchanges: id -> the socket's fd, for the peek.
    open: HashMap<u64, RawFd>,
    peak: usize,
    exchanges: Vec<Exchange>,
    /// Heads of requests without a body (guard's watchers, pass-through GETs): answered,
    /// never counted as exchanges.
    bodiless: Vec<String>,
}

/// The server; stops with the runtime that runs it.
#[derive(Clone)]
pub struct Counting {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

impl Play {
    pub fn new(mode: &str) -> Self {
        Self {
            mode: mode.to_owned(),
            ..Self::default()
        }
    }

    pub fn frames(mut self, frames: u64, gap_ms: u64) -> Self {
        self.frames = frames;
        self.gap_ms = gap_ms;
        self
    }

    pub fn bytes(mut self, bytes: usize) -> Self {
        self.bytes = bytes;
        self
    }

    pub fn id(mut self, id: u64) -> Self {
        self.id = id;
        self
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a play is JSON")
    }
}

/// Sends `play` to a queued endpoint at `addr` and reads the whole answer.
pub async fn post_play(addr: SocketAddr, play: &Play) -> crate::http::Response {
    crate::http::post(addr, "/v1/chat/completions", &[], &play.json()).await
}

/// A client with a small receive buffer that asks for a flood and never reads it.
pub async fn stalled_reader(addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stream = socket.connect(addr).await.expect("connect");
    let body = Play::new("flood").bytes(16 << 10).json().to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: guard\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("send");
    stream
}

impl Counting {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let counting = Self {
            addr,
            state: Arc::default(),
        };
        let server = counting.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(server.clone().serve(stream));
            }
        });
        counting
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The most exchanges in flight at once since the start or the last reset.
    pub fn peak(&self) -> usize {
        self.lock().peak
    }

    /// Exchanges in flight now.
    pub fn open(&self) -> usize {
        self.lock().open.len()
    }

    /// Sends a request through `guard` that this server holds open, waits until the server
    /// has it, then resets the client's connection: guard should reap the running request.
    pub async fn hang_then_leave(&self, guard: SocketAddr) {
        let before = self.open();
        let client = crate::http::raw_request(
            guard,
            "/v1/chat/completions",
            &[],
            &Play::new("hang").json(),
        )
        .await;
        while self.open() == before {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        crate::http::leave(client, crate::http::Leave::Reset);
    }

    /// Starts counting the peak afresh from what is open now.
    pub fn reset_peak(&self) {
        let mut state = self.lock();
        state.peak = state.open.len();
    }

    /// Requests with a body, in the order they came.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.lock().exchanges.clone()
    }

    /// The heads of every request, with a body or without.
    pub fn heads(&self) -> Vec<String> {
        let state = self.lock();
        let bodied = state.exchanges.iter().map(|e| e.head.clone());
        bodied.chain(state.bodiless.iter().cloned()).collect()
    }

    /// Serves one connection: one request (guard opens one connection per queued request).
    /// Serves one connection: a single document keeps it open for the next request, as
    /// llama-server and Ollama do; after a stream it closes, as llama-server does.
    async fn serve(self, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        let fd = stream.as_raw_fd();
        let (mut reader, mut writer) = stream.into_split();
        while let Some((head, play)) = read_request(&mut reader).await {
            let Some(play) = play else {
                self.lock().bodiless.push(head);
                if self
                    .play(u64::MAX, &Play::new("complete"), &mut writer)
                    .await
                    .is_err()
                {
                    return;
                }
                continue;
            };
            let id = self.begin(fd, head, &play);
            let watch = async {
                // guard sends nothing while an answer runs but, maybe, its close.
                let mut byte = [0u8; 1];
                match reader.peek(&mut byte).await {
                    Ok(0) | Err(_) => {}
                    Ok(_) => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = self.play(id, &play, &mut writer) => {}
                () = watch => {}
            }
            self.end(id);
            if !matches!(play.mode.as_str(), "complete" | "fail500") {
                if play.mode == "reset" {
                    reset_on_close(&reader);
                }
                return;
            }
        }
    }

    fn begin(&self, fd: RawFd, head: String, play: &Play) -> u64 {
        let mut state = self.lock();
        let id = state.exchanges.len() as u64;
        state.open.insert(id, fd);
        // Closes guard made before this request came are counted first, this exchange's own
        // too: a request read late, behind the close guard sent after it (its permit already
        // given to a request begun here before it), was never open beside that one.
        state.open.retain(|_, open| !peer_closed(*open));
        state.peak = state.peak.max(state.open.len());
        state.exchanges.push(Exchange {
            id: play.id,
            head,
            mode: play.mode.clone(),
            started: Instant::now(),
            last_write: None,
            ended: None,
        });
        id
    }

    fn wrote(&self, id: u64) {
        if let Some(exchange) = self.lock().exchanges.get_mut(id as usize) {
            exchange.last_write = Some(Instant::now());
        }
    }

    fn end(&self, id: u64) {
        let mut state = self.lock();
        state.open.remove(&id);
        if let Some(exchange) = state.exchanges.get_mut(id as usize)
            && exchange.ended.is_none()
        {
            exchange.ended = Some(Instant::now());
        }
    }

    /// Answers as `play` says; an error means the connection broke.
    async fn play(
        &self,
        id: u64,
        play: &Play,
        writer: &mut tokio::net::tcp::OwnedWriteHalf,
    ) -> std::io::Result<()> {
        let gap = Duration::from_millis(play.gap_ms);
        let sse = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        let result: std::io::Result<()> = async {
            match play.mode.as_str() {
                "fail500" => {
                    let body = "{\"error\":\"boom\"}";
                    let head = format!("HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
                    self.end(id);
                    writer.write_all(head.as_bytes()).await?;
                }
                "complete" => {
                    tokio::time::sleep(gap).await;
                    let body = "{\"content\":\"done\"}";
                    let head = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
                    self.end(id);
                    writer.write_all(head.as_bytes()).await?;
                }
                _ => {
                    writer.write_all(sse.as_bytes()).await?;
                    self.wrote(id);
                    self.frames(id, play, gap, writer).await?;
                }
            }
            self.wrote(id);
            Ok(())
        }
        .await;
        if result.is_ok() && play.mode == "hang" {
            // Holds the connection open, sending nothing, until guard closes it.
            std::future::pending::<()>().await;
        }
        result
    }

    /// The stream's frames, and its end where the mode has one.
    async fn frames(
        &self,
        id: u64,
        play: &Play,
        gap: Duration,
        writer: &mut tokio::net::tcp::OwnedWriteHalf,
    ) -> std::io::Result<()> {
        let flood = play.mode == "flood";
        let mut index = 0;
        while flood || index < play.frames {
            if !gap.is_zero() {
                tokio::time::sleep(gap).await;
            }
            let mut event = format!("data: {{\"i\":{index}}}");
            if event.len() < play.bytes {
                event.push_str(&" ".repeat(play.bytes - event.len()));
            }
            event.push_str("\n\n");
            let chunk = format!("{:x}\r\n{event}\r\n", event.len());
            writer.write_all(chunk.as_bytes()).await?;
            self.wrote(id);
            index += 1;
        }
        if play.mode == "stream" {
            let done = "data: [DONE]\n\n";
            let last = format!("{:x}\r\n{done}\r\n0\r\n\r\n", done.len());
            self.end(id);
            writer.write_all(last.as_bytes()).await?;
        }
        Ok(())
    }
}

/// SO_LINGER 0: the close that follows is a reset.
fn reset_on_close(reader: &OwnedReadHalf) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let _ =
        nix::sys::socket::setsockopt(reader.as_ref(), nix::sys::socket::sockopt::Linger, &linger);
}

/// Whether the peer of `fd` has closed: a non-blocking peek reads end of file or an error.
fn peer_closed(fd: RawFd) -> bool {
    let mut byte = [0u8; 1];
    // SAFETY: `fd` is an open socket of this server (an exchange removes its entry before its
    // stream closes, under the same lock), and the buffer is valid for one byte.
    let read = unsafe {
        libc::recv(
            fd,
            byte.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match read {
        0 => true,
        n if n > 0 => false,
        _ => std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// Reads one request (head and Content-Length body); its body is the play (None: no body).
async fn read_request(reader: &mut OwnedReadHalf) -> Option<(String, Option<Play>)> {
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&seen[..end]).into_owned();
            let length: usize = head
                .to_ascii_lowercase()
                .lines()
                .find_map(|line| line.strip_prefix("content-length:"))
                .and_then(|value| value.trim().parse().ok())
                .unwrap_or(0);
            if seen.len() >= end + 4 + length {
                let body = &seen[end + 4..end + 4 + length];
                let play = match length {
                    0 => None,
                    _ => Some(serde_json::from_slice(body).ok()?),
                };
                return Some((head, play));
            }
        }
        match reader.read(&mut buffer).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => seen.extend_from_slice(&buffer[..n]),
        }
    }
}
