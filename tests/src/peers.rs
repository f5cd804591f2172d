//! The peers guard is measured against and the balancers it feeds, all from Debian packages:
//! nginx (a fixed upstream, and a `proxy_pass` with upstream keepalive), HAProxy, and `wrk`
//! as the load generator. Each server runs in the foreground in a directory of its own and
//! stops when dropped.

use std::{
    net::SocketAddr,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{TempDir, free_addr};

const NGINX: &str = "/usr/sbin/nginx";
const HAPROXY: &str = "/usr/sbin/haproxy";
const WRK: &str = "/usr/bin/wrk";
/// How long a peer may take to start listening.
const READY_BOUND: Duration = Duration::from_secs(20);

/// A server process of a peer, killed on drop.
pub struct Peer {
    pub addr: SocketAddr,
    child: Child,
    /// Where it runs: its config and its log.
    dir: TempDir,
}

impl Drop for Peer {
    /// SIGTERM first: nginx's master stops its workers on it, where a SIGKILL would leave
    /// them running, orphaned, after the test or benchmark.
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        if nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).is_ok() {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Peer {
    /// nginx answering `routes` (path prefix, JSON body) with 200, and `fallback` elsewhere.
    pub fn nginx_fixed(routes: &[(&str, &str)], fallback: &str) -> Self {
        let mut locations = String::new();
        for (path, body) in routes {
            locations.push_str(&format!(
                "location {path} {{ default_type application/json; return 200 '{}'; }}\n",
                escape_nginx(body)
            ));
        }
        locations.push_str(&format!(
            "location / {{ default_type application/json; return 200 '{}'; }}\n",
            escape_nginx(fallback)
        ));
        Self::nginx("nginx-upstream", &locations, None)
    }

    /// nginx's `proxy_pass` to `upstream` with a kept-alive upstream pool, streaming both
    /// ways (no request or response buffering), as one puts it in front of an inference
    /// server.
    pub fn nginx_proxy(upstream: SocketAddr) -> Self {
        Self::nginx_proxy_logged(upstream, None)
    }

    /// `nginx_proxy`, writing a JSON access log line a request to `log` where given (fields
    /// like guard's, in a 64 KiB buffer flushed each second: nginx's cheapest way).
    pub fn nginx_proxy_logged(upstream: SocketAddr, log: Option<&std::path::Path>) -> Self {
        // The format is the http block's, the log the location's (the http block says off).
        let (format, log) = log
            .map(|log| {
                (
                "log_format line escape=json '{\"time\":\"$time_iso8601\",\"id\":\"$request_id\",\
                 \"client\":\"$remote_addr:$remote_port\",\"method\":\"$request_method\",\
                 \"path\":\"$uri\",\"status\":$status,\"duration_s\":$request_time,\
                 \"bytes_in\":$request_length,\"bytes_out\":$bytes_sent}';\n"
                    .to_owned(),
                format!("access_log {} line buffer=64k flush=1s;\n", log.display()),
            )
            })
            .unwrap_or_default();
        let location = format!(
            "location / {{\n{log}\
             proxy_pass http://backend;\n\
             proxy_http_version 1.1;\n\
             proxy_set_header Connection \"\";\n\
             proxy_buffering off;\n\
             proxy_request_buffering off;\n\
             proxy_read_timeout 300s;\n\
             }}\n"
        );
        let pool = format!("upstream backend {{ server {upstream}; keepalive 512; }}\n{format}");
        Self::nginx("nginx-proxy", &location, Some(&pool))
    }

    fn nginx(name: &str, locations: &str, upstream_block: Option<&str>) -> Self {
        let dir = TempDir::new(&format!("{name}-{}", free_addr().port()));
        let addr = free_addr();
        let prefix = dir.0.display();
        let config = format!(
            "user root;\nworker_processes auto;\npid {prefix}/nginx.pid;\n\
             error_log {prefix}/error.log warn;\n\
             events {{ worker_connections 4096; }}\n\
             http {{\n\
             access_log off;\n\
             client_body_temp_path {prefix}/body;\n\
             proxy_temp_path {prefix}/proxy;\n\
             fastcgi_temp_path {prefix}/fastcgi;\n\
             uwsgi_temp_path {prefix}/uwsgi;\n\
             scgi_temp_path {prefix}/scgi;\n\
             client_max_body_size 0;\n\
             keepalive_requests 1000000;\n\
             keepalive_timeout 300s;\n\
             {}\
             server {{\nlisten {addr} reuseport backlog=4096;\n{locations}}}\n}}\n",
            upstream_block.unwrap_or("")
        );
        let path = dir.0.join("nginx.conf");
        std::fs::write(&path, config).expect("write nginx.conf");
        let mut command = Command::new(NGINX);
        command
            .arg("-p")
            .arg(&dir.0)
            .arg("-c")
            .arg(&path)
            .args(["-g", "daemon off;"]);
        Self::spawn(command, addr, dir, "nginx")
    }

    /// HAProxy in HTTP mode in front of `upstream`, reusing server connections, with
    /// `http-no-delay` as in front of a token stream (by default it holds small frames back
    /// to send them together: 81 ms a frame in one run).
    pub fn haproxy(upstream: SocketAddr) -> Self {
        let dir = TempDir::new(&format!("haproxy-{}", free_addr().port()));
        let addr = free_addr();
        let config = format!(
            "global\n  maxconn 4096\n\
             defaults\n  mode http\n  timeout connect 5s\n  timeout client 300s\n  timeout server 300s\n  \
             option http-keep-alive\n  option http-no-delay\n  http-reuse always\n\
             frontend front\n  bind {addr}\n  default_backend back\n\
             backend back\n  server upstream {upstream}\n"
        );
        let path = dir.0.join("haproxy.cfg");
        std::fs::write(&path, config).expect("write haproxy.cfg");
        let mut command = Command::new(HAPROXY);
        command.arg("-db").arg("-f").arg(&path);
        Self::spawn(command, addr, dir, "haproxy")
    }

    /// HAProxy balancing round robin over `servers` (each a guard's proxy address and, where
    /// given, its agent-check address, asked every 200 ms), with a stats page on `stats`.
    pub fn haproxy_balancer(
        servers: &[(SocketAddr, Option<SocketAddr>)],
        stats: SocketAddr,
    ) -> Self {
        let dir = TempDir::new(&format!("haproxy-lb-{}", free_addr().port()));
        let addr = free_addr();
        let mut backend = String::new();
        for (i, (server, agent)) in servers.iter().enumerate() {
            let agent = agent.map_or(String::new(), |a| {
                format!(
                    " agent-check agent-addr {} agent-port {} agent-inter 200ms",
                    a.ip(),
                    a.port()
                )
            });
            backend.push_str(&format!(
                "  server box{i} {server} check inter 200ms weight 100{agent}\n"
            ));
        }
        let config = format!(
            "global\n  maxconn 4096\n\
             defaults\n  mode http\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n  \
             option http-keep-alive\n\
             frontend front\n  bind {addr}\n  default_backend fleet\n\
             frontend stats\n  bind {stats}\n  stats enable\n  stats uri /stats\n\
             backend fleet\n  balance roundrobin\n{backend}"
        );
        let path = dir.0.join("haproxy.cfg");
        std::fs::write(&path, config).expect("write haproxy.cfg");
        let mut command = Command::new(HAPROXY);
        command.arg("-db").arg("-f").arg(&path);
        Self::spawn(command, addr, dir, "haproxy")
    }

    /// Starts `command` and waits until `addr` accepts connections.
    pub fn spawn(mut command: Command, addr: SocketAddr, dir: TempDir, name: &str) -> Self {
        let log = std::fs::File::create(dir.0.join("output.log")).expect("create log");
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|err| panic!("start {name} (run `cargo xtask setup`): {err}"));
        let mut peer = Self { addr, child, dir };
        peer.wait_listening(name);
        peer
    }

    fn wait_listening(&mut self, name: &str) {
        let started = Instant::now();
        while std::net::TcpStream::connect(self.addr).is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = std::fs::read_to_string(self.dir.0.join("output.log"));
                panic!("{name} exited with {status}: {}", log.unwrap_or_default());
            }
            assert!(started.elapsed() < READY_BOUND, "{name} did not listen");
            // Polling a port the child has not bound yet: no event to wait on.
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// nginx's `return` takes a quoted string: escape its quote and backslash.
fn escape_nginx(body: &str) -> String {
    body.replace('\\', "\\\\").replace('\'', "\\'")
}

/// CPU time, in user space and in the kernel.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuTime {
    pub user: Duration,
    pub system: Duration,
}

impl CpuTime {
    pub fn total(self) -> Duration {
        self.user + self.system
    }

    /// What was used between `earlier` and this.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }
}

/// `pid`'s process and its child processes (nginx's workers); none where it is gone.
fn family(pid: u32) -> Vec<procfs::process::Process> {
    let open = |pid: u32| procfs::process::Process::new(i32::try_from(pid).ok()?).ok();
    let Some(process) = open(pid) else {
        return Vec::new();
    };
    let children: Vec<u32> = process
        .tasks()
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|task| task.children().ok())
        .flatten()
        .collect();
    std::iter::once(process)
        .chain(children.into_iter().filter_map(open))
        .collect()
}

