//! What the process-level benchmarks share: the machine's description, settings from the environment,
//! free loopback ports, processes started and stopped cleanly (tongs' release binary, nginx, HAProxy,
//! Caddy), and their resource use read from `/proc` (CPU time, RSS, open file descriptors, threads).
//!
//! The simulated fleets they build (`fleet`), tongs started in their own process (`in_process`) and the
//! figures they compute (`stats`) are in this folder's modules.
//!
//! Included by each benchmark with `#[path = "support/mod.rs"] mod support;` (`"../support/mod.rs"` from
//! a benchmark's own folder); not every benchmark uses every helper.
#![allow(dead_code)]

pub mod chat;
pub mod fleet;
pub mod in_process;
pub mod stats;

use std::fmt::Display;
use std::fs::File;
use std::future::Future;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Whether this is the benchmark itself: `cargo bench` passes `--bench`; `cargo test --all-targets` runs
/// the binary without it (a smoke pass, or nothing).
pub fn benchmarking() -> bool {
    std::env::args().any(|arg| arg == "--bench")
}

/// Runs `main` to its end on a multi-threaded tokio runtime.
pub fn block_on<T>(main: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(main)
}

/// The value behind `mutex`, even if a task panicked holding it.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The CPUs this process may run on (1 when that cannot be read).
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// "2 CPUs, Intel(R) Xeon(R) ..., 23.4 GiB": what a figure was measured on.
pub fn machine() -> String {
    let cpus = cpus();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|line| line.starts_with("model name"))
        .and_then(|line| line.split_once(':'))
        .map_or("unknown CPU", |(_, model)| model.trim());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory = kib_field(&meminfo, "MemTotal:").map_or_else(String::new, |kib| {
        format!(", {:.1} GiB", kib as f64 / 1048576.0)
    });
    format!("{cpus} CPUs, {model}{memory}")
}

/// The date and time now, UTC, to the second.
pub fn now_utc() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// A duration from the environment: `60`, `60s`, `2m`, `500ms`; `default` when unset.
pub fn env_duration(name: &str, default: Duration) -> Result<Duration> {
    let Ok(text) = std::env::var(name) else {
        return Ok(default);
    };
    let text = text.trim();
    match text.parse::<u64>() {
        Ok(seconds) => Ok(Duration::from_secs(seconds)),
        Err(_) => humantime::parse_duration(text)
            .with_context(|| format!("{name}={text:?} is not a duration such as 60s")),
    }
}

/// A number from the environment; `default` when unset.
pub fn env_number<T: std::str::FromStr>(name: &str, default: T) -> Result<T> {
    match std::env::var(name) {
        Ok(text) => text
            .trim()
            .parse()
            .ok()
            .with_context(|| format!("{name}={text:?} is not a number")),
        Err(_) => Ok(default),
    }
}

/// A list of names from the environment (`default` when unset), each read by `parse`; at least one.
pub fn env_list<T>(name: &str, default: &str, parse: impl Fn(&str) -> Result<T>) -> Result<Vec<T>> {
    let text = std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let list = text
        .split_whitespace()
        .map(parse)
        .collect::<Result<Vec<_>>>()?;
    if list.is_empty() {
        bail!("{name} is empty (known: {default})");
    }
    Ok(list)
}

/// A free port on 127.0.0.1 (bound, then released for a process to take).
pub fn free_addr() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    listener.local_addr().context("finding a free port")
}

/// A listener on `addr` with SO_REUSEPORT (several may share the port, the kernel spreading connections
/// over them) and a deep backlog, so that bursts of connects wait rather than fail on a busy machine.
pub fn reuseport_listener(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket
        .bind(&addr.into())
        .with_context(|| format!("binding {addr}"))?;
    socket.listen(4096)?;
    Ok(tokio::net::TcpListener::from_std(socket.into())?)
}

