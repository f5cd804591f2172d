//! A latency-distribution plot (SVG): the cumulative distribution of TTFT for one entry, or
//! two overlaid for a comparison.

use svg::{
    Document,
    node::element::{Line, Polyline, Rectangle, Text},
};

use super::entry::Entry;

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 360.0;
const MARGIN: f64 = 50.0;
const COLOURS: &[&str] = &["#1f77b4", "#d62728"];

/// The SVG document. Text from an entry (its model name) is escaped by the `svg` crate.
pub fn ttft_cdf(entries: &[&Entry]) -> String {
    let max = entries
        .iter()
        .flat_map(|e| e.ttft_samples_ms.iter().copied())
        .fold(1.0_f64, f64::max);
    let x = |ms: f64| MARGIN + ms / max * (WIDTH - 2.0 * MARGIN);
    let y = |q: f64| HEIGHT - MARGIN - q * (HEIGHT - 2.0 * MARGIN);
    let bottom = HEIGHT - MARGIN;
    let axis = |x1, y1, x2, y2| {
        Line::new()
            .set("x1", x1)
            .set("y1", y1)
            .set("x2", x2)
            .set("y2", y2)
            .set("stroke", "black")
    };
    let label = |at_x: f64, at_y: f64, text: String| Text::new(text).set("x", at_x).set("y", at_y);
    let mut document = Document::new()
        .set("width", WIDTH)
        .set("height", HEIGHT)
        .set("font-family", "sans-serif")
        .set("font-size", 12)
        .add(
            Rectangle::new()
                .set("width", "100%")
                .set("height", "100%")
                .set("fill", "white"),
        )
        .add(label(
            MARGIN,
            20.0,
            "time to first token, cumulative share of requests".to_owned(),
        ))
        .add(axis(MARGIN, bottom, WIDTH - MARGIN, bottom))
        .add(axis(MARGIN, MARGIN, MARGIN, bottom))
        .add(label(WIDTH - MARGIN, bottom + 16.0, format!("{max:.0} ms")).set("text-anchor", "end"))
        .add(label(MARGIN, bottom + 16.0, "0".to_owned()));
    for (index, entry) in entries.iter().enumerate() {
        let mut samples = entry.ttft_samples_ms.clone();
        samples.sort_by(f64::total_cmp);
        let n = samples.len().max(1) as f64;
        let points: Vec<String> = samples
            .iter()
            .enumerate()
            .map(|(i, ms)| format!("{:.1},{:.1}", x(*ms), y((i + 1) as f64 / n)))
            .collect();
        let colour = COLOURS[index % COLOURS.len()];
        let legend = format!(
            "{} {} (p50 {:.0} ms, p95 {:.0} ms)",
            &entry.id[..entry.id.len().min(8)],
            entry.model,
            entry.ttft_ms.p50,
            entry.ttft_ms.p95
        );
        document = document
            .add(
                Polyline::new()
                    .set("fill", "none")
                    .set("stroke", colour)
                    .set("stroke-width", 2)
                    .set("points", points.join(" ")),
            )
            .add(
                label(MARGIN + 10.0, MARGIN + 16.0 * (index as f64 + 1.0), legend)
                    .set("fill", colour),
            );
    }
    format!("{document}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_name_cannot_inject_markup() {
        let line = r#"{"id":"0123456789ab","recorded_at":"2026-12-04T10:00:00Z","command":"c","model":"m</text><script>x</script>&","model_digest":"d","runtime":"r","runtime_version":"v","launch_flags":"","api":"openai","url":"u","workload_class":"w","input_set":{"path":"p","sha256":"s","inputs":1},"repetitions":1,"cold_start_ms":"unavailable","warm_start_ms":1.0,"ttft_ms":{"p50":1.0,"p95":2.0,"run_p50_min":1.0,"run_p50_max":1.0},"completion_ms":{"p50":1.0,"p95":2.0,"run_p50_min":1.0,"run_p50_max":1.0},"decode_tokens_per_second":{"p50":1.0,"p95":2.0,"run_p50_min":1.0,"run_p50_max":1.0},"queue_delay_ms":{"p50":0.0,"p95":0.0,"run_p50_min":0.0,"run_p50_max":0.0},"peak_server_rss_bytes":"unavailable","peak_gpu_memory_bytes":"unavailable","energy_joules":"unavailable","mean_power_watts":"unavailable","quality_failures":0,"abstentions":0,"ttft_samples_ms":[1.0,2.0,3.0],"decision":"d","owner":"o","retest_date":"2027-01-03"}"#;
        let entry: Entry = serde_json::from_str(line).expect("an entry as the logbook stores it");
        let plot = ttft_cdf(&[&entry]);
        assert!(plot.starts_with("<svg") && plot.contains("<polyline"));
        assert!(!plot.contains("<script>"), "{plot}");
        assert!(plot.contains("m&lt;/text&gt;&lt;script&gt;x&lt;/script&gt;&amp;"));
    }
}
