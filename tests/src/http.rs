//! A small HTTP/1.1 client for tests, on hyper: whole responses, or streamed frames with the
//! time each arrived; and raw requests on sockets, for what hyper would not send or read.

use std::{net::SocketAddr, time::Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;

pub struct Response {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|err| panic!("not JSON ({err}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// One response streamed: its head, and each body frame with its arrival time.
pub struct Streamed {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub frames: Vec<(Instant, Bytes)>,
}

impl Streamed {
    /// The body's bytes, frame after frame.
    pub fn bytes(&self) -> Vec<u8> {
        self.frames.iter().flat_map(|(_, b)| b.to_vec()).collect()
    }

    /// The body's text, frame after frame.
    pub fn text(&self) -> String {
        self.frames
            .iter()
            .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
            .collect()
    }
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// The task driving a client connection; dropping it closes the socket, as a client that
/// goes away would.
pub struct ConnectionTask(tokio::task::JoinHandle<()>);

impl Drop for ConnectionTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn connect(addr: SocketAddr) -> Result<(Sender, ConnectionTask), String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    let task = tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok((sender, ConnectionTask(task)))
}

fn request(
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Request<Full<Bytes>> {
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "guard-test")
        .header("content-type", "application/json");
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(Full::new(body)).expect("request")
}

pub async fn get(addr: SocketAddr, path: &str) -> Result<Response, String> {
    send(addr, "GET", path, &[], Bytes::new()).await
}

pub async fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> Response {
    send(addr, "POST", path, headers, Bytes::from(body.to_string()))
        .await
        .unwrap_or_else(|err| panic!("POST {path}: {err}"))
}

pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Result<Response, String> {
    let (response, _sender, _connection) = open(addr, method, path, headers, body).await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// A response whose body is not read yet, with its connection (dropping it closes the socket).
type Opened = (
    hyper::Response<hyper::body::Incoming>,
    Sender,
    ConnectionTask,
);

/// Sends a request on a fresh connection and returns the response's head, its body unread.
async fn open(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Result<Opened, String> {
    let (mut sender, connection) = connect(addr).await?;
    let response = sender
        .send_request(request(method, path, headers, body))
        .await
        .map_err(|e| e.to_string())?;
    Ok((response, sender, connection))
}

/// Sends a POST on a fresh connection and returns its response head and body unread, with
/// the connection (dropping it closes the socket).
pub async fn open_post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> Result<Opened, String> {
    open(addr, "POST", path, headers, Bytes::from(body.to_string())).await
}

pub async fn post_streamed(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> Streamed {
    let (response, _sender, _connection) = open_post(addr, path, headers, body)
        .await
        .expect("response head");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let mut body = response.into_body();
    let mut frames = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("frame").into_data() {
            frames.push((Instant::now(), data));
        }
    }
    Streamed {
        status,
        headers,
        frames,
    }
}

/// How a raw client leaves.
#[derive(Clone, Copy, Debug)]
pub enum Leave {
    /// close(): the kernel sends FIN.
    Fin,
    /// SO_LINGER 0, then close(): the kernel sends RST.
    Reset,
}

/// A POST of `body` as bytes on the wire, with `headers` after its own.
pub fn request_bytes(path: &str, headers: &[(&str, &str)], body: &serde_json::Value) -> String {
    let body = body.to_string();
    format!("{}{body}", post_head(path, headers, body.len()))
}

fn post_head(path: &str, headers: &[(&str, &str)], length: usize) -> String {
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: guard-test\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    head
}

/// Sends one request on a fresh connection and returns the connection unread, so the test can
/// leave while the request waits or runs.
pub async fn raw_request(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt as _;
    let body = body.to_string();
    let head = post_head(path, headers, body.len());
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(head.as_bytes()).await.expect("send head");
    stream.write_all(body.as_bytes()).await.expect("send body");
    stream
}

/// Sends raw bytes on a fresh connection and reads until the server closes (or for 5 s).
pub async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(bytes).await.expect("send");
    let mut seen = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        stream.read_to_end(&mut seen),
    )
    .await;
    String::from_utf8_lossy(&seen).into_owned()
}

/// Reads `stream` until what came satisfies `done`; Err with what came if it ended first.
pub async fn read_until(
    stream: &mut tokio::net::TcpStream,
    done: impl Fn(&str) -> bool,
) -> Result<String, String> {
    use tokio::io::AsyncReadExt as _;
    let (mut seen, mut buffer) = (Vec::new(), [0u8; 4096]);
    loop {
        let text = String::from_utf8_lossy(&seen).into_owned();
        if done(&text) {
            return Ok(text);
        }
        match stream.read(&mut buffer).await.expect("read") {
            0 => return Err(text),
            n => seen.extend_from_slice(&buffer[..n]),
        }
    }
}

/// A kept-alive connection's answers, one at a time (answers to pipelined requests may
/// arrive in one read).
pub struct Answers {
    pub stream: tokio::net::TcpStream,
    pub seen: Vec<u8>,
}

impl Answers {
    pub async fn connect(addr: SocketAddr) -> Self {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        Self {
            stream,
            seen: Vec::new(),
        }
    }

    /// The next whole answer (a head and its Content-Length body).
    pub async fn next(&mut self) -> String {
        use tokio::io::AsyncReadExt as _;
        let mut buffer = [0u8; 4096];
        loop {
            if let Some(end) = self.whole() {
                let answer: Vec<u8> = self.seen.drain(..end).collect();
                return String::from_utf8_lossy(&answer).into_owned();
            }
            let n = self.stream.read(&mut buffer).await.expect("read");
            let text = String::from_utf8_lossy(&self.seen);
            assert!(n > 0, "the server closed a kept-alive connection: {text}");
            self.seen.extend_from_slice(&buffer[..n]);
        }
    }

    /// Where the first whole answer read so far ends.
    fn whole(&self) -> Option<usize> {
        let head_end = self.seen.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        let head = String::from_utf8_lossy(&self.seen[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:")?.trim().parse().ok())
            .unwrap_or(0);
        (self.seen.len() >= head_end + length).then_some(head_end + length)
    }
}

/// Sends the start of a second, pipelined request behind the one `stream` carries. hyper reads
/// those bytes and then stops looking for the client's close while the first request waits, so
/// only guard's own detector (the kernel event or the user-space watcher) can see it leave.
pub async fn start_pipelined_request(stream: &mut tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt as _;
    stream
        .write_all(b"GET /api/tags HTTP/1.1\r\n")
        .await
        .expect("send the pipelined start");
}

/// Leaves: closes the connection with a FIN or a reset; returns CLOCK_MONOTONIC right after.
pub fn leave<S: std::os::fd::AsFd>(stream: S, how: Leave) -> std::time::Duration {
    if let Leave::Reset = how {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::Linger, &linger)
            .expect("SO_LINGER");
    }
    drop(stream);
    guard::reap::event::monotonic_now()
}

/// Sends a request, reads the first `frames` body frames, then leaves (closes the connection).
pub async fn post_frames(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
    frames: usize,
) -> Result<u16, String> {
    let (response, sender, connection) = open_post(addr, path, headers, body).await?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    for _ in 0..frames {
        if body.frame().await.is_none() {
            break;
        }
    }
    drop((body, sender, connection));
    Ok(status)
}

/// A raw upstream that answers every GET at once with `{}` and never answers anything else
/// (a queued request sent to it holds its slot).
pub async fn empty_json_on_get() -> SocketAddr {
    scripted_upstream(|head| {
        head.starts_with(b"GET ").then(|| {
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
                .to_vec()
        })
    })
    .await
}

/// A raw HTTP/1.1 upstream on loopback, for answers hyper would not write (a header's own
/// spelling) or never writes (none at all): each request head on a connection gets
/// `answer(head)` as bytes, or, for None, no answer ever (the connection is held).
pub async fn scripted_upstream(
    answer: impl Fn(&[u8]) -> Option<Vec<u8>> + Send + Sync + 'static,
) -> SocketAddr {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answer = std::sync::Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let answer = std::sync::Arc::clone(&answer);
            tokio::spawn(async move {
                let (mut head, mut buf) = (Vec::new(), [0u8; 4096]);
                while let Ok(n @ 1..) = stream.read(&mut buf).await {
                    head.extend_from_slice(&buf[..n]);
                    while let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                        let Some(bytes) = answer(&head[..end]) else {
                            std::future::pending::<()>().await;
                            return;
                        };
                        head.drain(..end + 4);
                        if stream.write_all(&bytes).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}
