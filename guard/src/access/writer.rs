//! The access log's writer. A request's line is serialized by the thread that concluded it,
//! into that thread's buffer (one a serving thread, one for every other thread, padded
//! apart); a thread of the log's own takes the buffers every 50 ms and writes them, so that a
//! slow or full disk never delays a request, and no line crosses threads as a record. A line
//! that finds its buffer full, or cannot be written, is counted, not waited for. `reopen`
//! (SIGUSR1) opens the path anew, for logrotate.

use std::{
    fs::{File, OpenOptions},
    os::unix::fs::OpenOptionsExt as _,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    thread::{JoinHandle, Thread},
    time::Duration,
};

use prometheus::IntCounter;

use super::{Record, line::LineWriter};

/// Bytes of lines a buffer holds for the disk, at most: about 2,000 lines, 40,000 a second
/// from one thread at GATHER (twice this while its last lines are written).
const BUFFER_BYTES: usize = 512 << 10;
/// A buffer written out keeps its room up to twice the lines it held, or this much: the next
/// gathering of as many lines finds its room ready (no regrowth, no fresh pages each time),
/// and a burst does not hold its memory for the life of the process.
const KEPT_BYTES: usize = 16 << 10;
/// The room after a line that is fetched for the lines to come: about two of them.
const PREFETCH_BYTES: usize = 512;
/// How long the writer rests when it found nothing, unless a line wakes it.
const IDLE: Duration = Duration::from_millis(200);
/// After a write, the writer rests this long so that lines gather: one wake-up and one write
/// a buffer for many requests, not one each (a line waits at most this long for its file).
const GATHER: Duration = Duration::from_millis(50);

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

/// Lines serialized and not yet taken by the writer.
#[derive(Default)]
struct Pending {
    text: Vec<u8>,
    line: LineWriter,
    /// The writer has taken its last: a line now is dropped (counted), not left unwritten.
    closed: bool,
}

/// One buffer, on a cache line of its own: two threads' buffers never share one.
#[repr(align(128))]
#[derive(Default)]
struct Buffer(Mutex<Pending>);

impl Buffer {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        // A panic while a line was appended leaves at worst a torn line; the log goes on.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the request path and the writer thread share.
struct Lines {
    buffers: Box<[Buffer]>,
    /// The writer rests with nothing to write: the first line into an empty buffer wakes it.
    idle: AtomicBool,
    closing: AtomicBool,
    reopen: AtomicBool,
    dropped: IntCounter,
}

impl Lines {
    fn new(dropped: IntCounter) -> Self {
        // A buffer a serving thread, and the last for every other thread.
        let count = guard_net::workers::per_cpu_count() + 1;
        Self {
            buffers: (0..count).map(|_| Buffer::default()).collect(),
            idle: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            reopen: AtomicBool::new(false),
            dropped,
        }
    }

    /// The buffer of the calling thread: its serving thread's, else the last.
    fn own_buffer(&self) -> usize {
        let last = self.buffers.len() - 1;
        guard_net::workers::current().map_or(last, |index| index.min(last))
    }

    /// Serializes `record` into buffer `at`; true where it is the buffer's first line and the
    /// writer rests (the caller wakes it).
    fn append(&self, at: usize, record: &Record<'_>) -> bool {
        let mut pending = self.buffers[at].lock();
        let Pending { text, line, closed } = &mut *pending;
        let start = text.len();
        if *closed || start >= BUFFER_BYTES {
            drop(pending);
            self.dropped.inc();
            return false;
        }
        line.write(record, text);
        text.push(b'\n');
        // The buffer's room was last read by the writer, on another CPU, and releasing the
        // lock waits until every store into it has its cache line here: fetched now, the
        // lines the next records go to are here by the time they come (measured: about a
        // seventh of what the log costs a pass-through request).
        guard_sys::cache::prefetch(text.spare_capacity_mut(), PREFETCH_BYTES);
        drop(pending);
        // The buffer's lock orders this after the writer's `idle` store where it looked at
        // this buffer before the line came: either it saw the line or this sees it resting.
        start == 0 && self.idle.load(Ordering::Relaxed) && self.idle.swap(false, Ordering::AcqRel)
    }

    fn is_empty(&self) -> bool {
        self.buffers
            .iter()
            .all(|buffer| buffer.lock().text.is_empty())
    }
}

/// The request path's end of the access log; cheap to clone.
#[derive(Clone)]
pub struct AccessLog {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    lines: Arc<Lines>,
    writer: Thread,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// A handle for each buffer, handed to the lines its threads write later.
    held: Box<[LaterLine]>,
}

/// A buffer's end of the log, kept by a request whose line is written when it ends (a
/// pass-through answer's body): each buffer's handle counts its own holders, so that serving
/// threads do not bounce one shared count between their caches twice a request.
#[derive(Clone)]
pub struct LaterLine(Arc<Held>);

/// On a cache line of its own, like the buffers: its count is its threads' alone.
#[repr(align(128))]
struct Held {
    lines: Arc<Lines>,
    at: usize,
    writer: Thread,
}

impl LaterLine {
    /// Adds the request's line, as `AccessLog::write`.
    pub fn write(&self, record: &Record<'_>) {
        let Held { lines, at, writer } = &*self.0;
        if lines.append(*at, record) {
            writer.unpark();
        }
    }
}

impl Drop for Inner {
    /// The last handle gone: the writer writes what is left and stops.
    fn drop(&mut self) {
        self.lines.closing.store(true, Ordering::Release);
        self.writer.unpark();
    }
}

impl AccessLog {
    /// No access log: `write` does nothing.
    pub fn off() -> Self {
        Self { inner: None }
    }

