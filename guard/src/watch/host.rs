//! Host readings from procfs: swap, swap-in and swap-out rates, PSI, and the inference
//! server's own RSS, CPU and threads.

use std::time::Instant;

use procfs::Current as _;
use prometheus::{Gauge, IntGauge};

use crate::{
    config::Config,
    metrics::{
        Family, Gauges, Metrics,
        labels::{ByResource, Resource},
    },
};

/// One sample; `None` where the kernel does not offer the reading.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct HostReading {
    pub swap_used_bytes: Option<u64>,
    pub swap_total_bytes: Option<u64>,
    pub swap_in_pages_per_second: Option<f64>,
    pub swap_out_pages_per_second: Option<f64>,
    /// PSI memory "full" avg10, 0..1.
    pub memory_pressure: Option<f64>,
    pub psi_available: bool,
    pub upstream_pid: Option<i32>,
    pub upstream_rss_bytes: Option<u64>,
}

pub struct HostWatcher {
    swap_used: IntGauge,
    swap_total: IntGauge,
    swap_in: Gauge,
    swap_out: Gauge,
    pressure_waiting: Gauges<ByResource>,
    pressure_stalled: Gauges<ByResource>,
    psi_available: IntGauge,
    upstream_rss: IntGauge,
    upstream_threads: IntGauge,
    upstream_cpu: prometheus::Counter,
    last_vmstat: Option<(Instant, i64, i64)>,
    configured_pid: Option<i32>,
    upstream_port: Option<u16>,
    found_pid: Option<i32>,
    psi_warned: bool,
}

impl HostWatcher {
    pub fn new(metrics: &Metrics, config: &Config) -> Self {
        let gauge = |name: &str, help: &str| {
            let g = Gauge::new(name, help).expect("valid gauge");
            metrics.register(Box::new(g.clone()));
            g
        };
        let int_gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid gauge");
            metrics.register(Box::new(g.clone()));
            g
        };
        let gauge_vec = |name: &str, help: &str| {
            let g = Family::gauge(name, help);
            metrics.register(g.collector());
            g
        };
        let upstream_cpu = prometheus::Counter::new(
            "guard_upstream_cpu_seconds_total",
            "CPU time the inference server process has used.",
        )
        .expect("valid counter");
        metrics.register(Box::new(upstream_cpu.clone()));
        Self {
            swap_used: int_gauge("guard_swap_used_bytes", "Swap in use."),
            swap_total: int_gauge("guard_swap_total_bytes", "Swap configured."),
            swap_in: gauge(
                "guard_swap_in_pages_per_second",
                "Pages swapped in per second (vmstat pswpin).",
            ),
            swap_out: gauge(
                "guard_swap_out_pages_per_second",
                "Pages swapped out per second (vmstat pswpout).",
            ),
            pressure_waiting: gauge_vec(
                "guard_pressure_waiting_ratio",
                "PSI some avg10: share of time some tasks waited for the resource.",
            ),
            pressure_stalled: gauge_vec(
                "guard_pressure_stalled_ratio",
                "PSI full avg10: share of time all non-idle tasks stalled on the resource.",
            ),
            psi_available: int_gauge(
                "guard_psi_available",
                "1 where the kernel offers PSI (/proc/pressure).",
            ),
            upstream_rss: int_gauge(
                "guard_upstream_rss_bytes",
                "Resident memory of the inference server process.",
            ),
            upstream_threads: int_gauge(
                "guard_upstream_threads",
                "Threads of the inference server process.",
            ),
            upstream_cpu,
            last_vmstat: None,
            configured_pid: (config.watch.upstream_pid != 0)
                .then_some(config.watch.upstream_pid as i32),
            upstream_port: Some(config.upstream.url.port()),
            found_pid: None,
            psi_warned: false,
        }
    }

    pub fn sample(&mut self) -> HostReading {
        let mut reading = HostReading::default();
        if let Ok(meminfo) = procfs::Meminfo::current() {
            let used = meminfo.swap_total.saturating_sub(meminfo.swap_free);
            reading.swap_total_bytes = Some(meminfo.swap_total);
            reading.swap_used_bytes = Some(used);
            self.swap_total.set(meminfo.swap_total as i64);
            self.swap_used.set(used as i64);
        }
        if let Ok(vmstat) = procfs::vmstat() {
            let now = Instant::now();
            let (pswpin, pswpout) = (
                vmstat.get("pswpin").copied().unwrap_or(0),
                vmstat.get("pswpout").copied().unwrap_or(0),
            );
            if let Some((then, last_in, last_out)) = self.last_vmstat {
                let seconds = now.duration_since(then).as_secs_f64().max(1e-3);
                let swap_in = rate(last_in, pswpin, seconds);
                let swap_out = rate(last_out, pswpout, seconds);
                self.swap_in.set(swap_in);
                self.swap_out.set(swap_out);
                reading.swap_in_pages_per_second = Some(swap_in);
                reading.swap_out_pages_per_second = Some(swap_out);
            }
            self.last_vmstat = Some((now, pswpin, pswpout));
        }
        self.sample_pressure(&mut reading);
        self.sample_upstream(&mut reading);
        reading
    }

    fn sample_pressure(&mut self, reading: &mut HostReading) {
        let cpu = procfs::CpuPressure::current();
        let memory = procfs::MemoryPressure::current();
        let io = procfs::IoPressure::current();
        reading.psi_available = cpu.is_ok() && memory.is_ok();
        self.psi_available.set(i64::from(reading.psi_available));
        if !reading.psi_available {
            if !self.psi_warned {
                self.psi_warned = true;
                tracing::warn!(
                    "PSI is off: no /proc/pressure; boot with psi=1 for memory-pressure signals"
                );
            }
            return;
        }
        let set = |resource: &str, some: f32, full: Option<f32>| {
            let of = Resource { resource };
            self.pressure_waiting.of(&of).set(f64::from(some) / 100.0);
            if let Some(full) = full {
                self.pressure_stalled.of(&of).set(f64::from(full) / 100.0);
            }
        };
        if let Ok(cpu) = cpu {
            set("cpu", cpu.some.avg10, None);
        }
        if let Ok(memory) = memory {
            set("memory", memory.some.avg10, Some(memory.full.avg10));
            reading.memory_pressure = Some(f64::from(memory.full.avg10) / 100.0);
        }
        if let Ok(io) = io {
            set("io", io.some.avg10, Some(io.full.avg10));
        }
    }

    fn sample_upstream(&mut self, reading: &mut HostReading) {
        let pid = self.configured_pid.or(self.found_pid).or_else(|| {
            let found = self.upstream_port.and_then(listening_pid);
            self.found_pid = found;
            found
        });
        let Some(pid) = pid else { return };
        let stat = procfs::process::Process::new(pid).and_then(|p| p.stat());
        match stat {
            Ok(stat) => {
                let rss = stat.rss * procfs::page_size();
                let cpu = (stat.utime + stat.stime) as f64 / procfs::ticks_per_second() as f64;
                self.upstream_rss.set(rss as i64);
                self.upstream_threads.set(stat.num_threads);
                let seen = self.upstream_cpu.get();
                if cpu > seen {
                    self.upstream_cpu.inc_by(cpu - seen);
                }
                reading.upstream_pid = Some(pid);
                reading.upstream_rss_bytes = Some(rss);
            }
            // The server restarted: find it again next time.
            Err(_) => self.found_pid = None,
        }
    }
}

