//! Energy per request: the box's cumulative energy counter (NVML's total energy over every
//! GPU, else RAPL package energy from powercap) shared among the requests holding upstream
//! slots, through an index of joules per held slot that a request reads when it takes its
//! slot and when it gives it back.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use nvml_wrapper::Nvml;

use crate::metrics::{Metrics, labels::Class};

/// Where the kernel lists its power-capping zones.
pub const POWERCAP_ROOT: &str = "/sys/class/powercap";

/// Which counter the box's energy is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnergySource {
    /// NVML's total energy consumption, summed over the GPUs.
    Nvml,
    /// RAPL package energy from powercap (CPU-only boxes).
    Rapl,
}

impl EnergySource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nvml => "nvml",
            Self::Rapl => "rapl",
        }
    }
}

/// One cumulative hardware counter and its last raw value.
#[derive(Debug)]
struct Counter<At> {
    at: At,
    last: u64,
    /// Where the counter wraps to 0 (RAPL's `max_energy_range_uj`); without it a counter
    /// that goes back restarted from 0 (a reloaded driver).
    range: Option<u64>,
}

impl<At> Counter<At> {
    /// The counts since the last reading, across a wrap.
    fn advance(&mut self, raw: u64) -> u64 {
        let delta = match (raw.checked_sub(self.last), self.range) {
            (Some(delta), _) => delta,
            (None, Some(range)) if self.last <= range => range - self.last + raw,
            (None, _) => raw,
        };
        self.last = raw;
        delta
    }
}

/// A RAPL package zone: `<root>/intel-rapl:N`.
#[derive(Debug)]
struct Zone {
    dir: PathBuf,
    /// The zone's own name (`package-0`).
    name: String,
}

enum Counters {
    /// GPUs by NVML index, each in mJ.
    Nvml {
        nvml: Arc<Nvml>,
        gpus: Vec<Counter<u32>>,
    },
    /// Package zones, each in µJ.
    Rapl { zones: Vec<Counter<Zone>> },
    /// Neither exists; why.
    None { why: String },
}

/// Reads the box's energy in joules from the first counter present.
pub struct EnergyReader {
    counters: Counters,
    /// Joules counted since the reader was made.
    joules: f64,
}

impl EnergyReader {
    /// Opens the first counter present: NVML's (where `nvml` reads a GPU's total energy),
    /// else the RAPL package zones under `powercap` (the kernel's is [`POWERCAP_ROOT`]).
    pub fn new(nvml: Option<Arc<Nvml>>, powercap: &Path) -> Self {
        let nvml_why = match nvml.map(open_nvml) {
            Some(Ok(counters)) => return Self::over(counters),
            Some(Err(why)) => why,
            None => "no NVIDIA driver, so no NVML".to_owned(),
        };
        match open_rapl(powercap) {
            Ok(counters) => Self::over(counters),
            Err(rapl_why) => Self::over(Counters::None {
                why: format!("{nvml_why}; {rapl_why}"),
            }),
        }
    }

    /// The host's reader: NVML loaded here, and the kernel's powercap zones.
    pub fn open_host() -> Self {
        Self::new(Nvml::init().ok().map(Arc::new), Path::new(POWERCAP_ROOT))
    }

    fn over(counters: Counters) -> Self {
        Self {
            counters,
            joules: 0.0,
        }
    }

    pub fn source(&self) -> Option<EnergySource> {
        match self.counters {
            Counters::Nvml { .. } => Some(EnergySource::Nvml),
            Counters::Rapl { .. } => Some(EnergySource::Rapl),
            Counters::None { .. } => None,
        }
    }

    /// Where it reads (`RAPL powercap intel-rapl:0 (package-0)`), or why there is nothing.
    pub fn describe(&self) -> String {
        match &self.counters {
            Counters::Nvml { gpus, .. } => {
                let gpus: Vec<String> = gpus.iter().map(|g| g.at.to_string()).collect();
                format!("NVML total energy of GPU {}", gpus.join(", "))
            }
            Counters::Rapl { zones } => {
                let zones: Vec<String> = zones
                    .iter()
                    .map(|z| format!("{} ({})", z.at.dir.display(), z.at.name))
                    .collect();
                format!("RAPL powercap {}", zones.join(", "))
            }
            Counters::None { why } => why.clone(),
        }
    }