    /// Opens `path` (`-` for standard output) and starts the writer.
    pub fn open(path: &str, dropped: IntCounter) -> Result<Self, OpenError> {
        let error = |source| OpenError {
            path: PathBuf::from(path),
            source,
        };
        let sink = match path {
            "-" => Sink::Stdout,
            path => Sink::File(PathBuf::from(path)),
        };
        let out = sink.open().map_err(error)?;
        let lines = Arc::new(Lines::new(dropped));
        let writer = Writer {
            sink,
            out,
            spare: lines.buffers.iter().map(|_| Vec::new()).collect(),
            lines: Arc::clone(&lines),
        };
        let thread = std::thread::Builder::new()
            .name("guard-access-log".to_owned())
            .spawn(move || writer.run())
            .map_err(error)?;
        let writer = thread.thread().clone();
        let held = (0..lines.buffers.len())
            .map(|at| {
                LaterLine(Arc::new(Held {
                    lines: Arc::clone(&lines),
                    at,
                    writer: writer.clone(),
                }))
            })
            .collect();
        Ok(Self {
            inner: Some(Arc::new(Inner {
                lines,
                writer,
                thread: Mutex::new(Some(thread)),
                held,
            })),
        })
    }

    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// A handle for a line this thread writes later; None where the log is off.
    pub fn later(&self) -> Option<LaterLine> {
        let inner = self.inner.as_ref()?;
        Some(inner.held[inner.lines.own_buffer()].clone())
    }

    /// Adds the request's line; never waits for the disk. A full buffer drops it, counted.
    pub fn write(&self, record: &Record<'_>) {
        if let Some(inner) = &self.inner {
            inner.held[inner.lines.own_buffer()].write(record);
        }
    }

    /// Opens the path anew before the next write (after logrotate moved the file).
    pub fn reopen(&self) {
        if let Some(inner) = &self.inner {
            inner.lines.reopen.store(true, Ordering::Release);
            inner.writer.unpark();
        }
    }

    /// Writes every line added so far and stops the writer (at shutdown); a line added after
    /// is counted as dropped.
    pub fn close(&self) {
        let Some(inner) = &self.inner else {
            return;
        };
        let thread = inner
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        inner.lines.closing.store(true, Ordering::Release);
        inner.writer.unpark();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

/// The writer thread's state.
struct Writer {
    sink: Sink,
    out: Box<dyn std::io::Write + Send>,
    lines: Arc<Lines>,
    /// A buffer for each of `lines.buffers`, swapped with it: lines gather in one while the
    /// other is written, and neither is allocated anew.
    spare: Vec<Vec<u8>>,
}

impl Writer {
    fn run(mut self) {
        loop {
            let closing = self.lines.closing.load(Ordering::Acquire);
            self.maybe_reopen();
            let wrote = self.write_all_taken(closing);
            if closing {
                return;
            }
            if wrote {
                self.gather();
            } else {
                self.rest();
            }
        }
    }

    /// Takes each buffer's lines and writes them; true where there were any. `last`: every
    /// buffer is closed as it is taken.
    fn write_all_taken(&mut self, last: bool) -> bool {
        let mut wrote = false;
        for (buffer, spare) in self.lines.buffers.iter().zip(&mut self.spare) {
            {
                let mut pending = buffer.lock();
                std::mem::swap(&mut pending.text, spare);
                pending.closed = last;
            }
            if !spare.is_empty() {
                write_lines(&mut self.out, spare, &self.lines.dropped);
                let kept = (2 * spare.len()).max(KEPT_BYTES);
                spare.clear();
                spare.shrink_to(kept);
                wrote = true;
            }
        }
        wrote
    }

    /// Lets lines gather for GATHER; a close or a reopen cuts it short (lines do not wake
    /// the writer now: `idle` is false).
    fn gather(&self) {
        let until = std::time::Instant::now() + GATHER;
        loop {
            let now = std::time::Instant::now();
            if now >= until
                || self.lines.closing.load(Ordering::Acquire)
                || self.lines.reopen.load(Ordering::Acquire)
            {
                return;
            }
            std::thread::park_timeout(until - now);
        }
    }

    /// Parks until a line, a reopen or the close wakes it, or IDLE passes.
    fn rest(&self) {
        self.lines.idle.store(true, Ordering::SeqCst);
        // A line added before `idle` was set woke nobody: look once more.
        let waiting = !self.lines.is_empty()
            || self.lines.closing.load(Ordering::Acquire)
            || self.lines.reopen.load(Ordering::Acquire);
        if !waiting {
            std::thread::park_timeout(IDLE);
        }
        self.lines.idle.store(false, Ordering::Relaxed);
    }

    fn maybe_reopen(&mut self) {
        if !self.lines.reopen.swap(false, Ordering::AcqRel) {
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

/// Writes whole lines with as few writes as the file takes; where one fails (a full disk),
/// every line not wholly written is counted as dropped.
fn write_lines(out: &mut dyn std::io::Write, text: &[u8], dropped: &IntCounter) {
    let written = write_most(out, text);
    let lost = text[written..].iter().filter(|b| **b == b'\n').count();
    dropped.inc_by(lost as u64);
    if out.flush().is_err() && lost == 0 {
        dropped.inc();
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

#[cfg(test)]
mod tests;
