//! The report's charts, drawn with plotters on any backend: a step ECDF for each distribution
//! (log axis, p50 and p95 marked, each run's p50 a tick) and labelled bars for each figure
//! measured once a run.

use plotters::{
    coord::{Shift, ranged1d::SegmentValue, types::RangedCoordf64},
    prelude::*,
    style::text_anchor::{HPos, Pos, VPos},
};

use super::{
    axis::LogAxis,
    entry::Entry,
    figures::{Distribution, Quantile, Single, Unit, plain},
};

/// A's and B's colours (the Okabe–Ito blue and vermillion: told apart by colour-blind readers).
pub const COLOURS: [RGBColor; 2] = [RGBColor(0, 114, 178), RGBColor(213, 94, 0)];
pub const ECDF_SIZE: (u32, u32) = (660, 480);
pub const BAR_SIZE: (u32, u32) = (320, 280);
/// Tick labels, legend and marks; plotters writes SVG text at 1/1.24 of this.
const LABEL: u32 = 16;
/// The share of a distribution's axis kept clear at either end: room for the p50 and p95
/// labels of the fastest and the slowest entry.
const LABEL_ROOM: f64 = 0.14;
const GUIDE: RGBColor = RGBColor(150, 150, 150);

type Drawn<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;
type Ecdf<'a, DB> = ChartContext<'a, DB, Cartesian2d<LogAxis, RangedCoordf64>>;

/// The entry's name in the report: A, then B.
pub fn letter(index: usize) -> &'static str {
    ["A", "B"].get(index).copied().unwrap_or("?")
}

/// The entry's name in the report's charts and page: its letter and short id.
pub fn name(index: usize, entry: &Entry) -> String {
    format!("{} {}", letter(index), entry.short_id())
}

/// The entry's colour, for its curves, bars and column heading.
pub fn colour(index: usize) -> RGBColor {
    COLOURS[index % COLOURS.len()]
}

