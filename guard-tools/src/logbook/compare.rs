//! `guard logbook compare A B`: every figure of B against A in its unit, costs beside gains,
//! and whether a difference is inside the runs' own spread; as a table, JSON or CSV.

use comfy_table::{CellAlignment, Table};
use serde::Serialize;

use super::{
    LogbookError,
    entry::Entry,
    figures::{Better, Figure, Reading, Unit, plain},
};
use crate::usage::Format;

/// The comparison as `--format json` writes it (docs/design.md §9 lists the fields).
#[derive(Debug, Serialize)]
pub struct Comparison {
    pub a: Side,
    pub b: Side,
    /// What differs in how the two were run (input set, model digest, runtime, flags).
    pub notes: Vec<String>,
    pub rows: Vec<Row>,
    /// The keys of the rows whose verdict is `gain`, then of those whose verdict is `cost`.
    pub gains: Vec<String>,
    pub costs: Vec<String>,
}

/// One of the two entries.
#[derive(Debug, Serialize)]
pub struct Side {
    pub id: String,
    pub recorded_at: jiff::Timestamp,
    pub model: String,
    pub runtime: String,
    pub runtime_version: String,
    pub repetitions: usize,
    pub inputs: usize,
}

/// One figure of both entries.
#[derive(Debug, Serialize)]
pub struct Row {
    pub figure: String,
    pub name: String,
    pub unit: Unit,
    pub better: Better,
    /// The value in `unit`; `null` where that machine could not measure it.
    pub a: Option<Amount>,
    pub b: Option<Amount>,
    /// `[lowest, highest]` of the runs' own values, where the figure has runs.
    pub a_runs: Option<[f64; 2]>,
    pub b_runs: Option<[f64; 2]>,
    /// (B - A) / A in percent; `null` where A is 0 or either is unmeasured.
    pub change_percent: Option<f64>,
    /// The change as printed: `+2.5%`, `new` (from 0), `gone` (to 0), `0%` or `-`.
    pub change: String,
    pub verdict: Verdict,
}

/// A count as an integer, anything else as a real number.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Amount {
    Count(u64),
    Real(f64),
}

/// What a row's change means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Gain,
    Cost,
    /// The two entries' per-run ranges overlap: the difference may be noise.
    WithinSpread,
    Same,
    /// One of the two could not be measured.
    Unmeasured,
}

impl Verdict {
    /// As the table prints it: a cost in capitals, so that it is not missed.
    pub fn words(self) -> &'static str {
        match self {
            Self::Gain => "gain",
            Self::Cost => "COST",
            Self::WithinSpread => "within the spread",
            Self::Same => "same",
            Self::Unmeasured => "-",
        }
    }
}

/// Every figure of `b` against `a`.
pub fn compare(a: &Entry, b: &Entry) -> Comparison {
    let rows: Vec<Row> = Figure::ALL.iter().map(|f| row(*f, a, b)).collect();
    let keys = |verdict| {
        let matching = rows.iter().filter(move |row| row.verdict == verdict);
        matching.map(|row| row.figure.clone()).collect()
    };
    Comparison {
        a: Side::of(a),
        b: Side::of(b),
        notes: notes(a, b),
        gains: keys(Verdict::Gain),
        costs: keys(Verdict::Cost),
        rows,
    }
}

impl Side {
    fn of(entry: &Entry) -> Self {
        Self {
            id: entry.id.clone(),
            recorded_at: entry.recorded_at,
            model: entry.model.clone(),
            runtime: entry.runtime.clone(),
            runtime_version: entry.runtime_version.clone(),
            repetitions: entry.repetitions,
            inputs: entry.input_set.inputs,
        }
    }
}

/// What differs in how the two were run.
fn notes(a: &Entry, b: &Entry) -> Vec<String> {
    let mut notes = Vec::new();
    if a.input_set.sha256 != b.input_set.sha256 {
        notes.push("the input sets differ (sha256): these runs measured different work".to_owned());
    }
    for (what, x, y) in [
        ("model", &a.model, &b.model),
        ("model digest", &a.model_digest, &b.model_digest),
        ("runtime", &a.runtime, &b.runtime),
        ("runtime version", &a.runtime_version, &b.runtime_version),
        ("launch flags", &a.launch_flags, &b.launch_flags),
        ("workload class", &a.workload_class, &b.workload_class),
    ] {
        if x != y {
            notes.push(format!("changed: {what}: {x} -> {y}"));
        }
    }
    notes
}

fn row(figure: Figure, a: &Entry, b: &Entry) -> Row {
    let (x, y) = (figure.reading(a), figure.reading(b));
    let unit = figure.unit();
    let amount = |v: Option<f64>| {
        v.map(|v| match unit {
            Unit::Count => Amount::Count(v.round().max(0.0) as u64),
            _ => Amount::Real(v),
        })
    };
    let range = |r: Reading| r.runs.map(|(lo, hi)| [lo, hi]);
    let (change_percent, change) = change(x.value, y.value);
    Row {
        figure: figure.key(),
        name: figure.name(),
        unit,
        better: figure.better(),
        a: amount(x.value),
        b: amount(y.value),
        a_runs: range(x),
        b_runs: range(y),
        change_percent,
        change,
        verdict: verdict(figure.better(), x, y),
    }
}