/// The CPU time `pid` and its child processes (nginx's workers) have used, all threads.
pub fn cpu_time(pid: u32) -> CpuTime {
    let (user, system) = family(pid)
        .iter()
        .filter_map(|process| process.stat().ok())
        .fold((0, 0), |(user, system), stat| {
            (user + stat.utime, system + stat.stime)
        });
    let seconds = |t: u64| Duration::from_secs_f64(t as f64 / procfs::ticks_per_second() as f64);
    CpuTime {
        user: seconds(user),
        system: seconds(system),
    }
}

/// The CPU time `pid` and its child processes have used, all threads (those ended too), to
/// the nanosecond: each process's CPU clock, where `cpu_time`'s clock ticks are 10 ms apart
/// (1 % of a 3 s load at a quarter of a core).
pub fn cpu_run_time(pid: u32) -> Duration {
    let processes = family(pid);
    assert!(!processes.is_empty(), "process {pid} is gone");
    processes
        .iter()
        .map(|process| {
            let pid = nix::unistd::Pid::from_raw(process.pid);
            let clock = nix::time::clock_getcpuclockid(pid).expect("a process's CPU clock");
            Duration::from(nix::time::clock_gettime(clock).expect("read a CPU clock"))
        })
        .sum()
}

/// What one `wrk` run measured.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    pub requests: u64,
    pub requests_per_second: f64,
    pub p50: Duration,
    pub p99: Duration,
    /// Requests that failed or got a status other than 2xx/3xx.
    pub errors: u64,
}