    /// Joules since the reader was made, monotonic across the counters' wraps; `None` where
    /// there is no counter or none could be read this time (a counter that fails is skipped
    /// and counted in full at its next reading).
    pub fn read(&mut self) -> Option<f64> {
        let counted = match &mut self.counters {
            Counters::Nvml { nvml, gpus } => gpus
                .iter_mut()
                .filter_map(|gpu| Some(gpu.advance(nvml_mj(nvml, gpu.at)?) as f64 / 1e3))
                .reduce(|a, b| a + b),
            Counters::Rapl { zones } => zones
                .iter_mut()
                .filter_map(|zone| Some(zone.advance(zone_uj(&zone.at.dir)?) as f64 / 1e6))
                .reduce(|a, b| a + b),
            Counters::None { .. } => None,
        };
        self.joules += counted?;
        Some(self.joules)
    }
}

/// Every GPU whose total energy NVML reads (Volta and later), or why none.
fn open_nvml(nvml: Arc<Nvml>) -> Result<Counters, String> {
    let count = nvml.device_count().unwrap_or(0);
    let gpus: Vec<Counter<u32>> = (0..count)
        .filter_map(|at| {
            let last = nvml_mj(&nvml, at)?;
            Some(Counter {
                at,
                last,
                range: None,
            })
        })
        .collect();
    if gpus.is_empty() {
        return Err(format!(
            "NVML reads no GPU's total energy ({count} GPUs; the counter needs Volta or later)"
        ));
    }
    Ok(Counters::Nvml { nvml, gpus })
}

fn nvml_mj(nvml: &Nvml, index: u32) -> Option<u64> {
    nvml.device_by_index(index)
        .ok()?
        .total_energy_consumption()
        .ok()
}

/// Every top-level package zone (`intel-rapl:N`, named `package-N`) whose energy reads: its
/// subzones (`intel-rapl:N:M`) and a platform zone (`psys`) would count the same joules twice.
fn open_rapl(root: &Path) -> Result<Counters, String> {
    let entries = std::fs::read_dir(root).map_err(|_| format!("no {}", root.display()))?;
    let mut zones = Vec::new();
    let mut unreadable = Vec::new();
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let top_level = file_name
            .strip_prefix("intel-rapl:")
            .is_some_and(|rest| !rest.contains(':'));
        let dir = root.join(&file_name);
        let name = read_trimmed(&dir.join("name")).unwrap_or_default();
        if !top_level || !name.starts_with("package") {
            continue;
        }
        match zone_uj(&dir) {
            Some(last) => {
                let range =
                    read_trimmed(&dir.join("max_energy_range_uj")).and_then(|r| r.parse().ok());
                zones.push(Counter {
                    at: Zone { dir, name },
                    last,
                    range,
                });
            }
            None => unreadable.push(file_name),
        }
    }
    zones.sort_by(|a, b| a.at.dir.cmp(&b.at.dir));
    if !zones.is_empty() {
        Ok(Counters::Rapl { zones })
    } else if !unreadable.is_empty() {
        unreadable.sort();
        Err(format!(
            "RAPL zone {} under {} not readable (energy_uj is root's only since Linux 5.10)",
            unreadable.join(", "),
            root.display()
        ))
    } else {
        Err(format!("no RAPL package zone under {}", root.display()))
    }
}

fn zone_uj(dir: &Path) -> Option<u64> {
    read_trimmed(&dir.join("energy_uj"))?.parse().ok()
}

fn read_trimmed(path: &Path) -> Option<String> {
    Some(std::fs::read_to_string(path).ok()?.trim().to_owned())
}

/// Joules per held slot since guard started, shared with the request path: a request's share
/// is the index when it gives its slot back less the index when it took it. Kept as an f64's
/// bits, so the request path reads it without a lock.
#[derive(Debug, Default)]
pub struct EnergyIndex {
    bits: AtomicU64,
    source: Option<EnergySource>,
}

impl EnergyIndex {
    pub fn new(source: Option<EnergySource>) -> Self {
        Self {
            bits: AtomicU64::new(0.0_f64.to_bits()),
            source,
        }
    }

    /// The counter the index is fed from; `None` where the box measures no energy.
    pub fn source(&self) -> Option<EnergySource> {
        self.source
    }

