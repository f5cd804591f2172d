//! The scripted upstream's side of one connection, over TCP or a pipe: HTTP/1.1 requests with
//! a Content-Length body, answered as their script says.

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

use super::{Link, Mode, Script, Upstream};

/// How a connection's serving ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Ending {
    Closed,
    /// The script asks that it break.
    Reset,
}

const SSE_HEAD: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

impl Upstream {
    /// Serves one connection's requests. A document (or a plain stream) keeps it open for the
    /// next request, as llama-server and Ollama do; after a stream ended with `[DONE]` it
    /// closes, as llama-server does, and after a hang, a reset or a flood.
    pub(super) async fn serve<R, W>(&self, reader: &mut R, writer: &mut W, link: Link) -> Ending
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        // What has come and is not yet read as a request.
        let mut seen = Vec::new();
        while let Some((head, script)) = read_request(reader, &mut seen).await {
            let Some(script) = script else {
                self.lock().bodiless.push(head);
                let answered = self.answer(u64::MAX, &Script::default(), writer).await;
                if answered.is_err() {
                    return Ending::Closed;
                }
                continue;
            };
            let index = self.begin(&link, head, &script);
            tokio::select! {
                biased;
                _ = self.answer(index, &script, writer) => {}
                () = closed(reader, &mut seen) => {}
            }
            self.end(index);
            match script.mode {
                Mode::Complete | Mode::Fail500 | Mode::Frames => {}
                Mode::Reset => return Ending::Reset,
                Mode::Stream | Mode::Hang | Mode::Flood => return Ending::Closed,
            }
        }
        Ending::Closed
    }

    /// Answers as `script` says; an error means the connection broke.
    async fn answer<W: AsyncWrite + Unpin>(
        &self,
        index: u64,
        script: &Script,
        writer: &mut W,
    ) -> std::io::Result<()> {
        if !script.head_delay().is_zero() {
            tokio::time::sleep(script.head_delay()).await;
        }
        match script.mode {
            Mode::Fail500 => {
                self.end(index);
                writer
                    .write_all(
                        document("500 Internal Server Error", "{\"error\":\"boom\"}").as_bytes(),
                    )
                    .await?;
            }
            Mode::Complete => {
                self.end(index);
                writer
                    .write_all(document("200 OK", "{\"content\":\"done\"}").as_bytes())
                    .await?;
            }
            _ => {
                writer.write_all(SSE_HEAD.as_bytes()).await?;
                self.wrote(index);
                self.frames(index, script, writer).await?;
            }
        }
        self.wrote(index);
        if script.mode == Mode::Hang {
            // Holds the connection open, sending nothing, until guard closes it.
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    /// The stream's frames, and its end where the mode has one.
    async fn frames<W: AsyncWrite + Unpin>(
        &self,
        index: u64,
        script: &Script,
        writer: &mut W,
    ) -> std::io::Result<()> {
        let (gap, endless) = (script.gap(), script.mode == Mode::Flood);
        let mut sent = 0;
        while endless || sent < script.frames {
            if !gap.is_zero() {
                tokio::time::sleep(gap).await;
            }
            let mut event = format!("data: {{\"i\":{sent}}}");
            if event.len() < script.bytes {
                event.push_str(&" ".repeat(script.bytes - event.len()));
            }
            event.push_str("\n\n");
            writer.write_all(chunk(&event).as_bytes()).await?;
            self.wrote(index);
            sent += 1;
        }
        let last = match script.mode {
            Mode::Stream => format!("{}0\r\n\r\n", chunk("data: [DONE]\n\n")),
            Mode::Frames => "0\r\n\r\n".to_owned(),
            _ => return Ok(()),
        };
        self.end(index);
        writer.write_all(last.as_bytes()).await
    }
}

/// A whole JSON answer.
fn document(status: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// One chunk of a chunked body.
fn chunk(data: &str) -> String {
    format!("{:x}\r\n{data}\r\n", data.len())
}

/// Waits until guard closes the connection. guard sends nothing while an answer runs but,
/// maybe, its close; a byte that comes all the same is kept for the next request.
async fn closed<R: AsyncRead + Unpin>(reader: &mut R, seen: &mut Vec<u8>) {
    let mut byte = [0u8; 1];
    match reader.read(&mut byte).await {
        Ok(0) | Err(_) => {}
        Ok(_) => {
            seen.push(byte[0]);
            std::future::pending().await
        }
    }
}

/// Reads one request (head and Content-Length body); its body is its script (None: no body).
/// None at the end of the connection or for a body that is no script.
async fn read_request<R: AsyncRead + Unpin>(
    reader: &mut R,
    seen: &mut Vec<u8>,
) -> Option<(String, Option<Script>)> {
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
                let request: Vec<u8> = seen.drain(..end + 4 + length).collect();
                let script = match length {
                    0 => None,
                    _ => Some(serde_json::from_slice(&request[end + 4..]).ok()?),
                };
                return Some((head, script));
            }
        }
        match reader.read(&mut buffer).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => seen.extend_from_slice(&buffer[..n]),
        }
    }
}
