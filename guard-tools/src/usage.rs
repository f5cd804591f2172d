//! `guard usage`: the access log summed per client, so a small team sees who used the box and
//! who was turned away.

use std::{
    collections::BTreeMap,
    fs::File,
    io::{self, BufRead, BufReader},
    path::{Path, PathBuf},
    str::FromStr,
};

use comfy_table::{CellAlignment, Table};
use guard::{access::Record, quantile::quantile};
use jiff::{SignedDuration, Span, SpanRelativeTo, Timestamp};
use serde::{Serialize, ser::SerializeStruct as _};

/// Where `guard usage` reads without `--log`: the path `deploy/logrotate/guard` rotates, to
/// give `[log] access` (the daemon writes no access log unless it is set).
pub const DEFAULT_LOG: &str = "/var/log/guard/access.log";

/// The row of the records that lack the grouping's key (no unit, no token, no class, ...).
pub const NO_KEY: &str = "-";

/// The key of the row that sums all the others.
pub const TOTAL: &str = "total";

#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error(
        "cannot open the access log {path} (guard writes it where `[log] access` says; pass --log PATH)"
    )]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reading the access log {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    // The reason is in the message: clap shows a value's error by its Display alone.
    #[error("`{given}`: {reason} (give a duration such as 24h, 90m, 7d or 30s, or `all`)")]
    BadSince { given: String, reason: String },
    #[error("`{given}` is none of {expected}")]
    Unknown { given: String, expected: String },
    #[error("writing the csv")]
    Csv(#[source] csv::Error),
    #[error("writing the json")]
    Json(#[source] serde_json::Error),
}

/// What the rows are: one per value of this part of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum By {
    Unit,
    Uid,
    Token,
    Class,
    Model,
}

impl By {
    pub const ALL: [By; 5] = [By::Unit, By::Uid, By::Token, By::Class, By::Model];
    pub const NAMES: [&'static str; 5] = ["unit", "uid", "token", "class", "model"];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// The record's key under this grouping; None where it has none (or an empty one).
    fn key(self, record: &Record<'_>) -> Option<String> {
        let identity = &record.identity;
        let named = match self {
            By::Unit => &identity.unit,
            By::Uid => return identity.uid.map(|uid| uid.to_string()),
            By::Token => &identity.token,
            By::Class => &record.class,
            By::Model => &record.model,
        };
        named
            .as_deref()
            .filter(|key| !key.is_empty())
            .map(str::to_owned)
    }
}

impl FromStr for By {
    type Err = UsageError;

    fn from_str(given: &str) -> Result<Self, UsageError> {
        let found = Self::ALL.into_iter().find(|by| by.name() == given);
        found.ok_or_else(|| unknown(given, &Self::NAMES))
    }
}

/// How the ledger is printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Plain columns a space apart, as `guard status` prints.
    Table,
    Csv,
    /// One array of row objects.
    Json,
}

impl Format {
    pub const ALL: [Format; 3] = [Format::Table, Format::Csv, Format::Json];
    pub const NAMES: [&'static str; 3] = ["table", "csv", "json"];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl FromStr for Format {
    type Err = UsageError;

    fn from_str(given: &str) -> Result<Self, UsageError> {
        let found = Self::ALL.into_iter().find(|format| format.name() == given);
        found.ok_or_else(|| unknown(given, &Self::NAMES))
    }
}

fn unknown(given: &str, names: &[&str]) -> UsageError {
    UsageError::Unknown {
        given: given.to_owned(),
        expected: names.join(", "),
    }
}

/// How far back the ledger looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Since {
    /// Every record, those without a time too.
    All,
    /// Records that concluded at most this long before now.
    Last(SignedDuration),
}

impl FromStr for Since {
    type Err = UsageError;

    /// `all`, or a duration in jiff's friendly format (`24h`, `90m`, `7d`, `30s`, `1h30m`) or
    /// ISO 8601 (`PT24H`), parsed as a `jiff::Span`; a day is 24 hours, a week 7 days, and
    /// months or years are refused (their length depends on the date).
    fn from_str(given: &str) -> Result<Self, UsageError> {
        if given == "all" {
            return Ok(Since::All);
        }
        let bad = |reason: String| UsageError::BadSince {
            given: given.to_owned(),
            reason,
        };
        let span: Span = given
            .parse()
            .map_err(|err: jiff::Error| bad(err.to_string()))?;
        let duration = span
            .to_duration(SpanRelativeTo::days_are_24_hours())
            .map_err(|err| bad(err.to_string()))?;
        if duration.is_negative() {
            return Err(bad("a window cannot end before it starts".to_owned()));
        }
        Ok(Since::Last(duration))
    }
}

/// What to sum: the grouping, and the window ending at `now`.
#[derive(Clone, Copy, Debug)]
pub struct Query {
    pub by: By,
    pub since: Since,
    /// The window's end; given, not read here, so the same log sums the same way in tests.
    pub now: Timestamp,
}

impl Query {
    /// The window ends at this moment.
    pub fn until_now(by: By, since: Since) -> Self {
        Self {
            by,
            since,
            now: Timestamp::now(),
        }
    }

    /// Whether the record is in the window: a record without a time is only in `all`.
    fn keeps(&self, record: &Record<'_>) -> bool {
        let Since::Last(duration) = self.since else {
            return true;
        };
        // A window reaching before the timestamps' range covers every record.
        let Ok(start) = self.now.checked_sub(duration) else {
            return true;
        };
        record.time.is_some_and(|time| time >= start)
    }
}

/// One client's (or the total's) use of the box.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Row {
    pub key: String,
    pub requests: u64,
    pub completed: u64,
    pub rejected: u64,
    pub reaped: u64,
    pub failed: u64,
    pub timed_out: u64,
    pub invalid: u64,
    pub refused: u64,
    pub passed: u64,
    /// Answered 503 (rejected, or a pass-through request over `upstream.max_passthrough`).
    pub status_503: u64,
    pub prompt_tokens: u64,
    pub computed_tokens: u64,
    pub cached_tokens: u64,
    pub generated_tokens: u64,
    /// Time holding an upstream slot.
    pub slot_seconds: f64,
    /// None where no record of the row had a measure.
    pub energy_joules: Option<f64>,
    /// Over the records that waited in a queue (none: None).
    pub queue_p50_ms: Option<f64>,
    pub queue_p95_ms: Option<f64>,
}