    /// Each class's `guard_energy_joules_total` at 0 where the box measures energy; elsewhere
    /// the series stay absent, having no honest 0.
    pub fn init_classes<'a>(&self, metrics: &Metrics, classes: impl IntoIterator<Item = &'a str>) {
        if self.source.is_some() {
            for class in classes {
                metrics.energy_joules_total.of(&Class { class });
            }
        }
    }

    /// Joules per held slot so far; `None` where there is no energy source.
    pub fn now(&self) -> Option<f64> {
        self.source?;
        Some(f64::from_bits(self.bits.load(Ordering::Acquire)))
    }

    /// One tick: `joules` measured while `held` slots were held, shared equally among them.
    /// Energy while nothing runs is nobody's.
    pub fn apportion(&self, joules: f64, held: usize) {
        if held == 0 || !joules.is_finite() || joules <= 0.0 {
            return;
        }
        let share = joules / held as f64;
        // One writer (the sampler); the loop only makes a second one harmless.
        let _ = self
            .bits
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |bits| {
                Some((f64::from_bits(bits) + share).to_bits())
            });
    }
}

/// Feeds the index: each tick, the energy since the last and the slots held now.
pub struct EnergySampler {
    reader: EnergyReader,
    last: f64,
    index: Arc<EnergyIndex>,
}

impl EnergySampler {
    pub fn new(reader: EnergyReader) -> Self {
        let index = Arc::new(EnergyIndex::new(reader.source()));
        Self {
            reader,
            last: 0.0,
            index,
        }
    }

    pub fn index(&self) -> Arc<EnergyIndex> {
        Arc::clone(&self.index)
    }

    pub fn describe(&self) -> String {
        self.reader.describe()
    }

