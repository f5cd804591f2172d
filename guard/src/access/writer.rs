//! The access log's writer: a thread of its own behind a bounded channel, so that a slow or
//! full disk never delays a request. A line that cannot be queued or written is counted, not
//! waited for. `reopen` (SIGUSR1) opens the path anew, for logrotate.

use std::{
    fs::{File, OpenOptions},
    io::Write as _,
    os::unix::fs::OpenOptionsExt as _,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc::{self, RecvTimeoutError, SyncSender, TrySendError},
    },
    thread::JoinHandle,
    time::Duration,
};

use prometheus::IntCounter;

use super::Record;

/// Records waiting for the disk, at most.
const DEPTH: usize = 4_096;
/// How long the writer waits for a record before it looks for a reopen.
const IDLE: Duration = Duration::from_millis(200);
/// Lines written in one go, at most.
const BATCH: usize = 1_024;
/// After a write, the writer rests this long so that lines gather: one wake-up and one write
/// for many requests, not one each (a line waits at most this long for its file).
const GATHER: Duration = Duration::from_millis(10);

/// What the writer thread is sent.
#[expect(
    clippy::large_enum_variant,
    reason = "records move through the queue's slots, allocated once, not one box each"
)]
enum Message {
    Line(Record),
    /// Write what came before, then stop.
    Close,
}

/// Why the access log could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("cannot open the access log {}", path.display())]
pub struct OpenError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Where the lines go.
enum Sink {
    Stdout,
    File(PathBuf),
}

impl Sink {
    fn open(&self) -> std::io::Result<Box<dyn std::io::Write + Send>> {
        match self {
            Self::Stdout => Ok(Box::new(std::io::stdout())),
            Self::File(path) => Ok(Box::new(open_file(path)?)),
        }
    }
}

/// Appends; a file it creates is readable by its group (0640), whatever the umask (the unit's
/// is 0077). A file that exists keeps the mode its owner gave it.
fn open_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::PermissionsExt as _;
    let created = OpenOptions::new()
        .create_new(true)
        .append(true)
        .mode(0o640)
        .open(path);
    match created {
        Ok(file) => {
            file.set_permissions(std::fs::Permissions::from_mode(0o640))?;
            Ok(file)
        }
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
            OpenOptions::new().append(true).open(path)
        }
        Err(err) => Err(err),
    }
}

/// The request path's end of the access log; cheap to clone.
#[derive(Clone)]
pub struct AccessLog {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    sender: SyncSender<Message>,
    reopen: Arc<AtomicBool>,
    dropped: IntCounter,
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl AccessLog {
    /// No access log: `write` does nothing.
    pub fn off() -> Self {
        Self { inner: None }
    }

    /// Opens `path` (`-` for standard output) and starts the writer.
    pub fn open(path: &str, dropped: IntCounter) -> Result<Self, OpenError> {
        let sink = match path {
            "-" => Sink::Stdout,
            path => Sink::File(PathBuf::from(path)),
        };
        let out = sink.open().map_err(|source| OpenError {
            path: PathBuf::from(path),
            source,
        })?;
        let (sender, records) = mpsc::sync_channel(DEPTH);
        let reopen = Arc::new(AtomicBool::new(false));
        let writer = Writer {
            sink,
            out,
            reopen: Arc::clone(&reopen),
            dropped: dropped.clone(),
            batch: Vec::new(),
            text: Vec::new(),
            ends: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("guard-access-log".to_owned())
            .spawn(move || writer.run(&records))
            .map_err(|source| OpenError {
                path: PathBuf::from(path),
                source,
            })?;
        Ok(Self {
            inner: Some(Arc::new(Inner {
                sender,
                reopen,
                dropped,
                thread: std::sync::Mutex::new(Some(thread)),
            })),
        })
    }

    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// Queues one line; never waits. A full queue drops it, counted.
    pub fn write(&self, record: Record) {
        let Some(inner) = &self.inner else {
            return;
        };
        // Serialized by the writer: the request path only moves the record.
        match inner.sender.try_send(Message::Line(record)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => inner.dropped.inc(),
        }
    }

    /// Opens the path anew at the next line (after logrotate moved the file).
    pub fn reopen(&self) {
        if let Some(inner) = &self.inner {
            inner.reopen.store(true, Ordering::Release);
        }
    }

    /// Writes what is queued and stops the writer (at shutdown); clones write nothing after.
    pub fn close(&self) {
        let Some(inner) = &self.inner else {
            return;
        };
        let thread = inner
            .thread
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        // Queued behind every line already sent: the writer writes them, then stops.
        let _ = inner.sender.send(Message::Close);
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

/// The writer thread's state.
struct Writer {
    sink: Sink,
    out: Box<dyn std::io::Write + Send>,
    reopen: Arc<AtomicBool>,
    dropped: IntCounter,
    /// The batch's records, its text, and where each line ends in it: kept from batch to
    /// batch (a fresh buffer this large would be pages mapped and unmapped each time).
    batch: Vec<Record>,
    text: Vec<u8>,
    ends: Vec<usize>,
}

impl Writer {
    fn run(mut self, messages: &mpsc::Receiver<Message>) {
        loop {
            let first = match messages.recv_timeout(IDLE) {
                Ok(Message::Line(line)) => line,
                Ok(Message::Close) | Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => {
                    self.maybe_reopen();
                    continue;
                }
            };
            let mut batch = std::mem::take(&mut self.batch);
            batch.push(first);
            let mut close = false;
            while batch.len() < BATCH {
                match messages.try_recv() {
                    Ok(Message::Line(line)) => batch.push(line),
                    Ok(Message::Close) => {
                        close = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            self.maybe_reopen();
            self.write(&batch);
            batch.clear();
            self.batch = batch;
            if close {
                return;
            }
            std::thread::sleep(GATHER);
        }
    }

    /// Writes the batch with as few writes as the file takes; where one fails (a full disk),
    /// every line not wholly written is counted as dropped.
    fn write(&mut self, batch: &[Record]) {
        let Self { text, ends, .. } = self;
        text.clear();
        ends.clear();
        for record in batch {
            if serde_json::to_writer(&mut *text, record).is_ok() {
                text.push(b'\n');
                ends.push(text.len());
            } else {
                self.dropped.inc();
            }
        }
        let written = write_most(&mut self.out, &self.text);
        let whole = self.ends.iter().filter(|end| **end <= written).count();
        self.dropped.inc_by((self.ends.len() - whole) as u64);
        if self.out.flush().is_err() && whole == self.ends.len() {
            self.dropped.inc();
        }
    }

    fn maybe_reopen(&mut self) {
        if !self.reopen.swap(false, Ordering::AcqRel) {
            return;
        }
        match self.sink.open() {
            Ok(out) => self.out = out,
            Err(err) => {
                let error = crate::error_chain(&err);
                tracing::error!(%error, "cannot reopen the access log; writing on to the old file");
            }
        }
    }
}

/// Writes as much of `text` as the file takes; returns how much that was.
fn write_most(out: &mut dyn std::io::Write, text: &[u8]) -> usize {
    let mut written = 0;
    while written < text.len() {
        match out.write(&text[written..]) {
            Ok(0) => break,
            Ok(n) => written += n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    written
}
