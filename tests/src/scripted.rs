//! Clients of the scripted upstream (`guard_testkit::Upstream`) through guard: a script sent
//! and its whole answer read, a client that never reads, a client that leaves mid-answer.

use std::net::SocketAddr;

use guard_testkit::{Mode, Script, Upstream, until};
use tokio::{io::AsyncWriteExt as _, net::TcpStream};

use crate::http::{self, Leave};

/// The queued path the scripts are sent to.
pub const PATH: &str = "/v1/chat/completions";

/// Sends `script` to a queued endpoint at `addr` and reads the whole answer.
pub async fn post_script(addr: SocketAddr, script: &Script) -> http::Response {
    http::post(addr, PATH, &[], &script.json()).await
}

/// A client with a small receive buffer that asks for a flood and never reads it.
pub async fn stalled_reader(addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stream = socket.connect(addr).await.expect("connect");
    let flood = Script::new(Mode::Flood).sized(16 << 10).json();
    let request = http::request_bytes(PATH, &[], &flood);
    stream.write_all(request.as_bytes()).await.expect("send");
    stream
}

/// Sends a request through `guard` that `upstream` holds open, waits until the upstream has
/// it, then resets the client's connection: guard should reap the running request.
pub async fn hang_then_leave(upstream: &Upstream, guard: SocketAddr) {
    let before = upstream.open();
    let client = http::raw_request(guard, PATH, &[], &Script::new(Mode::Hang).json()).await;
    until("the upstream has the held request", async || {
        upstream.open() != before
    })
    .await;
    http::leave(client, Leave::Reset);
}