    /// One tick with `held` slots held now. A tick whose reading fails leaves its joules to
    /// the next.
    pub fn sample(&mut self, held: usize) {
        if let Some(joules) = self.reader.read() {
            self.index.apportion(joules - self.last, held);
            self.last = joules;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake powercap tree: zones by directory name, each with a `name`, an `energy_uj` and
    /// a `max_energy_range_uj`.
    struct Powercap(PathBuf);

    impl Powercap {
        fn new(test: &str) -> Self {
            let root =
                std::env::temp_dir().join(format!("guard-powercap-{test}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).expect("temp dir");
            Self(root)
        }

        fn zone(&self, dir: &str, name: &str, uj: u64, range: u64) -> &Self {
            let dir = self.0.join(dir);
            std::fs::create_dir_all(&dir).expect("zone dir");
            std::fs::write(dir.join("name"), format!("{name}\n")).expect("name");
            std::fs::write(dir.join("max_energy_range_uj"), format!("{range}\n")).expect("range");
            std::fs::write(dir.join("energy_uj"), format!("{uj}\n")).expect("energy");
            self
        }

        fn set(&self, zone: &str, uj: u64) {
            let file = self.0.join(zone).join("energy_uj");
            std::fs::write(file, format!("{uj}\n")).expect("energy");
        }

        fn reader(&self) -> EnergyReader {
            EnergyReader::new(None, &self.0)
        }
    }

    impl Drop for Powercap {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn only_top_level_package_zones_count() {
        let powercap = Powercap::new("zones");
        powercap
            .zone("intel-rapl:0", "package-0", 1_000_000, 1 << 40)
            .zone("intel-rapl:1", "package-1", 5_000_000, 1 << 40)
            .zone("intel-rapl:0:0", "core", 7_000_000, 1 << 40)
            .zone("intel-rapl:2", "psys", 9_000_000, 1 << 40)
            .zone("intel-rapl-mmio:0", "package-0", 9_000_000, 1 << 40);
        let mut reader = powercap.reader();
        assert_eq!(reader.source(), Some(EnergySource::Rapl));
        assert_eq!(reader.read(), Some(0.0));
        for (zone, uj) in [
            ("intel-rapl:0", 3_000_000),
            ("intel-rapl:1", 5_500_000),
            ("intel-rapl:0:0", 70_000_000),
            ("intel-rapl:2", 90_000_000),
            ("intel-rapl-mmio:0", 90_000_000),
        ] {
            powercap.set(zone, uj);
        }
        assert_eq!(reader.read(), Some(2.5));
        let described = reader.describe();
        assert!(
            described.contains("intel-rapl:0 (package-0)"),
            "{described}"
        );
        assert!(
            described.contains("intel-rapl:1 (package-1)"),
            "{described}"
        );
        assert!(!described.contains("psys") && !described.contains("core"));
    }

    #[test]
    fn a_wrapped_counter_goes_on_counting() {
        let powercap = Powercap::new("wrap");
        powercap.zone("intel-rapl:0", "package-0", 9_000_000, 10_000_000);
        let mut reader = powercap.reader();
        powercap.set("intel-rapl:0", 9_500_000);
        assert_eq!(reader.read(), Some(0.5));
        // Past the range: 0.5 J to the wrap, then 2 J after it.
        powercap.set("intel-rapl:0", 2_000_000);
        assert_eq!(reader.read(), Some(3.0));
        powercap.set("intel-rapl:0", 2_250_000);
        assert_eq!(reader.read(), Some(3.25));
    }

    #[test]
    fn a_failed_reading_is_counted_at_the_next() {
        let powercap = Powercap::new("gap");
        powercap.zone("intel-rapl:0", "package-0", 0, 1 << 40);
        let mut reader = powercap.reader();
        std::fs::remove_file(powercap.0.join("intel-rapl:0/energy_uj")).expect("remove");
        assert_eq!(reader.read(), None);
        powercap.set("intel-rapl:0", 4_000_000);
        assert_eq!(reader.read(), Some(4.0));
    }

    #[test]
    fn no_counter_is_no_source_and_says_why() {
        let powercap = Powercap::new("none");
        powercap.zone("intel-rapl:0:0", "core", 1, 10);
        let mut reader = powercap.reader();
        assert_eq!(reader.source(), None);
        assert_eq!(reader.read(), None);
        assert!(reader.describe().contains("no RAPL package zone"));
        let missing = EnergyReader::new(None, &powercap.0.join("absent"));
        let why = missing.describe();
        assert!(why.contains("no NVML") && why.ends_with("/absent"), "{why}");
        let index = EnergySampler::new(reader).index();
        index.apportion(10.0, 1);
        assert_eq!(index.now(), None);
    }

    #[test]
    fn this_host_reads_or_says_why() {
        // On a box with a GPU or RAPL zones this reads them; here, most likely, neither.
        let mut reader = EnergyReader::open_host();
        assert_eq!(
            reader.source().is_some(),
            reader.read().is_some(),
            "{}",
            reader.describe()
        );
        assert!(!reader.describe().is_empty());
    }

    /// A request's share: the index when it gives its slot back less the index when it took it.
    fn share(taken: Option<f64>, given_back: Option<f64>) -> f64 {
        given_back.expect("a source") - taken.expect("a source")
    }

    #[test]
    fn slots_share_each_tick_and_idle_energy_is_nobodys() {
        let index = EnergyIndex::new(Some(EnergySource::Nvml));
        let a_taken = index.now();
        index.apportion(10.0, 1); // a alone
        let b_taken = index.now();
        index.apportion(20.0, 2); // a and b
        let a_back = index.now();
        index.apportion(6.0, 1); // b alone
        let b_back = index.now();
        index.apportion(5.0, 0); // idle
        let (a, b) = (share(a_taken, a_back), share(b_taken, b_back));
        assert_eq!((a, b), (20.0, 16.0));
        assert_eq!(a + b, 36.0, "the idle 5 J are nobody's");
        assert_eq!(index.now(), Some(26.0));
        index.apportion(f64::NAN, 1);
        index.apportion(-3.0, 1);
        assert_eq!(index.now(), Some(26.0));
    }

    #[test]
    fn class_series_start_at_zero_only_where_energy_is_measured() {
        let (measured, unmeasured) = (Metrics::new(), Metrics::new());
        EnergyIndex::new(Some(EnergySource::Rapl)).init_classes(&measured, ["batch", "chat"]);
        EnergyIndex::new(None).init_classes(&unmeasured, ["batch", "chat"]);
        let text = measured.render();
        for class in ["batch", "chat"] {
            let line = format!("guard_energy_joules_total{{class=\"{class}\"}} 0");
            assert!(text.contains(&line), "{text}");
        }
        assert!(!unmeasured.render().contains("guard_energy_joules_total"));
    }

    #[test]
    fn the_sampler_feeds_measured_deltas_to_the_slots_held() {
        let powercap = Powercap::new("sampler");
        powercap.zone("intel-rapl:0", "package-0", 0, 100_000_000);
        let mut sampler = EnergySampler::new(powercap.reader());
        let index = sampler.index();
        assert_eq!(index.source(), Some(EnergySource::Rapl));
        powercap.set("intel-rapl:0", 12_000_000);
        sampler.sample(3);
        assert_eq!(index.now(), Some(4.0));
        powercap.set("intel-rapl:0", 30_000_000);
        sampler.sample(0);
        assert_eq!(index.now(), Some(4.0), "idle energy is nobody's");
        powercap.set("intel-rapl:0", 2_000_000); // wrapped at 100 J
        sampler.sample(2);
        assert_eq!(index.now(), Some(4.0 + 36.0));
    }
}
