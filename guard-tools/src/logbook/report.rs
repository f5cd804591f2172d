//! `guard logbook report`: one entry, or two compared, as a self-contained HTML page (the
//! comparison table and a chart for each figure with samples), or the TTFT chart alone as SVG
//! or PNG.

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
};

use plotters::{coord::Shift, prelude::*};

use super::{
    chart::{self, BAR_SIZE, ECDF_SIZE},
    compare,
    entry::Entry,
    figures::{Distribution, Single},
    page::{self, Chart, Skipped},
};

/// TrueType files the charts' text is laid out (SVG) and drawn (PNG) with, first found used:
/// Debian's fonts-dejavu-core, then its Liberation fonts. Read at run time rather than built
/// in, so that the binary does not carry a font.
const FONTS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation2/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
];

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(
        "the charts need a TrueType font and none was found (looked for {tried}): install \
         Debian's fonts-dejavu-core"
    )]
    NoFont { tried: String },
    #[error("drawing the {chart} chart")]
    Draw {
        chart: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{}: the report is written as .html, .svg or .png", path.display())]
    Kind { path: PathBuf },
    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What `--out` asks for, by its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// The page: every figure.
    Html,
    /// The TTFT chart alone.
    Svg,
    Png,
}

impl Output {
    pub fn of(path: &Path) -> Result<Self, ReportError> {
        let extension = path.extension().and_then(|e| e.to_str());
        match extension.map(str::to_ascii_lowercase).as_deref() {
            Some("html" | "htm") => Ok(Self::Html),
            Some("svg") => Ok(Self::Svg),
            Some("png") => Ok(Self::Png),
            _ => Err(ReportError::Kind {
                path: path.to_owned(),
            }),
        }
    }
}

/// Writes the report of `entries` (one, or A then B) to `out`, as its extension says.
pub fn write(entries: &[&Entry], out: &Path) -> Result<(), ReportError> {
    let output = Output::of(out)?;
    register_font()?;
    let text = match output {
        Output::Html => html(entries)?,
        Output::Svg => svg(ECDF_SIZE, |root| {
            chart::ecdf(root, Distribution::Ttft, entries)
        })
        .map_err(drawing(Distribution::Ttft.key()))?,
        Output::Png => return png(entries, out),
    };
    std::fs::write(out, text).map_err(|source| ReportError::Write {
        path: out.to_owned(),
        source,
    })
}

/// The page: the table, then every chart that has something to draw.
pub fn html(entries: &[&Entry]) -> Result<String, ReportError> {
    register_font()?;
    let comparison = match entries {
        [a, b] => Some(compare::compare(a, b)),
        _ => None,
    };
    let (mut charts, mut skipped) = (Vec::new(), Vec::new());
    for figure in Distribution::ALL {
        let drawable = entries
            .iter()
            .any(|e| figure.samples(e).iter().any(|v| *v > 0.0));
        if !drawable {
            skipped.push(Skipped::distribution(figure, entries));
            continue;
        }
        let svg = svg(ECDF_SIZE, |root| chart::ecdf(root, figure, entries))
            .map_err(drawing(figure.key()))?;
        charts.push(Chart::new(figure.key(), figure.title(), true, svg));
    }
    for figure in Single::CHARTED {
        if entries.iter().all(|e| figure.value(e).is_none()) {
            skipped.push(Skipped::unmeasured(figure));
            continue;
        }
        let svg = svg(BAR_SIZE, |root| chart::bars(root, figure, entries))
            .map_err(drawing(figure.key()))?;
        charts.push(Chart::new(figure.key(), figure.name(), false, svg));
    }
    Ok(page::page(entries, comparison.as_ref(), &charts, &skipped))
}

type Drawn<E> = Result<(), DrawingAreaErrorKind<E>>;

/// A chart drawn into an SVG document.
fn svg(
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend<'_>, Shift>) -> Drawn<std::io::Error>,
) -> Result<String, DrawingAreaErrorKind<std::io::Error>> {
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, size).into_drawing_area();
        draw(&root)?;
        root.present()?;
    }
    Ok(text)
}

/// The TTFT chart as a PNG file.
fn png(entries: &[&Entry], out: &Path) -> Result<(), ReportError> {
    let root = BitMapBackend::new(out, ECDF_SIZE).into_drawing_area();
    chart::ecdf(&root, Distribution::Ttft, entries)
        .and_then(|()| root.present())
        .map_err(drawing(Distribution::Ttft.key()))
}

fn drawing<E: std::error::Error + Send + Sync + 'static>(
    chart: &str,
) -> impl FnOnce(DrawingAreaErrorKind<E>) -> ReportError + '_ {
    move |source| ReportError::Draw {
        chart: chart.to_owned(),
        source: Box::new(source),
    }
}

/// Gives plotters the charts' font, once a process.
fn register_font() -> Result<(), ReportError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let registered = *REGISTERED.get_or_init(|| {
        let found = FONTS.iter().find_map(|path| std::fs::read(path).ok());
        // plotters keeps the font for the process: leaked once, on purpose.
        let bytes: Option<&'static [u8]> = found.map(|bytes| &*Vec::leak(bytes));
        bytes.is_some_and(|bytes| {
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
        })
    });
    match registered {
        true => Ok(()),
        false => Err(ReportError::NoFont {
            tried: FONTS.join(", "),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logbook::entry::fixture as entry;

    #[test]
    fn a_model_name_cannot_inject_markup() {
        let hostile = entry("m</text><script>x</script>&");
        let page = html(&[&hostile]).expect("a page");
        assert!(!page.contains("<script>"), "{page}");
        assert!(page.contains("m&lt;/text&gt;&lt;script&gt;x&lt;/script&gt;&amp;"));
    }

    #[test]
    fn an_older_entry_without_runs_still_gets_its_ttft_chart() {
        let old = entry("smollm2");
        let page = html(&[&old, &old]).expect("a page");
        assert_eq!(page.matches("<svg id=\"chart-ttft\"").count(), 1, "{page}");
        // Only TTFT kept its samples then; the rest is said, not drawn.
        assert!(!page.contains("id=\"chart-completion\""));
        assert!(page.contains("completion time: no samples"), "{page}");
    }

    #[test]
    fn a_figure_measured_on_one_side_only_is_drawn_with_the_other_said_unavailable() {
        let a = entry("m");
        let mut b = entry("m");
        b.energy_joules = crate::logbook::entry::Maybe::Value(12.5);
        let page = html(&[&a, &b]).expect("a page");
        let start = page
            .find("<svg id=\"chart-energy\"")
            .expect("the energy chart");
        let chart = &page[start..start + page[start..].find("</svg>").expect("its end")];
        // B's bar in B's colour, none in A's: A's place says why.
        assert!(chart.contains("fill=\"#D55E00\""), "{chart}");
        assert!(!chart.contains("fill=\"#0072B2\""), "{chart}");
        assert!(chart.contains("\nunavailable\n"), "{chart}");
        assert!(
            page.contains("mean power: unavailable"),
            "neither side measured it"
        );
    }

    #[test]
    fn the_extension_picks_the_output() {
        assert_eq!(Output::of(Path::new("r.HTML")).ok(), Some(Output::Html));
        assert_eq!(Output::of(Path::new("r.png")).ok(), Some(Output::Png));
        assert!(matches!(
            Output::of(Path::new("r.pdf")),
            Err(ReportError::Kind { .. })
        ));
    }
}