impl Row {
    /// Each outcome and its count, in the access log's order.
    pub fn outcomes(&self) -> [(&'static str, u64); 8] {
        [
            ("completed", self.completed),
            ("rejected", self.rejected),
            ("reaped", self.reaped),
            ("failed", self.failed),
            ("timed_out", self.timed_out),
            ("invalid", self.invalid),
            ("refused", self.refused),
            ("passed", self.passed),
        ]
    }

    fn outcome_mut(&mut self, outcome: &str) -> Option<&mut u64> {
        Some(match outcome {
            "completed" => &mut self.completed,
            "rejected" => &mut self.rejected,
            "reaped" => &mut self.reaped,
            "failed" => &mut self.failed,
            "timed_out" => &mut self.timed_out,
            "invalid" => &mut self.invalid,
            "refused" => &mut self.refused,
            "passed" => &mut self.passed,
            _ => return None,
        })
    }
}

/// The rows, busiest first, their total, and the lines that were not records.
#[derive(Clone, Debug, PartialEq)]
pub struct Ledger {
    pub rows: Vec<Row>,
    pub total: Row,
    /// Lines that did not parse as a record (a line cut by a crash, another program's line).
    pub skipped: u64,
}

/// A row being summed: the sums, and the samples its quantiles need.
#[derive(Default)]
struct Sum {
    row: Row,
    slot_ms: f64,
    queue_ms: Vec<f64>,
}

impl Sum {
    fn add(&mut self, record: &Record<'_>) {
        let row = &mut self.row;
        row.requests += 1;
        if let Some(count) = row.outcome_mut(&record.outcome) {
            *count += 1;
        }
        row.status_503 += u64::from(record.status == 503);
        let tokens = record.tokens;
        row.prompt_tokens += tokens.prompt.unwrap_or(0);
        row.computed_tokens += tokens.computed.unwrap_or(0);
        row.cached_tokens += tokens.cached.unwrap_or(0);
        row.generated_tokens += tokens.generated.unwrap_or(0);
        if let Some(joules) = record.energy_joules {
            *row.energy_joules.get_or_insert(0.0) += joules;
        }
        self.slot_ms += record.slot_ms.unwrap_or(0.0);
        self.queue_ms.extend(record.queue_ms);
    }

