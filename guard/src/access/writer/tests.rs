use std::collections::BTreeSet;

use prometheus::IntCounter;

use super::{AccessLog, BUFFER_BYTES, Lines};
use crate::access::{Record, RequestId};

fn dropped() -> IntCounter {
    IntCounter::new("dropped", "lines dropped").expect("a counter")
}

fn record(id: u64) -> Record<'static> {
    Record {
        id: RequestId::from(id),
        path: "/api/show".into(),
        ..Record::default()
    }
}

/// The bytes `record(id)`'s line takes in a buffer, its newline with it.
fn line_bytes() -> usize {
    let mut text = Vec::new();
    super::LineWriter::default().write(&record(1), &mut text);
    text.len() + 1
}

/// Lines from several threads, half of them through handles taken for later lines, then the
/// close: every line is in the file once, none dropped; a line after the close is counted,
/// not written. The threads are not serving threads: they share one buffer, which holds all
/// their lines even if the writer takes none before the close.
#[test]
fn close_writes_every_line_added_and_counts_one_added_after() {
    let dir = std::env::temp_dir().join(format!("guard-writer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory");
    let path = dir.join("access.log");
    let _ = std::fs::remove_file(&path);
    let dropped = dropped();
    let log = AccessLog::open(path.to_str().expect("utf-8"), dropped.clone()).expect("opens");
    const THREADS: u64 = 4;
    let each = (BUFFER_BYTES / line_bytes()) as u64 / THREADS;
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let log = log.clone();
            scope.spawn(move || {
                for n in 0..each {
                    let record = record(thread * each + n);
                    match (n % 2, log.later()) {
                        (0, Some(later)) => later.write(&record),
                        _ => log.write(&record),
                    }
                }
            });
        }
    });
    log.close();
    log.write(&record(u64::MAX));
    let text = std::fs::read_to_string(&path).expect("the log");
    let ids: Vec<RequestId> = text
        .lines()
        .map(|line| {
            serde_json::from_str::<Record<'_>>(line)
                .expect("a record")
                .id
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(ids.len() as u64, THREADS * each, "one line a request");
    assert_eq!(
        ids.iter().copied().collect::<BTreeSet<_>>(),
        (0..THREADS * each).map(RequestId::from).collect(),
        "each request once"
    );
    assert_eq!(dropped.get(), 1, "only the line after the close");
}

/// A buffer takes lines while it holds less than BUFFER_BYTES; each line beyond is dropped,
/// counted.
#[test]
fn a_full_buffer_drops_and_counts_each_line_beyond_it() {
    let dropped = dropped();
    let lines = Lines::new(dropped.clone());
    let one = line_bytes();
    let taken = BUFFER_BYTES.div_ceil(one);
    for _ in 0..taken + 5 {
        lines.append(lines.own_buffer(), &record(1));
    }
    let held = lines
        .buffers
        .iter()
        .map(|buffer| buffer.lock().text.len())
        .sum::<usize>();
    assert_eq!(held, taken * one);
    assert_eq!(dropped.get(), 5);
}