/// A closed-loop load of POST `body` to `path` from `connections` kept-alive clients.
pub struct Wrk {
    pub connections: usize,
    pub duration: Duration,
    pub threads: usize,
}

impl Wrk {
    pub fn run(&self, addr: SocketAddr, path: &str, body: &str) -> Load {
        self.run_paced(addr, path, body, None)
    }

    /// `run`, each connection resting `pause` after each answer: a load below what the
    /// machine can serve, whose CPU per request no longer swings with how the scheduler
    /// shares out a saturated machine.
    pub fn run_paced(
        &self,
        addr: SocketAddr,
        path: &str,
        body: &str,
        pause: Option<Duration>,
    ) -> Load {
        // Runs side by side each take a directory of their own.
        static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = TempDir::new(&format!("wrk-{run}"));
        let script = dir.0.join("post.lua");
        let mut text = wrk_script(body);
        if let Some(pause) = pause {
            text.push_str(&format!(
                "function delay() return {} end\n",
                pause.as_millis()
            ));
        }
        std::fs::write(&script, text).expect("write the wrk script");
        let output = Command::new(WRK)
            .arg(format!("-t{}", self.threads.min(self.connections)))
            .arg(format!("-c{}", self.connections))
            .arg(format!("-d{}s", self.duration.as_secs().max(1)))
            .args(["--timeout", "10s", "-s"])
            .arg(&script)
            .arg(format!("http://{addr}{path}"))
            .output()
            .expect("run wrk (run `cargo xtask setup`)");
        let text = String::from_utf8_lossy(&output.stdout);
        parse_result(&text).unwrap_or_else(|| panic!("wrk printed no result: {text}"))
    }
}

fn wrk_script(body: &str) -> String {
    let body = body.replace('\\', "\\\\").replace('"', "\\\"");
    format!(
        "wrk.method = \"POST\"\nwrk.body = \"{body}\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\n\
         done = function(summary, latency, requests)\n\
         local e = summary.errors\n\
         io.write(string.format(\"RESULT %d %d %d %d %d\\n\", summary.requests, summary.duration, \
         latency:percentile(50), latency:percentile(99), e.connect + e.read + e.write + e.status + e.timeout))\n\
         end\n"
    )
}

fn parse_result(text: &str) -> Option<Load> {
    let line = text.lines().find_map(|l| l.strip_prefix("RESULT "))?;
    let numbers: Vec<u64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let [requests, duration_us, p50, p99, errors] = numbers[..] else {
        return None;
    };
    Some(Load {
        requests,
        requests_per_second: requests as f64 / (duration_us as f64 / 1e6),
        p50: Duration::from_micros(p50),
        p99: Duration::from_micros(p99),
        errors,
    })
}