/// The change from `a` to `b`: in percent where `a` is not 0, else in words.
fn change(a: Option<f64>, b: Option<f64>) -> (Option<f64>, String) {
    match (a, b) {
        (Some(x), Some(y)) if x == y => (Some(0.0), "0%".to_owned()),
        (Some(0.0), Some(_)) => (None, "new".to_owned()),
        (Some(_), Some(0.0)) => (Some(-100.0), "gone".to_owned()),
        (Some(x), Some(y)) => {
            let percent = (y - x) / x * 100.0;
            (Some(percent), format!("{percent:+.1}%"))
        }
        _ => (None, "-".to_owned()),
    }
}

fn verdict(better: Better, a: Reading, b: Reading) -> Verdict {
    let (Some(x), Some(y)) = (a.value, b.value) else {
        return Verdict::Unmeasured;
    };
    let overlap = match (a.runs, b.runs) {
        (Some((a_lo, a_hi)), Some((b_lo, b_hi))) => b_lo <= a_hi && a_lo <= b_hi,
        _ => false,
    };
    let improved = match better {
        Better::Lower => y < x,
        Better::Higher => y > x,
    };
    match () {
        () if x == y => Verdict::Same,
        () if overlap => Verdict::WithinSpread,
        () if improved => Verdict::Gain,
        () => Verdict::Cost,
    }
}

/// The comparison as `format` says.
pub fn render(comparison: &Comparison, format: Format) -> Result<String, LogbookError> {
    match format {
        Format::Table => Ok(table(comparison)),
        Format::Json => serde_json::to_string_pretty(comparison)
            .map(|json| json + "\n")
            .map_err(LogbookError::Encode),
        Format::Csv => csv(comparison),
    }
}

/// A value with its runs' range, as a cell: `151 (140–160)`.
pub fn cell(unit: Unit, value: Option<&Amount>, runs: Option<&[f64; 2]>) -> String {
    let value = match value {
        None => return "unavailable".to_owned(),
        Some(Amount::Count(n)) => n.to_string(),
        Some(Amount::Real(v)) => unit.show(*v),
    };
    match runs {
        Some([lo, hi]) => format!("{value} ({}–{})", plain(*lo), plain(*hi)),
        None => value,
    }
}

fn table(comparison: &Comparison) -> String {
    let (a, b) = (&comparison.a, &comparison.b);
    let mut out = String::new();
    for (name, side) in [("A", a), ("B", b)] {
        out.push_str(&format!(
            "{name} {} ({}, {}, {} {}, {} runs of {} inputs)\n",
            side.id,
            side.recorded_at,
            side.model,
            side.runtime,
            side.runtime_version,
            side.repetitions,
            side.inputs
        ));
    }
    for note in &comparison.notes {
        out.push_str(&format!("{note}\n"));
    }
    out.push('\n');
    out.push_str(&rows_table(&comparison.rows));
    let list = |keys: &[String]| match keys.is_empty() {
        true => "none".to_owned(),
        false => keys.join(", "),
    };
    out.push_str(&format!(
        "\ngains: {}\ncosts: {}\n(x–y): the lowest and highest of the runs' own values; \
         within the spread: A's and B's ranges overlap.\n",
        list(&comparison.gains),
        list(&comparison.costs)
    ));
    out
}

