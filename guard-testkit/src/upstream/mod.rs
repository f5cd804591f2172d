//! A scripted upstream: a server that plays what each request's body asks for (a document, a
//! stream, a hang, a reset, a 500, a flood) and records, from its own side, how many exchanges
//! it has in flight at once and when each began and last wrote. guard's process reaches it on
//! loopback TCP; a proxy inside the test's own process (under tokio's paused clock) reaches it
//! through in-memory pipes.
//!
//! An exchange is in flight from its request's last byte until its answer's last byte is
//! handed on (counted just before: guard may read it and send the next request on the same
//! kept-alive connection before this task runs again) or the connection is seen closed. When
//! a request arrives, the server first looks at every open exchange's connection, its own
//! included, so a close that guard made before sending it is counted before it: the peak is
//! what guard really had open.

mod pipe;
mod script;
mod serve;

use std::{
    collections::HashMap,
    net::SocketAddr,
    os::fd::{AsRawFd as _, RawFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use tokio::{
    net::{TcpListener, TcpStream},
    time::Instant,
};

pub use pipe::Pipe;
pub use script::{Mode, Script};

/// One exchange as the server saw it.
#[derive(Clone, Debug)]
pub struct Exchange {
    /// The script's own tag.
    pub id: u64,
    /// The request line and headers as they arrived.
    pub head: String,
    pub mode: Mode,
    pub started: Instant,
    pub last_write: Option<Instant>,
    pub ended: Option<Instant>,
}

/// The server; its tasks stop with the runtime that runs them.
#[derive(Clone)]
pub struct Upstream {
    record: Arc<Mutex<Record>>,
    /// Where it listens; None for one reached through pipes only.
    addr: Option<SocketAddr>,
}

#[derive(Default)]
struct Record {
    /// Open exchanges: their index in `exchanges` -> their connection.
    open: HashMap<u64, Link>,
    peak: usize,
    exchanges: Vec<Exchange>,
    /// Heads of requests without a body (guard's watchers, pass-through GETs): answered,
    /// never counted as exchanges.
    bodiless: Vec<String>,
    /// Connections open now, and ever.
    connections: usize,
    dials: usize,
}

/// One connection, as far as telling whether guard has closed it.
#[derive(Clone)]
enum Link {
    /// A socket of this server's.
    Tcp(RawFd),
    /// A pipe: set when guard drops its end.
    Pipe(Arc<AtomicBool>),
}

impl Link {
    fn closed(&self) -> bool {
        match self {
            Self::Tcp(fd) => peer_closed(*fd),
            Self::Pipe(closed) => closed.load(Ordering::SeqCst),
        }
    }
}

impl Upstream {
    /// One on loopback TCP.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let upstream = Self {
            record: Arc::default(),
            addr: Some(addr),
        };
        let server = upstream.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(server.clone().serve_tcp(stream));
            }
        });
        upstream
    }

    /// One reached only through [`Upstream::connect`].
    pub fn in_memory() -> Self {
        Self {
            record: Arc::default(),
            addr: None,
        }
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr.expect("an in-memory upstream has no address")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.record
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

    /// Starts counting the peak afresh from what is open now.
    pub fn reset_peak(&self) {
        let mut record = self.lock();
        record.peak = record.open.len();
    }

    /// Requests with a body, in the order they came.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.lock().exchanges.clone()
    }

    /// How many requests with a body have come.
    pub fn started(&self) -> usize {
        self.lock().exchanges.len()
    }

    /// The heads of every request, with a body or without.
    pub fn heads(&self) -> Vec<String> {
        let record = self.lock();
        let bodied = record.exchanges.iter().map(|e| e.head.clone());
        bodied.chain(record.bodiless.iter().cloned()).collect()
    }

    /// Connections open now (idle ones included).
    pub fn connections(&self) -> usize {
        self.lock().connections
    }

    /// Connections opened in all.
    pub fn dials(&self) -> usize {
        self.lock().dials
    }

    async fn serve_tcp(self, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        let link = Link::Tcp(stream.as_raw_fd());
        self.dialed();
        let (mut reader, mut writer) = stream.into_split();
        if self.serve(&mut reader, &mut writer, link).await == serve::Ending::Reset {
            reset_on_close(reader.as_ref());
        }
        self.hung_up();
    }

    fn dialed(&self) {
        let mut record = self.lock();
        record.connections += 1;
        record.dials += 1;
    }

    fn hung_up(&self) {
        self.lock().connections -= 1;
    }

    fn begin(&self, link: &Link, head: String, script: &Script) -> u64 {
        let mut record = self.lock();
        let index = record.exchanges.len() as u64;
        record.open.insert(index, link.clone());
        // Closes guard made before this request came are counted first, this exchange's own
        // too: a request read late, behind the close guard sent after it (its permit already
        // given to a request begun here before it), was never open beside that one.
        forget_closed(&mut record);
        record.peak = record.peak.max(record.open.len());
        record.exchanges.push(Exchange {
            id: script.id,
            head,
            mode: script.mode,
            started: Instant::now(),
            last_write: None,
            ended: None,
        });
        index
    }

    fn wrote(&self, index: u64) {
        if let Some(exchange) = self.lock().exchanges.get_mut(index as usize) {
            exchange.last_write = Some(Instant::now());
        }
    }

    fn end(&self, index: u64) {
        let mut record = self.lock();
        record.open.remove(&index);
        if let Some(exchange) = record.exchanges.get_mut(index as usize)
            && exchange.ended.is_none()
        {
            exchange.ended = Some(Instant::now());
        }
    }
}

/// Drops the open exchanges whose connection guard has closed.
fn forget_closed(record: &mut Record) {
    record.open.retain(|_, link| !link.closed());
}

/// SO_LINGER 0: the close that follows is a reset.
fn reset_on_close(socket: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let _ = nix::sys::socket::setsockopt(socket, nix::sys::socket::sockopt::Linger, &linger);
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