/// Finds `name` on PATH or in /usr/sbin and /sbin (where Debian puts nginx and HAProxy).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The version a program prints ("nginx version: nginx/1.22.1", "HAProxy version 2.6.12-1...",
/// "v2.6.2 h1:..."), reduced to the number.
pub fn program_version(binary: &Path, flag: &str) -> String {
    let Ok(out) = Command::new(binary).arg(flag).output() else {
        return "(version unknown)".into();
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    text.split(|c: char| c.is_whitespace() || c == '/')
        .map(|word| word.trim_start_matches('v'))
        .find(|word| word.starts_with(|c: char| c.is_ascii_digit()) && word.contains('.'))
        .map(|word| word.split('-').next().unwrap_or(word).to_owned())
        .unwrap_or_else(|| "(version unknown)".into())
}

/// The start of an nginx configuration up to the inside of `http {`: everything nginx would otherwise
/// write under its compiled-in prefix goes to `dir`.
pub fn nginx_head(dir: &Path, workers: usize, connections: usize, name: &str) -> String {
    let dir = dir.display();
    format!(
        "worker_processes {workers};
pid {dir}/{name}.pid;
error_log stderr error;
worker_rlimit_nofile {connections};
events {{ worker_connections {connections}; }}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;"
    )
}

/// nginx in the foreground on the configuration file `config`, with `prefix` as its prefix directory
/// and its errors on stderr.
pub fn nginx_command(binary: &Path, config: &Path, prefix: &Path) -> Command {
    let mut command = Command::new(binary);
    command
        .args(["-e", "stderr", "-c"])
        .arg(config)
        .arg("-p")
        .arg(prefix)
        .args(["-g", "daemon off;"]);
    command
}

/// nginx in front of Server-Sent Event upstreams, as the streaming benchmarks run it: `proxy_buffering off`
/// so each event goes out as it comes, HTTP/1.1 upstream keepalive, `least_conn` with a `zone` (the
/// workers share their counts, as tongs' are shared), a worker per CPU, room for a client and an upstream
/// connection per stream on any one worker. Dropping it stops nginx, then removes its directory.
pub struct NginxSse {
    pub process: Process,
    /// Where it listens.
    pub addr: SocketAddr,
    /// "nginx 1.22.1".
    pub label: String,
    _dir: TempDir,
}

impl NginxSse {
    /// Starts `binary` in front of `upstreams` with room for `streams` streams; returns once it listens
    /// and its workers have started. `name` prefixes its temporary directory.
    pub async fn start(
        binary: &Path,
        upstreams: &[SocketAddr],
        streams: usize,
        name: &str,
    ) -> Result<NginxSse> {
        let dir = TempDir::new(name)?;
        std::fs::create_dir_all(dir.path().join("tmp"))?;
        let addr = free_addr()?;
        let workers = cpus();
        let connections = (streams * 2 + 256).max(4096);
        let servers = upstreams
            .iter()
            .map(|upstream| format!("\n        server {upstream};"))
            .collect::<Vec<_>>()
            .concat();
        let conf = format!(
            "{head}
    upstream sse {{
        zone sse 64k;
        least_conn;{servers}
        keepalive 64;
    }}
    server {{
        listen {addr};
        location / {{
            proxy_pass http://sse;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_buffering off;
            proxy_read_timeout 100s;
        }}
    }}
}}
",
            head = nginx_head(dir.path(), workers, connections, "nginx"),
        );
        let conf_path = dir.path().join("nginx.conf");
        std::fs::write(&conf_path, conf)?;
        let command = nginx_command(binary, &conf_path, dir.path());
        let mut process = Process::spawn("nginx", command, dir.path().join("nginx.log"))?;
        process.wait_listening(addr, Duration::from_secs(10))?;
        // Let the master start its workers before the idle figure.
        let deadline = Instant::now() + Duration::from_secs(5);
        while process.pids().len() <= workers && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(NginxSse {
            process,
            addr,
            label: format!("nginx {}", program_version(binary, "-v")),
            _dir: dir,
        })
    }
}

/// HAProxy in the foreground (`-db`) on the configuration file `config`.
pub fn haproxy_command(binary: &Path, config: &Path) -> Command {
    let mut command = Command::new(binary);
    command.arg("-db").arg("-f").arg(config);
    command
}

/// tongs' configuration for a fixed list of endpoints: `discovery.static`, one `url` a line.
pub fn static_discovery(urls: impl IntoIterator<Item = impl Display>) -> String {
    let mut yaml = String::from("discovery:\n  static:\n");
    for url in urls {
        yaml.push_str(&format!("    - url: {url}\n"));
    }
    yaml
}

/// The tongs binary cargo built for this benchmark (the release profile under `cargo bench`).
pub fn tongs_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tongs"))
}