fn rows_table(rows: &[Row]) -> String {
    let mut table = Table::new();
    table.load_style(comfy_table::presets::NOTHING);
    table.set_header(["figure", "unit", "A", "B", "change", "verdict"]);
    for row in rows {
        table.add_row([
            row.name.clone(),
            row.unit.symbol().to_owned(),
            cell(row.unit, row.a.as_ref(), row.a_runs.as_ref()),
            cell(row.unit, row.b.as_ref(), row.b_runs.as_ref()),
            row.change.clone(),
            row.verdict.words().to_owned(),
        ]);
    }
    for (index, column) in table.column_iter_mut().enumerate() {
        column.set_padding((0, 2));
        if (2..=4).contains(&index) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    format!("{}\n", table.trim_fmt())
}

/// One line a figure, the runs' range in columns of their own.
fn csv(comparison: &Comparison) -> Result<String, LogbookError> {
    let mut writer = csv::Writer::from_writer(Vec::new());
    let header = [
        "figure",
        "unit",
        "better",
        "a",
        "b",
        "a_runs_min",
        "a_runs_max",
        "b_runs_min",
        "b_runs_max",
        "change_percent",
        "change",
        "verdict",
    ];
    let number = |v: Option<f64>| v.map_or(String::new(), |v| v.to_string());
    let amount = |v: Option<&Amount>| match v {
        None => String::new(),
        Some(Amount::Count(n)) => n.to_string(),
        Some(Amount::Real(v)) => v.to_string(),
    };
    let end = |r: Option<[f64; 2]>, i: usize| number(r.map(|r| r[i]));
    let mut records = vec![header.map(str::to_owned).to_vec()];
    for row in &comparison.rows {
        records.push(vec![
            row.figure.clone(),
            row.unit.symbol().to_owned(),
            row.better.word().to_owned(),
            amount(row.a.as_ref()),
            amount(row.b.as_ref()),
            end(row.a_runs, 0),
            end(row.a_runs, 1),
            end(row.b_runs, 0),
            end(row.b_runs, 1),
            number(row.change_percent),
            row.change.clone(),
            verdict_key(row.verdict).to_owned(),
        ]);
    }
    for record in records {
        writer.write_record(record).map_err(LogbookError::Csv)?;
    }
    let bytes = writer
        .into_inner()
        .map_err(|e| LogbookError::Csv(e.into_error().into()))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The verdict as JSON and CSV write it.
pub fn verdict_key(verdict: Verdict) -> &'static str {
    match verdict {
        Verdict::Gain => "gain",
        Verdict::Cost => "cost",
        Verdict::WithinSpread => "within_spread",
        Verdict::Same => "same",
        Verdict::Unmeasured => "unmeasured",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logbook::entry::{Maybe, Runs, Spread, fixture, quantile};

    /// A with one abstention-free, failure-free run; B with abstentions appearing, failures
    /// gone, more memory, and TTFT runs that overlap A's.
    fn pair() -> (Entry, Entry) {
        let mut a = fixture("m");
        let mut b = fixture("m");
        a.quality_failures = 2;
        b.abstentions = 1;
        a.peak_server_rss_bytes = Maybe::Value(100.0 * 1024.0 * 1024.0);
        b.peak_server_rss_bytes = Maybe::Value(150.0 * 1024.0 * 1024.0);
        for (entry, runs) in [
            (&mut a, vec![vec![10.0, 20.0, 30.0], vec![12.0, 22.0, 32.0]]),
            (&mut b, vec![vec![15.0, 21.0, 45.0], vec![16.0, 23.0, 50.0]]),
        ] {
            entry.ttft_ms = Spread::of(&runs);
            entry.runs = Runs {
                ttft_ms: runs,
                ..Runs::default()
            };
        }
        (a, b)
    }

    fn row<'a>(comparison: &'a Comparison, key: &str) -> &'a Row {
        let found = comparison.rows.iter().find(|r| r.figure == key);
        found.unwrap_or_else(|| panic!("{key}"))
    }

    #[test]
    fn changes_from_or_to_zero_are_words_and_counts_are_whole() {
        let (a, b) = pair();
        let comparison = compare(&a, &b);
        let abstentions = row(&comparison, "abstentions");
        assert_eq!(
            (abstentions.change.as_str(), abstentions.verdict),
            ("new", Verdict::Cost)
        );
        let failures = row(&comparison, "quality_failures");
        assert_eq!(
            (failures.change.as_str(), failures.verdict),
            ("gone", Verdict::Gain)
        );
        let json = render(&comparison, Format::Json).expect("json");
        let value: serde_json::Value = serde_json::from_str(&json).expect("json");
        let abstentions = &value["rows"][14];
        assert_eq!(abstentions["figure"], "abstentions");
        assert!(abstentions["b"].is_u64(), "{abstentions}");
        let costs = serde_json::json!(["ttft_p95", "peak_server_rss", "abstentions"]);
        assert_eq!(value["costs"], costs);
        assert!(
            !render(&comparison, Format::Table)
                .expect("table")
                .contains("inf")
        );
    }

    #[test]
    fn every_figure_with_runs_shows_their_range_in_its_unit() {
        let (a, b) = pair();
        let comparison = compare(&a, &b);
        let p95 = row(&comparison, "ttft_p95");
        let own = |run: &[f64]| quantile(run, 0.95);
        let a_runs = [own(&[10.0, 20.0, 30.0]), own(&[12.0, 22.0, 32.0])];
        assert_eq!(p95.a_runs, Some(a_runs), "each run's own p95");
        assert_eq!(
            p95.verdict,
            Verdict::Cost,
            "B's runs' p95s lie above all of A's"
        );
        let p50 = row(&comparison, "ttft_p50");
        assert_eq!(p50.verdict, Verdict::WithinSpread);
        let rss = row(&comparison, "peak_server_rss");
        assert_eq!((rss.unit, rss.change.as_str()), (Unit::Mib, "+50.0%"));
        let table = render(&comparison, Format::Table).expect("table");
        let line = table
            .lines()
            .find(|l| l.starts_with("TTFT p50"))
            .expect("a row");
        assert!(line.contains("ms") && line.contains("(20–22)"), "{line}");
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("peak server RSS") && l.contains("100"))
        );
    }

    #[test]
    fn csv_has_one_line_a_figure_under_a_header() {
        let (a, b) = pair();
        let csv = render(&compare(&a, &b), Format::Csv).expect("csv");
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 1 + Figure::ALL.len());
        assert!(
            lines[0].starts_with("figure,unit,better,a,b,"),
            "{}",
            lines[0]
        );
        assert!(
            lines.contains(&"abstentions,count,lower,0,1,,,,,,new,cost"),
            "{csv}"
        );
    }
}
