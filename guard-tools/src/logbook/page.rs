//! The report page: one self-contained HTML document (styles inline, charts as inline SVG, no
//! script, a policy that forbids loading anything) with the entries, the comparison table and
//! the charts.

use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::{
    chart::{self, letter},
    compare::{Comparison, Row, Verdict, cell, verdict_key},
    entry::Entry,
    figures::{Distribution, Figure, Single},
};

/// Nothing is fetched, nothing runs: the page is read as it is written.
const POLICY: &str = "default-src 'none'; style-src 'unsafe-inline'";

const STYLE: &str = r#"
body { font-family: "DejaVu Sans", "Liberation Sans", sans-serif; margin: 24px; color: #1e1e1e; max-width: 1600px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; }
table { border-collapse: collapse; font-size: 14px; }
th, td { padding: 4px 10px; border-bottom: 1px solid #e2e2e2; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.code { font-family: "DejaVu Sans Mono", monospace; font-size: 12px; max-width: 640px; overflow-wrap: anywhere; }
tr.gain td.verdict { background: #dff3e0; color: #17692c; font-weight: bold; }
tr.cost td.verdict { background: #fbe0de; color: #a4231a; font-weight: bold; }
tr.within_spread td.verdict { background: #eeeeee; color: #555555; }
.charts { display: flex; flex-wrap: wrap; gap: 16px; }
figure { margin: 0; border: 1px solid #e2e2e2; }
svg { display: block; max-width: 100%; height: auto; }
p.note, ul.notes { color: #555555; font-size: 14px; }
"#;

/// A drawn chart: its id in the page is `chart-KEY`.
pub struct Chart {
    id: String,
    title: String,
    svg: String,
    distribution: bool,
}

impl Chart {
    pub fn new(key: &str, title: &str, distribution: bool, svg: String) -> Self {
        let id = format!("chart-{key}");
        // plotters' document opens with `<svg width=...`: the id goes on that element.
        let tagged = format!("<svg id=\"{id}\" role=\"img\" aria-label=\"{title}\" ");
        Self {
            svg: svg.replacen("<svg ", &tagged, 1),
            id,
            title: title.to_owned(),
            distribution,
        }
    }
}

/// A figure not drawn, and why.
pub struct Skipped(String);

impl Skipped {
    pub fn distribution(figure: Distribution, entries: &[&Entry]) -> Self {
        let any = entries.iter().any(|e| !figure.samples(e).is_empty());
        Self(match any {
            true => format!(
                "{}: every request at 0 {}, nothing to draw on a log axis",
                figure.title(),
                figure.unit().symbol()
            ),
            false => format!("{}: no samples in these entries", figure.title()),
        })
    }

    pub fn unmeasured(figure: Single) -> Self {
        Self(format!(
            "{}: unavailable on the machines these ran on",
            figure.name()
        ))
    }
}

/// The whole document.
pub fn page(
    entries: &[&Entry],
    comparison: Option<&Comparison>,
    charts: &[Chart],
    skipped: &[Skipped],
) -> String {
    let names: Vec<String> = (entries.iter().enumerate())
        .map(|(i, e)| chart::name(i, e))
        .collect();
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta http-equiv="Content-Security-Policy" content=(POLICY);
                title { "guard logbook: " (names.join(" against ")) }
                style { (PreEscaped(STYLE)) }
            }
            body {
                h1 { "guard logbook: " (names.join(" against ")) }
                (entries_table(entries))
                @if let Some(comparison) = comparison {
                    @if !comparison.notes.is_empty() {
                        ul.notes { @for note in &comparison.notes { li { (note) } } }
                    }
                    h2 { "Every figure, B against A" }
                    (figures_table(&comparison.rows))
                    (summary(comparison))
                } @else {
                    h2 { "Every figure" }
                    (single_table(entries))
                }
                (charts_section(charts, skipped))
            }
        }
    };
    markup.into_string()
}

/// A row of the entries' table: its heading and how an entry fills it.
type Field = (&'static str, fn(&Entry) -> String);

/// The entries side by side: what was run, how, and by whom.
fn entries_table(entries: &[&Entry]) -> Markup {
    let fields: [Field; 10] = [
        ("recorded", |e| e.recorded_at.to_string()),
        ("model", |e| e.model.clone()),
        ("model digest", |e| e.model_digest.clone()),
        ("runtime", |e| {
            format!("{} {}", e.runtime, e.runtime_version)
        }),
        ("launch flags", |e| e.launch_flags.clone()),
        ("input set", |e| {
            let (set, sha) = (&e.input_set, &e.input_set.sha256);
            format!(
                "{} ({} inputs, sha256 {})",
                set.path,
                set.inputs,
                &sha[..sha.len().min(12)]
            )
        }),
        ("runs", |e| {
            format!("{} of the set, class {}", e.repetitions, e.workload_class)
        }),
        ("command", |e| e.command.clone()),
        ("decision", |e| format!("{} ({})", e.decision, e.owner)),
        ("retest", |e| e.retest_date.to_string()),
    ];
    html! {
        table.entries {
            tr {
                th { "entry" }
                @for (index, entry) in entries.iter().enumerate() {
                    th style=(format!("color: {}", hex(index))) {
                        (letter(index)) " " (entry.id)
                    }
                }
            }
            @for (name, field) in fields {
                tr {
                    th { (name) }
                    @for entry in entries { td.code { (field(entry)) } }
                }
            }
        }
    }
}

/// The colour of the entry's curves and bars, for its column heading.
fn hex(index: usize) -> String {
    let colour = chart::colour(index);
    format!("#{:02x}{:02x}{:02x}", colour.0, colour.1, colour.2)
}

/// The comparison, each verdict coloured: gain green, cost red, within the spread grey.
fn figures_table(rows: &[Row]) -> Markup {
    html! {
        table.figures {
            tr {
                th { "figure" } th { "unit" } th { "A (runs)" } th { "B (runs)" }
                th { "change" } th { "verdict" }
            }
            @for row in rows {
                tr class=(verdict_key(row.verdict)) id=(format!("row-{}", row.figure)) {
                    td { (row.name) }
                    td { (row.unit.symbol()) }
                    td.num { (cell(row.unit, row.a.as_ref(), row.a_runs.as_ref())) }
                    td.num { (cell(row.unit, row.b.as_ref(), row.b_runs.as_ref())) }
                    td.num { (row.change) }
                    td.verdict { (row.verdict.words()) }
                }
            }
        }
    }
}

fn summary(comparison: &Comparison) -> Markup {
    let list = |keys: &[String]| match keys.is_empty() {
        true => "none".to_owned(),
        false => keys.join(", "),
    };
    let within = comparison
        .rows
        .iter()
        .any(|r| r.verdict == Verdict::WithinSpread);
    html! {
        p { b { "gains: " } (list(&comparison.gains)) }
        p { b { "costs: " } (list(&comparison.costs)) }
        p.note {
            "(x–y): the lowest and highest of the runs' own values. "
            @if within { "Within the spread: A's and B's ranges overlap, so the difference may be noise." }
        }
    }
}

/// One entry's figures, with its runs' range.
fn single_table(entries: &[&Entry]) -> Markup {
    html! {
        table.figures {
            tr { th { "figure" } th { "unit" } th { "value (runs)" } }
            @for figure in Figure::ALL {
                @let reading = figure.reading(entries[0]);
                @let amount = reading.value.map(super::compare::Amount::Real);
                tr {
                    td { (figure.name()) }
                    td { (figure.unit().symbol()) }
                    td.num { (cell(figure.unit(), amount.as_ref(), reading.runs.map(|(a, b)| [a, b]).as_ref())) }
                }
            }
        }
    }
}

fn charts_section(charts: &[Chart], skipped: &[Skipped]) -> Markup {
    let (distributions, bars): (Vec<&Chart>, Vec<&Chart>) =
        charts.iter().partition(|c| c.distribution);
    html! {
        h2 { "Distributions" }
        p.note { "Each request's value, as the share of requests at or below it (a step a request). Dots: p50 and p95 of all requests; ticks across the 50% line: each run's own p50, so the spread between runs shows." }
        div.charts { @for chart in distributions { (figure(chart)) } }
        h2 { "Once a run" }
        div.charts { @for chart in bars { (figure(chart)) } }
        @if !skipped.is_empty() {
            h2 { "Not drawn" }
            ul.notes { @for skip in skipped { li { (skip.0) } } }
        }
    }
}

fn figure(chart: &Chart) -> Markup {
    html! {
        figure title=(chart.title) data-chart=(chart.id) { (PreEscaped(&chart.svg)) }
    }
}