/// A directory under the system's temporary directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Result<TempDir> {
        let stamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos());
        let dir =
            std::env::temp_dir().join(format!("tongs-{prefix}-{}-{stamp}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(TempDir(dir))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Resource use of one or more processes (all their threads), read from `/proc`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    /// utime + stime.
    pub cpu: Duration,
    /// Resident set now (VmRSS), KiB.
    pub rss_kib: u64,
    /// Peak resident set (VmHWM), KiB.
    pub peak_rss_kib: u64,
    /// Open file descriptors.
    pub fds: u64,
    pub threads: u64,
}

/// Sums the usage of `pids`; processes that are gone count nothing.
pub fn usage(pids: &[u32]) -> Usage {
    let ticks_per_second = clock_ticks();
    let mut total = Usage::default();
    for &pid in pids {
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // Fields after the command name (which may hold spaces and parentheses).
            if let Some((_, rest)) = stat.rsplit_once(") ") {
                let fields: Vec<&str> = rest.split_whitespace().collect();
                // state is field 3 of stat; utime and stime are 14 and 15, so 11 and 12 here.
                let ticks: u64 = [11, 12]
                    .iter()
                    .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
                    .sum();
                total.cpu += Duration::from_secs_f64(ticks as f64 / ticks_per_second);
            }
        }
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            total.rss_kib += kib_field(&status, "VmRSS:").unwrap_or(0);
            total.peak_rss_kib += kib_field(&status, "VmHWM:").unwrap_or(0);
            total.threads += kib_field(&status, "Threads:").unwrap_or(0);
        }
        if let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
            total.fds += entries.count() as u64;
        }
    }
    total
}

/// A process's "Max open files" limits, soft and hard, from /proc.
pub fn open_file_limits(pid: u32) -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))?;
    let mut values = line.split_whitespace().skip(3).map(str::parse);
    Some((values.next()?.ok()?, values.next()?.ok()?))
}

/// The 1-minute load average, from /proc.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into())
}

/// KiB as "12.3 MiB".
pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// A duration as "1.23 s".
pub fn seconds(duration: Duration) -> String {
    format!("{:.2} s", duration.as_secs_f64())
}

