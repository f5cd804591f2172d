//! A logarithmic axis for plotters whose ticks are always labelled: plotters' own log range
//! puts ticks only at powers of ten, so a span such as 120–400 ms would have none.

use std::ops::Range;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};

/// Mantissas of the tick sets, coarsest first.
const TICK_SETS: [&[f64]; 4] = [
    &[1.0],
    &[1.0, 2.0, 5.0],
    &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
    &[
        1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0,
    ],
];

/// At least this many labelled ticks on an axis.
const MIN_TICKS: usize = 4;

#[derive(Clone, Debug)]
pub struct LogAxis {
    pub lo: f64,
    pub hi: f64,
    /// Labelled ticks and grid lines.
    bold: Vec<f64>,
    /// Unlabelled grid lines between them.
    light: Vec<f64>,
}

impl LogAxis {
    /// An axis holding every positive value, at least a factor of three from end to end (1–10
    /// where there is none), with `room` (a share of its length) kept clear at either end, for
    /// labels beside the smallest and largest values.
    pub fn around(values: impl Iterator<Item = f64>, room: f64) -> Self {
        let (min, max) = values
            .filter(|v| v.is_finite() && *v > 0.0)
            .fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        let (mut lo, mut hi) = match min.is_finite() {
            true => {
                // ln(min / lo) = ln(hi / max) = room × ln(hi / lo), solved for lo and hi.
                let pad = (room / (1.0 - 2.0 * room) * (max / min).ln())
                    .exp()
                    .max(1.2);
                (min / pad, max * pad)
            }
            false => (1.0, 10.0),
        };
        if hi / lo < 3.0 {
            let centre = (lo * hi).sqrt();
            (lo, hi) = (centre / 3.0_f64.sqrt(), centre * 3.0_f64.sqrt());
        }
        let sets: Vec<Vec<f64>> = TICK_SETS.iter().map(|set| ticks(lo, hi, set)).collect();
        let chosen = sets.iter().position(|set| set.len() >= MIN_TICKS);
        let bold = sets[chosen.unwrap_or(sets.len() - 1)].clone();
        let light = match chosen {
            Some(index) if index < 2 => sets[2].clone(),
            _ => Vec::new(),
        };
        Self {
            lo,
            hi,
            bold,
            light,
        }
    }

    /// The labelled ticks.
    #[cfg(test)]
    pub fn ticks(&self) -> &[f64] {
        &self.bold
    }
}

/// Every `mantissa × 10^k` inside `lo..=hi`.
fn ticks(lo: f64, hi: f64, mantissas: &[f64]) -> Vec<f64> {
    let first = lo.log10().floor() as i32;
    let last = hi.log10().ceil() as i32;
    let all = (first..=last).flat_map(|power| mantissas.iter().map(move |m| m * 10f64.powi(power)));
    all.filter(|v| (lo..=hi).contains(v)).collect()
}

impl Ranged for LogAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        // A value at or below zero has no place on a log axis: drawn at its left edge.
        let value = value.max(self.lo);
        let share = (value.ln() - self.lo.ln()) / (self.hi.ln() - self.lo.ln());
        limit.0 + (f64::from(limit.1 - limit.0) * share).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        match hint.weight().allow_light_points() {
            true => self.light.clone(),
            false => self.bold.clone(),
        }
    }

    fn range(&self) -> Range<f64> {
        self.lo..self.hi
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_narrow_span_still_gets_labelled_ticks() {
        let axis = LogAxis::around([150.0, 160.0, 170.0].into_iter(), 0.0);
        assert!(axis.hi / axis.lo >= 3.0 - 1e-9);
        assert!(axis.ticks().len() >= MIN_TICKS, "{:?}", axis.ticks());
        assert!(axis.ticks().iter().all(|t| (axis.lo..=axis.hi).contains(t)));
    }

    #[test]
    fn a_wide_span_is_labelled_at_powers_of_ten() {
        let axis = LogAxis::around([0.5, 20_000.0].into_iter(), 0.0);
        assert_eq!(axis.ticks(), &[1.0, 10.0, 100.0, 1_000.0, 10_000.0]);
    }

    #[test]
    fn zeros_are_left_out_of_the_range_and_drawn_at_its_edge() {
        let axis = LogAxis::around([0.0, 10.0, 100.0].into_iter(), 0.0);
        assert!(axis.lo > 0.0 && axis.lo < 10.0);
        assert_eq!(axis.map(&0.0, (0, 100)), 0);
        assert_eq!(axis.map(&axis.hi, (0, 100)), 100);
    }

    #[test]
    fn room_is_kept_at_either_end_for_labels() {
        let axis = LogAxis::around([10.0, 1_000.0].into_iter(), 0.2);
        assert_eq!(axis.map(&10.0, (0, 1_000)), 200);
        assert_eq!(axis.map(&1_000.0, (0, 1_000)), 800);
    }
}