/// Events per second between two counter readings (0 across a counter reset).
fn rate(before: i64, after: i64, seconds: f64) -> f64 {
    (after - before).max(0) as f64 / seconds
}

/// The pid of the process listening on TCP `port` on this host.
pub fn listening_pid(port: u16) -> Option<i32> {
    let listening = crate::procs::tcp_sockets().find(|entry| {
        entry.state == procfs::net::TcpState::Listen && entry.local_address.port() == port
    })?;
    crate::procs::socket_holder(listening.inode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_per_second_and_never_negative() {
        assert_eq!(rate(100, 300, 2.0), 100.0);
        assert_eq!(rate(300, 100, 1.0), 0.0, "a counter reset reads as zero");
    }

    #[test]
    fn this_process_is_found_by_its_listening_port() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        assert_eq!(listening_pid(port), Some(std::process::id() as i32));
    }

    #[test]
    fn a_sample_reads_swap_and_the_upstream_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut config = Config::default();
        config.upstream.url = format!("http://{}", listener.local_addr().expect("addr"))
            .parse()
            .expect("a URL");
        let mut watcher = HostWatcher::new(&Metrics::new(), &config);
        let first = watcher.sample();
        assert!(first.swap_total_bytes.is_some());
        assert_eq!(first.upstream_pid, Some(std::process::id() as i32));
        assert!(first.upstream_rss_bytes.is_some_and(|rss| rss > 0));
        assert!(
            first.swap_in_pages_per_second.is_none(),
            "a rate needs two samples"
        );
        assert!(watcher.sample().swap_in_pages_per_second.is_some());
    }
}