    fn finish(self, key: String) -> Row {
        Row {
            key,
            slot_seconds: thousandths(self.slot_ms / 1000.0),
            energy_joules: self.row.energy_joules.map(thousandths),
            queue_p50_ms: quantile(&self.queue_ms, 0.5),
            queue_p95_ms: quantile(&self.queue_ms, 0.95),
            ..self.row
        }
    }
}

/// `x` to three decimals: a sum of many f64s written out in full shows its rounding noise
/// (`232.48370000000003`), and a millisecond or a millijoule is finer than any reader needs.
fn thousandths(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Reads the access log at `path` line by line and sums it as `query` asks.
pub fn read(path: &Path, query: &Query) -> Result<Ledger, UsageError> {
    let file = File::open(path).map_err(|source| UsageError::Open {
        path: path.to_owned(),
        source,
    })?;
    aggregate(BufReader::new(file), query).map_err(|source| UsageError::Read {
        path: path.to_owned(),
        source,
    })
}

/// The longest line read as a record: guard's lines are a few KiB at most (every field is
/// bounded); a longer one (a file that is not a log, zeros a crash left) is skipped unread.
const MAX_LINE: usize = 64 << 10;

/// Reads the next line of `input` into `line` (cleared first), holding at most `MAX_LINE` + 1
/// bytes of it; a longer line's rest is passed over. None at the end of the input, else
/// whether the line is whole.
fn next_line(input: &mut impl BufRead, line: &mut Vec<u8>) -> io::Result<Option<bool>> {
    line.clear();
    let limit = MAX_LINE as u64 + 1;
    if io::Read::take(&mut *input, limit).read_until(b'\n', line)? == 0 {
        return Ok(None);
    }
    if line.len() <= MAX_LINE || line.ends_with(b"\n") {
        return Ok(Some(true));
    }
    input.skip_until(b'\n')?;
    Ok(Some(false))
}

/// Sums the records of `input` (one JSON object a line) that `query` keeps; blank lines are
/// passed over, and lines that are not records (or are too long to be) counted.
pub fn aggregate(mut input: impl BufRead, query: &Query) -> io::Result<Ledger> {
    let mut rows: BTreeMap<String, Sum> = BTreeMap::new();
    let mut total = Sum::default();
    let mut skipped = 0;
    // Bytes, not `lines()`: a line that is not UTF-8 is one more line skipped, not an error.
    let mut line = Vec::new();
    while let Some(whole) = next_line(&mut input, &mut line)? {
        if whole && line.trim_ascii().is_empty() {
            continue;
        }
        let record = whole.then(|| serde_json::from_slice::<Record<'_>>(&line));
        let Some(Ok(record)) = record else {
            skipped += 1;
            continue;
        };
        if !query.keeps(&record) {
            continue;
        }
        let key = query.by.key(&record).unwrap_or_else(|| NO_KEY.to_owned());
        rows.entry(key).or_default().add(&record);
        total.add(&record);
    }
    let mut rows: Vec<Row> = rows.into_iter().map(|(key, sum)| sum.finish(key)).collect();
    rows.sort_by(|a, b| b.requests.cmp(&a.requests).then_with(|| a.key.cmp(&b.key)));
    Ok(Ledger {
        rows,
        total: total.finish(TOTAL.to_owned()),
        skipped,
    })
}

/// The ledger as `format` says, its total last.
pub fn render(ledger: &Ledger, by: By, format: Format) -> Result<String, UsageError> {
    match format {
        Format::Table => Ok(table(ledger, by)),
        Format::Csv => csv(ledger, by),
        Format::Json => {
            let rows: Vec<Keyed<'_>> = keyed(ledger, by).collect();
            let json = serde_json::to_string_pretty(&rows).map_err(UsageError::Json)?;
            Ok(json + "\n")
        }
    }
}

/// A row as csv and json write it: its key under the grouping's name (`unit`, `uid`, ...).
struct Keyed<'a> {
    by: By,
    row: &'a Row,
}

fn keyed(ledger: &Ledger, by: By) -> impl Iterator<Item = Keyed<'_>> {
    let rows = ledger.rows.iter().chain(std::iter::once(&ledger.total));
    rows.map(move |row| Keyed { by, row })
}

impl Serialize for Keyed<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let row = self.row;
        let mut out = serializer.serialize_struct("Row", 19)?;
        out.serialize_field(self.by.name(), &row.key)?;
        out.serialize_field("requests", &row.requests)?;
        for (outcome, count) in row.outcomes() {
            out.serialize_field(outcome, &count)?;
        }
        out.serialize_field("status_503", &row.status_503)?;
        out.serialize_field("prompt_tokens", &row.prompt_tokens)?;
        out.serialize_field("computed_tokens", &row.computed_tokens)?;
        out.serialize_field("cached_tokens", &row.cached_tokens)?;
        out.serialize_field("generated_tokens", &row.generated_tokens)?;
        out.serialize_field("slot_seconds", &row.slot_seconds)?;
        out.serialize_field("energy_joules", &row.energy_joules)?;
        out.serialize_field("queue_p50_ms", &row.queue_p50_ms)?;
        out.serialize_field("queue_p95_ms", &row.queue_p95_ms)?;
        out.end()
    }
}

