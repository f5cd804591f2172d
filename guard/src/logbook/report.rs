//! A latency-distribution plot (SVG): the cumulative distribution of TTFT for one entry, or
//! two overlaid for a comparison.

use super::entry::Entry;

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 360.0;
const MARGIN: f64 = 50.0;
const COLOURS: &[&str] = &["#1f77b4", "#d62728"];

/// The SVG document.
pub fn ttft_cdf(entries: &[&Entry]) -> String {
    let max = entries
        .iter()
        .flat_map(|e| e.ttft_samples_ms.iter().copied())
        .fold(1.0_f64, f64::max);
    let x = |ms: f64| MARGIN + ms / max * (WIDTH - 2.0 * MARGIN);
    let y = |q: f64| HEIGHT - MARGIN - q * (HEIGHT - 2.0 * MARGIN);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{MARGIN}\" y=\"20\">time to first token, cumulative share of requests</text>\n\
         <line x1=\"{MARGIN}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <line x1=\"{MARGIN}\" y1=\"{MARGIN}\" x2=\"{MARGIN}\" y2=\"{}\" stroke=\"black\"/>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"end\">{max:.0} ms</text>\n\
         <text x=\"{MARGIN}\" y=\"{}\">0</text>\n",
        HEIGHT - MARGIN,
        WIDTH - MARGIN,
        HEIGHT - MARGIN,
        HEIGHT - MARGIN,
        WIDTH - MARGIN,
        HEIGHT - MARGIN + 16.0,
        HEIGHT - MARGIN + 16.0,
    );
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
        svg.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>\n\
             <text x=\"{}\" y=\"{}\" fill=\"{colour}\">{} {} (p50 {:.0} ms, p95 {:.0} ms)</text>\n",
            points.join(" "),
            MARGIN + 10.0,
            MARGIN + 16.0 * (index as f64 + 1.0),
            &entry.id[..entry.id.len().min(8)],
            entry.model,
            entry.ttft_ms.p50,
            entry.ttft_ms.p95
        ));
    }
    svg.push_str("</svg>\n");
    svg
}