/// The distribution of `figure` in each entry, as cumulative shares of requests; the legend
/// below the plot, never over the curves.
pub fn ecdf<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    figure: Distribution,
    entries: &[&Entry],
) -> Drawn<DB> {
    root.fill(&WHITE)?;
    let legend_height = 24 * (entries.len() as u32 + 1) + 8;
    let height = root.dim_in_pixel().1.saturating_sub(legend_height);
    let (top, bottom) = root.split_vertically(height);
    let samples: Vec<Vec<f64>> = entries.iter().map(|e| sorted(figure.samples(e))).collect();
    let axis = LogAxis::around(samples.iter().flatten().copied(), LABEL_ROOM);
    let (lo, hi) = (axis.lo, axis.hi);
    let mut chart = ChartBuilder::on(&top)
        .caption(figure.title(), ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(48)
        .y_label_area_size(62)
        .build_cartesian_2d(axis, 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc(format!(
            "{} ({}, log scale)",
            figure.name(),
            figure.unit().symbol()
        ))
        .y_desc("share of requests at or below")
        .x_label_formatter(&|v| plain(*v))
        .y_label_formatter(&|v| format!("{:.0}%", v * 100.0))
        .label_style(("sans-serif", LABEL))
        .axis_desc_style(("sans-serif", LABEL + 1))
        .bold_line_style(RGBColor(215, 215, 215))
        .light_line_style(RGBColor(242, 242, 242))
        .draw()?;
    for share in [0.5, 0.95] {
        let guide = DashedLineSeries::new([(lo, share), (hi, share)], 5, 4, GUIDE.into());
        chart.draw_series(guide)?;
    }
    for (index, (entry, sorted)) in entries.iter().zip(&samples).enumerate() {
        let colour = colour(index);
        chart.draw_series(LineSeries::new(
            steps(sorted, lo, hi),
            colour.stroke_width(2),
        ))?;
        chart.draw_series(run_ticks(figure, entry, colour))?;
        marks(&mut chart, figure, entries, index)?;
    }
    legend(&bottom, figure, entries)
}

fn sorted(mut samples: Vec<f64>) -> Vec<f64> {
    samples.sort_by(f64::total_cmp);
    samples
}

/// The empirical CDF as a step line: flat between samples, a rise of 1/n at each.
fn steps(sorted: &[f64], lo: f64, hi: f64) -> Vec<(f64, f64)> {
    if sorted.is_empty() {
        return Vec::new();
    }
    let n = sorted.len() as f64;
    let mut points = vec![(lo, 0.0)];
    for (index, value) in sorted.iter().enumerate() {
        points.push((*value, index as f64 / n));
        points.push((*value, (index + 1) as f64 / n));
    }
    points.push((hi, 1.0));
    points
}

/// Each run's p50 as a short upright tick across the 50% line; for an entry recorded before
/// the logbook kept runs, the range of the runs' p50s as a bar along it.
fn run_ticks(
    figure: Distribution,
    entry: &Entry,
    colour: RGBColor,
) -> Vec<PathElement<(f64, f64)>> {
    let values = figure.run_values(entry, 0.5);
    if values.is_empty() {
        let spread = figure.spread(entry);
        let points = vec![(spread.run_p50_min, 0.5), (spread.run_p50_max, 0.5)];
        return vec![PathElement::new(points, colour.mix(0.5).stroke_width(6))];
    }
    let tick = |v: f64| PathElement::new(vec![(v, 0.46), (v, 0.54)], colour.stroke_width(2));
    values.into_iter().map(tick).collect()
}

/// The entry's p50 and p95 as dots with their values. A label goes where the other entry's
/// curve is not: below and right of the slower entry's dot (left where the plot ends first),
/// above and left of the faster one's.
fn marks<DB: DrawingBackend>(
    chart: &mut Ecdf<'_, DB>,
    figure: Distribution,
    entries: &[&Entry],
    index: usize,
) -> Drawn<DB> {
    let colour = colour(index);
    let right_edge = chart.plotting_area().get_pixel_range().0.end;
    for quantile in [Quantile::P50, Quantile::P95] {
        let (name, share) = (quantile.name(), quantile.share());
        let value_of = |e: &Entry| quantile.of(figure.spread(e));
        let value = value_of(entries[index]);
        let highest = entries.iter().all(|e| value_of(e) <= value);
        // The unit is the axis': the label stays short enough for the room kept for it.
        let text = format!("{name} {}", plain(value));
        let style = TextStyle::from(("sans-serif", LABEL).into_font()).color(&colour);
        let (width, _) = chart.plotting_area().estimate_text_size(&text, &style)?;
        let room = chart.backend_coord(&(value, share)).0 + 10 + width as i32 <= right_edge;
        let (offset, pos) = match (highest, room) {
            (true, true) => ((8, 6), Pos::new(HPos::Left, VPos::Top)),
            (true, false) => ((-8, 6), Pos::new(HPos::Right, VPos::Top)),
            (false, _) => ((-8, -6), Pos::new(HPos::Right, VPos::Bottom)),
        };
        let mark = EmptyElement::at((value, share))
            + Circle::new((0, 0), 5, colour.filled())
            + Text::new(text, offset, style.pos(pos));
        chart.plotting_area().draw(&mark)?;
    }
    Ok(())
}

/// One line an entry, then the key to the marks.
fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    figure: Distribution,
    entries: &[&Entry],
) -> Drawn<DB> {
    let font = ("sans-serif", LABEL).into_font();
    let unit = figure.unit().symbol();
    for (index, entry) in entries.iter().enumerate() {
        let colour = colour(index);
        let y = 12 + 24 * index as i32;
        let spread = figure.spread(entry);
        let line = format!(
            "{}  {}:  {} requests,  p50 {} {unit},  p95 {} {unit}",
            name(index, entry),
            super::truncate(&entry.model, 24),
            figure.samples(entry).len(),
            plain(spread.p50),
            plain(spread.p95),
        );
        area.draw(&PathElement::new(
            vec![(20, y), (52, y)],
            colour.stroke_width(3),
        ))?;
        area.draw(&Text::new(line, (62, y - 8), font.clone().color(&colour)))?;
    }
    let y = 12 + 24 * entries.len() as i32;
    let grey = font.color(&RGBColor(90, 90, 90));
    area.draw(&Circle::new((36, y), 5, GUIDE.filled()))?;
    area.draw(&Text::new(
        "p50 and p95 of all requests",
        (62, y - 8),
        grey.clone(),
    ))?;
    area.draw(&PathElement::new(
        vec![(330, y - 7), (330, y + 7)],
        GUIDE.stroke_width(2),
    ))?;
    area.draw(&Text::new("each run's own p50", (342, y - 8), grey))?;
    Ok(())
}

/// `figure` of each entry as a bar with its value written above it.
pub fn bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    figure: Single,
    entries: &[&Entry],
) -> Drawn<DB> {
    root.fill(&WHITE)?;
    let unit = figure.unit();
    let values: Vec<Option<f64>> = entries.iter().map(|e| figure.value(e)).collect();
    let max = values.iter().flatten().copied().fold(0.0, f64::max);
    let top = if max > 0.0 { max * 1.3 } else { 1.0 };
    let labels: Vec<String> = (entries.iter().enumerate())
        .map(|(i, e)| name(i, e))
        .collect();
    let mut chart = ChartBuilder::on(root)
        .caption(
            format!("{} ({})", figure.name(), unit.symbol()),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(58)
        // plotters' integer ranges hold their end: one segment an entry.
        .build_cartesian_2d((0..entries.len() as i32 - 1).into_segmented(), 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .y_label_formatter(&|v| tick(unit, *v))
        .y_labels(6)
        .label_style(("sans-serif", LABEL))
        .bold_line_style(RGBColor(225, 225, 225))
        .light_line_style(WHITE)
        .draw()?;
    for (index, value) in values.iter().enumerate() {
        let colour = colour(index);
        let at = index as i32;
        if let Some(value) = value {
            let corners = [
                (SegmentValue::Exact(at), 0.0),
                (SegmentValue::Exact(at + 1), *value),
            ];
            let mut bar = Rectangle::new(corners, colour.filled());
            bar.set_margin(0, 0, 22, 22);
            chart.draw_series([bar])?;
        }
        let text = value.map_or("unavailable".to_owned(), |v| unit.show(v));
        let style = TextStyle::from(("sans-serif", LABEL + 1).into_font())
            .color(&RGBColor(30, 30, 30))
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        let label = EmptyElement::at((SegmentValue::CenterOf(at), value.unwrap_or(0.0)))
            + Text::new(text, (0, -4), style);
        chart.plotting_area().draw(&label)?;
    }
    Ok(())
}

/// A y-axis label: counts only at whole numbers.
fn tick(unit: Unit, value: f64) -> String {
    match unit {
        Unit::Count if (value - value.round()).abs() > 1e-9 => String::new(),
        _ => unit.show(value),
    }
}