fn csv(ledger: &Ledger, by: By) -> Result<String, UsageError> {
    let mut writer = csv::Writer::from_writer(Vec::new());
    for row in keyed(ledger, by) {
        writer.serialize(row).map_err(UsageError::Csv)?;
    }
    let bytes = writer
        .into_inner()
        .map_err(|err| UsageError::Csv(err.into_error().into()))?;
    // Every field came from a String or a number.
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Outcomes the table always shows: who was served and who was turned away. The others only
/// where some record had them.
const ALWAYS_SHOWN: [&str; 2] = ["completed", "rejected"];

/// Plain columns a space apart, the key left-aligned, the figures right-aligned, a blank line
/// before the total.
fn table(ledger: &Ledger, by: By) -> String {
    let shown: Vec<usize> = (ledger.total.outcomes().iter().enumerate())
        .filter(|(_, (name, count))| ALWAYS_SHOWN.contains(name) || *count > 0)
        .map(|(index, _)| index)
        .collect();
    let mut header = vec![by.name(), "requests"];
    header.extend(shown.iter().map(|&i| ledger.total.outcomes()[i].0));
    header.extend([
        "503s",
        "prompt",
        "computed",
        "cached",
        "generated",
        "slot s",
        "energy J",
        "queue p50 ms",
        "queue p95 ms",
    ]);
    let cells = |row: &Row| {
        let outcomes = row.outcomes();
        let mut cells = vec![row.key.clone(), row.requests.to_string()];
        cells.extend(shown.iter().map(|&i| outcomes[i].1.to_string()));
        cells.extend([
            row.status_503.to_string(),
            row.prompt_tokens.to_string(),
            row.computed_tokens.to_string(),
            row.cached_tokens.to_string(),
            row.generated_tokens.to_string(),
            format!("{:.1}", row.slot_seconds),
            row.energy_joules
                .map_or(NO_KEY.to_owned(), |j| format!("{j:.0}")),
            row.queue_p50_ms.map_or(NO_KEY.to_owned(), milliseconds),
            row.queue_p95_ms.map_or(NO_KEY.to_owned(), milliseconds),
        ]);
        cells
    };
    let mut table = Table::new();
    table.load_style(comfy_table::presets::NOTHING);
    table.set_header(header);
    table.add_rows(ledger.rows.iter().map(cells));
    if !ledger.rows.is_empty() {
        table.add_row(Vec::<String>::new());
    }
    table.add_row(cells(&ledger.total));
    for (index, column) in table.column_iter_mut().enumerate() {
        column.set_padding((0, 1));
        if index > 0 {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    format!("{}\n", table.trim_fmt())
}

/// A wait in milliseconds: a tenth where it is short, whole ones beyond.
fn milliseconds(ms: f64) -> String {
    match ms < 10.0 {
        true => format!("{ms:.1}"),
        false => format!("{ms:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use super::*;
    use guard::access::{Identity, Tokens};

    fn now() -> Timestamp {
        "2025-06-01T12:00:00Z".parse().expect("a timestamp")
    }

    /// A completed request that concluded `minutes_ago` before `now()`, from `unit`.
    fn record(minutes_ago: i64, unit: Option<&str>) -> Record<'static> {
        Record {
            time: Some(now() - SignedDuration::from_mins(minutes_ago)),
            id: guard::access::RequestId::from(minutes_ago.unsigned_abs()),
            identity: Identity {
                unit: unit.map(|unit| unit.to_owned().into()),
                ..Identity::default()
            },
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            status: 200,
            outcome: "completed".into(),
            duration_ms: 800.0,
            ..Record::default()
        }
    }

    fn rejected(mut record: Record<'static>) -> Record<'static> {
        record.status = 503;
        record.outcome = "rejected".into();
        record.reason = Some("queue_full".into());
        record
    }

    /// The lines written to a file of their own, read back as `by` and `since` ask.
    fn ledger_of(name: &str, lines: &[String], by: By, since: &str) -> Ledger {
        let path = std::env::temp_dir().join(format!("guard-usage-{}-{name}", std::process::id()));
        std::fs::write(&path, lines.concat()).expect("writing the log");
        let query = Query {
            by,
            since: since.parse().expect("a window"),
            now: now(),
        };
        let ledger = read(&path, &query);
        std::fs::remove_file(&path).expect("removing the log");
        ledger.expect("reading the log")
    }

    fn lines(records: &[Record<'_>]) -> Vec<String> {
        let line = |r: &Record<'_>| serde_json::to_string(r).expect("a record serializes") + "\n";
        records.iter().map(line).collect()
    }

    fn keys(ledger: &Ledger) -> Vec<(&str, u64)> {
        let rows = ledger.rows.iter();
        rows.map(|row| (row.key.as_str(), row.requests)).collect()
    }

    #[test]
    fn groups_by_each_key_with_a_row_for_records_without_it() {
        let mut full = record(1, Some("alice.service"));
        full.identity.uid = Some(1000);
        full.identity.token = Some("ci".into());
        full.class = Some("interactive".into());
        full.model = Some("qwen2.5:7b".into());
        let records = [
            full.clone(),
            full.clone(),
            full,
            record(2, Some("bob.service")),
            record(3, None),
        ];
        let lines = lines(&records);
        let expected = [
            (By::Unit, "alice.service"),
            (By::Uid, "1000"),
            (By::Token, "ci"),
            (By::Class, "interactive"),
            (By::Model, "qwen2.5:7b"),
        ];
        for (by, key) in expected {
            let ledger = ledger_of(by.name(), &lines, by, "all");
            // Busiest first; a tie in key order.
            let mut want = vec![(key, 3), (NO_KEY, 2)];
            if by == By::Unit {
                want = vec![(key, 3), (NO_KEY, 1), ("bob.service", 1)];
            }
            assert_eq!(keys(&ledger), want, "--by {}", by.name());
            assert_eq!(ledger.total.requests, 5);
            assert_eq!(ledger.total.key, TOTAL);
        }
    }

    #[test]
    fn since_keeps_records_inside_the_window_only() {
        let mut untimed = record(0, Some("e"));
        untimed.time = None;
        let records = [
            record(30, Some("a")),
            record(2 * 60, Some("b")),
            record(25 * 60, Some("c")),
            record(8 * 24 * 60, Some("d")),
            untimed,
        ];
        let lines = lines(&records);
        let counted = |since| ledger_of(since, &lines, By::Unit, since).total.requests;
        assert_eq!(counted("1h"), 1);
        assert_eq!(counted("90m"), 1);
        assert_eq!(counted("24h"), 2);
        assert_eq!(counted("7d"), 3);
        assert_eq!(counted("all"), 5);
        // The edge is inside: a record exactly `since` old counts.
        assert_eq!(counted("120m"), 2);
    }

    #[test]
    fn since_parses_durations_and_all() {
        let secs = |given: &str| match given.parse::<Since>().expect(given) {
            Since::Last(duration) => Some(duration.as_secs()),
            Since::All => None,
        };
        assert_eq!(secs("24h"), Some(86_400));
        assert_eq!(secs("90m"), Some(5_400));
        assert_eq!(secs("7d"), Some(604_800));
        assert_eq!(secs("30s"), Some(30));
        assert_eq!(secs("1h30m"), Some(5_400));
        assert_eq!(secs("all"), None);
        for bad in ["yesterday", "-1h", "1mo", "", "24"] {
            let err = bad.parse::<Since>().expect_err(bad).to_string();
            assert!(err.contains("such as 24h"), "{bad}: {err}");
        }
    }

    #[test]
    fn sums_outcomes_tokens_slot_time_energy_and_503s() {
        let mut served = record(1, Some("a"));
        served.tokens = Tokens {
            prompt: Some(120),
            computed: Some(20),
            cached: Some(100),
            generated: Some(40),
        };
        served.slot_ms = Some(1_500.0);
        served.energy_joules = Some(12.5);
        let mut passed = record(2, Some("a"));
        passed.outcome = "passed".into();
        passed.status = 503;
        let records = [
            served.clone(),
            served,
            passed,
            rejected(record(3, Some("b"))),
        ];
        let ledger = ledger_of("sums", &lines(&records), By::Unit, "all");
        let a = &ledger.rows[0];
        assert_eq!((a.key.as_str(), a.requests), ("a", 3));
        assert_eq!(
            (a.completed, a.passed, a.rejected, a.status_503),
            (2, 1, 0, 1)
        );
        assert_eq!(
            (
                a.prompt_tokens,
                a.computed_tokens,
                a.cached_tokens,
                a.generated_tokens
            ),
            (240, 40, 200, 80)
        );
        assert_eq!(a.slot_seconds, 3.0);
        // Sums written without their floating-point noise.
        let mut noisy = record(1, Some("c"));
        noisy.slot_ms = Some(1_100.1);
        noisy.energy_joules = Some(0.1);
        let noisy = lines(&[noisy.clone(), noisy.clone(), noisy]);
        let c = &ledger_of("noise", &noisy, By::Unit, "all").rows[0];
        assert_eq!((c.slot_seconds, c.energy_joules), (3.3, Some(0.3)));
        assert_eq!(a.energy_joules, Some(25.0));
        let b = &ledger.rows[1];
        assert_eq!((b.rejected, b.status_503, b.energy_joules), (1, 1, None));
        let total = &ledger.total;
        assert_eq!(
            (total.requests, total.status_503, total.rejected),
            (4, 2, 1)
        );
        assert_eq!(total.energy_joules, Some(25.0));
    }

    #[test]
    fn queue_wait_percentiles_over_the_records_that_waited() {
        let mut records: Vec<Record<'static>> = (1..=100)
            .map(|ms| {
                let mut waited = record(1, Some("a"));
                waited.queue_ms = Some(f64::from(ms));
                waited
            })
            .collect();
        // Refused on arrival: no wait to count.
        records.push(rejected(record(1, Some("a"))));
        records.push(rejected(record(1, Some("b"))));
        let ledger = ledger_of("quantiles", &lines(&records), By::Unit, "all");
        let a = &ledger.rows[0];
        assert_eq!((a.queue_p50_ms, a.queue_p95_ms), (Some(51.0), Some(95.0)));
        let b = &ledger.rows[1];
        assert_eq!((b.queue_p50_ms, b.queue_p95_ms), (None, None));
        assert_eq!(ledger.total.queue_p95_ms, Some(95.0));
    }

    #[test]
    fn lines_that_are_not_records_are_skipped_and_counted() {
        let mut lines = lines(&[record(1, Some("a")), record(2, Some("a"))]);
        lines.insert(1, "not json at all\n".to_owned());
        lines.insert(2, "\n".to_owned());
        lines.insert(
            3,
            String::from_utf8_lossy(b"{\"id\": \"\xff\"}\n").into_owned(),
        );
        // A line cut short by a crash, last in the file.
        let cut = lines[0].clone();
        lines.push(cut[..cut.len() / 2].to_owned());
        let ledger = ledger_of("skipped", &lines, By::Unit, "all");
        assert_eq!(ledger.skipped, 3);
        assert_eq!(keys(&ledger), [("a", 2)]);
    }

    #[test]
    fn a_line_too_long_to_be_a_record_is_skipped_unheld() {
        let record = lines(&[record(1, Some("a"))]).concat();
        // 64 MiB without a newline (zeros a crash left), then a record.
        let zeros = io::repeat(0).take(1 << 26);
        let rest = format!("\n{record}");
        let mut input = io::BufReader::new(zeros.chain(rest.as_bytes()));
        let mut line = Vec::new();
        assert_eq!(next_line(&mut input, &mut line).expect("read"), Some(false));
        assert_eq!(line.len(), MAX_LINE + 1, "held no more than the bound");
        assert_eq!(next_line(&mut input, &mut line).expect("read"), Some(true));
        assert_eq!(line, record.as_bytes(), "the next line is whole");
        let input = io::repeat(b'x')
            .take(MAX_LINE as u64 * 3)
            .chain(rest.as_bytes());
        let query = Query {
            by: By::Unit,
            since: Since::All,
            now: now(),
        };
        let ledger = aggregate(io::BufReader::new(input), &query).expect("read");
        assert_eq!((ledger.skipped, keys(&ledger)), (1, vec![("a", 1)]));
    }

    #[test]
    fn a_line_of_the_longest_length_is_whole() {
        let longest = "x".repeat(MAX_LINE);
        let next = |input: &mut &[u8], line: &mut Vec<u8>| {
            let whole = next_line(input, line).expect("read");
            (whole, line.len())
        };
        let mut line = Vec::new();
        let text = format!("{longest}\n{longest}x\nshort\n{longest}");
        let mut input = text.as_bytes();
        assert_eq!(next(&mut input, &mut line), (Some(true), MAX_LINE + 1));
        assert_eq!(next(&mut input, &mut line), (Some(false), MAX_LINE + 1));
        assert_eq!(
            next(&mut input, &mut line),
            (Some(true), 6),
            "the next line whole"
        );
        // The last line, without a newline.
        assert_eq!(next(&mut input, &mut line), (Some(true), MAX_LINE));
        assert_eq!(next(&mut input, &mut line), (None, 0));
        // One byte over, last and without a newline.
        let text = format!("{longest}x");
        let mut input = text.as_bytes();
        assert_eq!(next(&mut input, &mut line), (Some(false), MAX_LINE + 1));
    }

    #[test]
    fn a_missing_log_names_its_path() {
        let path = Path::new("/nonexistent/guard/access.log");
        let query = Query {
            by: By::Unit,
            since: Since::All,
            now: now(),
        };
        let err = read(path, &query).expect_err("no such file");
        assert!(
            err.to_string().contains("/nonexistent/guard/access.log"),
            "{err}"
        );
        assert!(err.to_string().contains("--log"), "{err}");
    }

    fn sample() -> Ledger {
        let mut served = record(1, Some("alice.service"));
        served.tokens.prompt = Some(100);
        served.slot_ms = Some(2_000.0);
        served.queue_ms = Some(4.0);
        let lines = lines(&[served, rejected(record(2, Some("job, \"nightly\"")))]);
        ledger_of("formats", &lines, By::Unit, "all")
    }

    #[test]
    fn csv_has_a_header_named_by_the_grouping_and_quotes_keys() {
        let csv = render(&sample(), By::Unit, Format::Csv).expect("csv");
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines[0],
            "unit,requests,completed,rejected,reaped,failed,timed_out,invalid,refused,passed,\
             status_503,prompt_tokens,computed_tokens,cached_tokens,generated_tokens,\
             slot_seconds,energy_joules,queue_p50_ms,queue_p95_ms"
        );
        assert_eq!(
            lines[1],
            "alice.service,1,1,0,0,0,0,0,0,0,0,100,0,0,0,2.0,,4.0,4.0"
        );
        assert_eq!(
            lines[2],
            "\"job, \"\"nightly\"\"\",1,0,1,0,0,0,0,0,0,1,0,0,0,0,0.0,,,"
        );
        assert!(lines[3].starts_with("total,2,1,1,"), "{}", lines[3]);
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn json_is_one_array_of_rows_that_parses_back() {
        let json = render(&sample(), By::Unit, Format::Json).expect("json");
        let rows: Vec<serde_json::Value> = serde_json::from_str(&json).expect("parses back");
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0]["unit"], "alice.service");
        assert_eq!(rows[0]["slot_seconds"], 2.0);
        assert_eq!(rows[0]["queue_p95_ms"], 4.0);
        assert_eq!(rows[0]["energy_joules"], serde_json::Value::Null);
        assert_eq!(rows[1]["status_503"], 1);
        assert_eq!(
            (&rows[2]["unit"], &rows[2]["requests"]),
            (&"total".into(), &2.into())
        );
    }

    #[test]
    fn table_shows_served_and_turned_away_and_leaves_out_outcomes_nobody_had() {
        let table = render(&sample(), By::Unit, Format::Table).expect("table");
        let lines: Vec<&str> = table.lines().collect();
        let header: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!(
            &header[..5],
            ["unit", "requests", "completed", "rejected", "503s"]
        );
        assert!(!lines[0].contains("reaped"), "{table}");
        assert_eq!(
            lines[1].split_whitespace().collect::<Vec<_>>(),
            [
                "alice.service",
                "1",
                "1",
                "0",
                "0",
                "100",
                "0",
                "0",
                "0",
                "2.0",
                "-",
                "4.0",
                "4.0"
            ]
        );
        assert_eq!(lines[3], "");
        assert!(lines[4].starts_with("total "), "{table}");
    }
}