/// A numeric field of a /proc status-like text ("VmRSS:   1234 kB" → 1234).
fn kib_field(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find(|line| line.starts_with(name))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Clock ticks per second, the unit of CPU times in `/proc` (`getconf CLK_TCK`; 100 when it fails).
pub fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8_lossy(&out.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// Processes whose parent is `pid`, from /proc.
pub fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&candidate| {
            std::fs::read_to_string(format!("/proc/{candidate}/stat"))
                .ok()
                .and_then(|stat| {
                    let (_, rest) = stat.rsplit_once(") ")?;
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// A process this benchmark started, with its stderr in a log file. Dropping it sends SIGTERM, waits
/// up to 5 s, then kills it and any children it left (nginx's and HAProxy's workers).
pub struct Process {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Process {
    /// Starts `command` with stdin and stdout closed and stderr (and stdout) in `log`.
    pub fn spawn(name: &str, mut command: Command, log: PathBuf) -> Result<Process> {
        let stderr = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let stdout = stderr
            .try_clone()
            .with_context(|| format!("opening {}", log.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {name} ({command:?})"))?;
        Ok(Process {
            name: name.to_owned(),
            child: Some(child),
            log,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The process and its children (a master and its workers).
    pub fn pids(&self) -> Vec<u32> {
        let pid = self.pid();
        let mut pids = vec![pid];
        pids.extend(children_of(pid));
        pids
    }

    pub fn usage(&self) -> Usage {
        usage(&self.pids())
    }

    /// The end of the log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|child| child.try_wait().ok()?)
    }

    /// An error with the end of the log if the process has exited (it should still be starting).
    fn still_starting(&mut self) -> Result<()> {
        match self.exited() {
            Some(status) => bail!(
                "{} exited at start-up ({status}):\n{}",
                self.name,
                self.log_tail()
            ),
            None => Ok(()),
        }
    }

    /// Waits (at most `limit`) until `addr` accepts TCP connections.
    pub fn wait_listening(&mut self, addr: SocketAddr, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            self.still_starting()?;
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "{} did not listen on {addr} within {limit:?}:\n{}",
            self.name,
            self.log_tail()
        )
    }

    /// Waits (at most `limit`) until GET `url` answers 200.
    pub async fn wait_ok(&mut self, url: &str, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            self.still_starting()?;
            if matches!(get(url).await, Ok((200, _))) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "{} did not answer 200 at {url} within {limit:?}:\n{}",
            self.name,
            self.log_tail()
        )
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id();
        let children = children_of(pid);
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if matches!(child.try_wait(), Ok(None)) {
            let _ = child.kill();
        }
        let _ = child.wait();
        for orphan in children {
            let _ = Command::new("kill")
                .args(["-KILL", &orphan.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// tongs' release binary running `tongs run --config FILE`.
pub struct TongsProcess {
    pub process: Process,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    dir: TempDir,
}

impl TongsProcess {
    /// Writes `config` (YAML without `listen` or `admin`, which this adds on free ports) and starts
    /// tongs on it; returns once `/readyz` answers 200 (within 30 s).
    pub async fn start(config: &str) -> Result<TongsProcess> {
        let dir = TempDir::new("bench-tongs")?;
        let addr = free_addr()?;
        let admin = free_addr()?;
        let text = format!("listen: {addr}\nadmin: {{ listen: {admin} }}\n{config}");
        let path = dir.path().join("tongs.yaml");
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        // TONGS_LOG (a RUST_LOG filter) keeps tongs' log in target/ for a look at why requests failed.
        let (filter, log) = match std::env::var("TONGS_LOG") {
            Ok(filter) => {
                let log = PathBuf::from(format!("target/bench-tongs-{}.log", addr.port()));
                eprintln!("tongs' log ({filter}): {}", log.display());
                (filter, log)
            }
            Err(_) => ("warn".to_owned(), dir.path().join("tongs.log")),
        };
        // TONGS_WRAP (a command and its arguments, split at spaces) runs tongs under it, for a look
        // at one run (benches/README.md, `streams.rs`). The figures read off the process (RSS, CPU)
        // are then the wrapper's.
        let mut command = match std::env::var("TONGS_WRAP") {
            Ok(wrap) if !wrap.trim().is_empty() => {
                let mut words = wrap.split_whitespace();
                let mut command = Command::new(words.next().unwrap_or_default());
                command.args(words).arg(tongs_binary());
                command
            }
            _ => Command::new(tongs_binary()),
        };
        command
            .arg("run")
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", filter);
        let mut process = Process::spawn("tongs", command, log)?;
        process
            .wait_ok(&format!("http://{admin}/readyz"), Duration::from_secs(30))
            .await?;
        Ok(TongsProcess {
            process,
            addr,
            admin,
            dir,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Rewrites tongs' configuration file with `config` (as [`TongsProcess::start`] takes it, on the
    /// same ports); tongs reloads it on its own. A temporary file renamed over it, so tongs never reads
    /// half a file.
    pub fn reconfigure(&self, config: &str) -> Result<()> {
        let text = format!(
            "listen: {}\nadmin: {{ listen: {} }}\n{config}",
            self.addr, self.admin
        );
        let path = self.dir.path().join("tongs.yaml");
        let temporary = self.dir.path().join("tongs.yaml.new");
        std::fs::write(&temporary, text)
            .with_context(|| format!("writing {}", temporary.display()))?;
        std::fs::rename(&temporary, &path).with_context(|| format!("replacing {}", path.display()))
    }

    /// The value of one unlabelled sample in tongs' Prometheus text (`/metrics`).
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let (_, text) = get(&format!("http://{}/metrics", self.admin)).await.ok()?;
        text.lines()
            .find(|line| line.split_whitespace().next() == Some(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    }
}

/// GET `url` over HTTP/1.1 with a 5 s limit: status and body as text.
pub async fn get(url: &str) -> Result<(u16, String)> {
    let client: Client<_, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let uri: http::Uri = url.parse().with_context(|| format!("bad URL {url}"))?;
    let response = tokio::time::timeout(Duration::from_secs(5), client.get(uri))
        .await
        .with_context(|| format!("GET {url} timed out"))?
        .with_context(|| format!("GET {url}"))?;
    let status = response.status().as_u16();
    let body = tokio::time::timeout(Duration::from_secs(5), response.into_body().collect())
        .await
        .with_context(|| format!("GET {url}: body timed out"))?
        .with_context(|| format!("GET {url}: body"))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}
