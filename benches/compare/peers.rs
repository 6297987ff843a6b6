//! The contenders as processes: tongs' release binary with its defaults, and nginx, HAProxy and Caddy
//! each configured as well as it allows for the job; and the nginx origin of the throughput scenario.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use super::support::{self, Process, TempDir, TongsProcess, Usage, find_program};
use super::{PER_TRY_TIMEOUT, Proxy, Settings};

/// A proxy running as its own process in front of the upstreams.
pub struct Running {
    pub label: String,
    /// Where clients send requests (the first replica's, for `tongs-2-replicas`).
    pub url: String,
    /// Every replica's: one but for `tongs-2-replicas`.
    pub urls: Vec<String>,
    pub handle: Handle,
}

pub enum Handle {
    Tongs(TongsProcess),
    /// `tongs-2-replicas`: processes with the same configuration, sharing nothing.
    Replicas(Vec<TongsProcess>),
    Peer {
        process: Process,
        _dir: TempDir,
    },
}

impl Running {
    /// The proxy's processes (a master and its workers for nginx).
    pub fn pids(&self) -> Vec<u32> {
        match &self.handle {
            Handle::Tongs(tongs) => tongs.process.pids(),
            Handle::Replicas(replicas) => replicas.iter().flat_map(|t| t.process.pids()).collect(),
            Handle::Peer { process, .. } => process.pids(),
        }
    }

    pub fn usage(&self) -> Usage {
        support::usage(&self.pids())
    }
}

/// Each node's capacity, for the peers that must be told it (HAProxy's `maxconn`).
pub struct Upstream {
    pub addr: String,
    pub capacity: usize,
}

pub async fn start_proxy(
    proxy: Proxy,
    upstreams: &[Upstream],
    settings: &Settings,
) -> Result<Running> {
    let program = |name: &str| {
        find_program(name).with_context(|| {
            format!("`{name}` is not installed: `bash benches/compare/run` installs it (apt-get install {name})")
        })
    };
    if proxy.is_tongs() {
        // Defaults, unless TONGS_CONFIG adds settings (to try one against the peers).
        let mut config = std::env::var("TONGS_CONFIG").map_or(String::new(), |extra| extra + "\n");
        let mut label = format!("tongs {}", env!("CARGO_PKG_VERSION"));
        if proxy == Proxy::TongsAdaptive {
            config.push_str("concurrency: { limit: adaptive }\n");
            label.push_str(", limit: adaptive");
        }
        if proxy == Proxy::TongsOwnCounts {
            config.push_str(
                "signals: { enabled: false }\nbalancer: { scorers: { expected-latency: 1 } }\n",
            );
            label.push_str(", own counts");
        }
        if proxy == Proxy::TongsCapacity {
            config.push_str("discovery:\n  static:\n");
            for upstream in upstreams {
                config.push_str(&format!(
                    "    - url: http://{}\n      max_outstanding: {}\n",
                    upstream.addr, upstream.capacity
                ));
            }
            label.push_str(", capacities given");
        } else {
            config.push_str(&support::static_discovery(
                upstreams
                    .iter()
                    .map(|upstream| format!("http://{}", upstream.addr)),
            ));
        }
        if settings.show_configs {
            println!("tongs configuration:\n```yaml\n{config}```");
        }
        if proxy == Proxy::TongsTwoReplicas {
            let replicas = vec![
                TongsProcess::start(&config).await?,
                TongsProcess::start(&config).await?,
            ];
            let urls: Vec<String> = replicas.iter().map(TongsProcess::url).collect();
            return Ok(Running {
                label: label + ", 2 replicas",
                url: urls[0].clone(),
                urls,
                handle: Handle::Replicas(replicas),
            });
        }
        let tongs = TongsProcess::start(&config).await?;
        return Ok(Running {
            label,
            url: tongs.url(),
            urls: vec![tongs.url()],
            handle: Handle::Tongs(tongs),
        });
    }
    let binary = program(proxy.program())?;
    let dir = TempDir::new(&format!("compare-{}", proxy.program()))?;
    let addr = support::free_addr()?;
    let (config_name, config, command, version) = match proxy {
        Proxy::Nginx => {
            std::fs::create_dir_all(dir.path().join("tmp"))?;
            let config = nginx_config(dir.path(), &addr.to_string(), upstreams);
            let command =
                support::nginx_command(&binary, &dir.path().join("nginx.conf"), dir.path());
            (
                "nginx.conf",
                config,
                command,
                support::program_version(&binary, "-v"),
            )
        }
        Proxy::Haproxy => {
            let config = haproxy_config(&addr.to_string(), upstreams);
            let command = support::haproxy_command(&binary, &dir.path().join("haproxy.cfg"));
            (
                "haproxy.cfg",
                config,
                command,
                support::program_version(&binary, "-v"),
            )
        }
        Proxy::Caddy => {
            let config = caddy_config(addr.port(), upstreams);
            let mut command = Command::new(&binary);
            command
                .args(["run", "--adapter", "caddyfile", "--config"])
                .arg(dir.path().join("Caddyfile"))
                .env("XDG_DATA_HOME", dir.path())
                .env("XDG_CONFIG_HOME", dir.path())
                .env("HOME", dir.path());
            (
                "Caddyfile",
                config,
                command,
                support::program_version(&binary, "version"),
            )
        }
        Proxy::Tongs
        | Proxy::TongsAdaptive
        | Proxy::TongsCapacity
        | Proxy::TongsOwnCounts
        | Proxy::TongsTwoReplicas => unreachable!("tongs is started above"),
    };
    let path = dir.path().join(config_name);
    std::fs::write(&path, &config).with_context(|| format!("writing {}", path.display()))?;
    if settings.show_configs {
        println!(
            "{} configuration ({config_name}):\n```\n{config}```",
            proxy.program()
        );
    }
    let mut process = Process::spawn(proxy.program(), command, dir.path().join("proxy.log"))?;
    process.wait_listening(addr, Duration::from_secs(15))?;
    Ok(Running {
        label: format!("{} {version}", proxy.program()),
        url: format!("http://{addr}"),
        urls: vec![format!("http://{addr}")],
        handle: Handle::Peer { process, _dir: dir },
    })
}

/// nginx OSS: least_conn shared by the workers (`zone`); no active checks in the open-source build,
/// so passive ones mirroring tongs' breaker (3 failures, 5 s out); retries on errors, timeouts and
/// 502/503/504, POST included (`non_idempotent`), on another server, 3 tries; no queue in OSS.
fn nginx_config(dir: &Path, listen: &str, upstreams: &[Upstream]) -> String {
    let head = support::nginx_head(dir, support::cpus(), 8192, "nginx");
    let servers: String = upstreams
        .iter()
        .map(|u| format!("        server {} max_fails=3 fail_timeout=5s;\n", u.addr))
        .collect();
    format!(
        "{head}
    upstream fleet {{
        least_conn;
        zone fleet 256k;
{servers}        keepalive 256;
    }}
    server {{
        listen {listen} backlog=4096;
        location / {{
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_connect_timeout 1s;
            proxy_send_timeout 10s;
            proxy_read_timeout 10s;
            proxy_next_upstream error timeout http_502 http_503 http_504 non_idempotent;
            proxy_next_upstream_tries 3;
            proxy_buffering off;
        }}
    }}
}}
",
    )
}

/// HAProxy: leastconn; active checks (GET /health every 2 s, 2 to fall, 2 to rise) and passive ones
/// (`observe layer7`, 3 errors mark a server down); L7 retries on connect failures, empty responses,
/// response timeouts and 502/503/504, each on another server (`redispatch 1`), 3 tries; `maxconn` per
/// server set to the node's capacity (HAProxy must be told it) with a 10 s queue.
fn haproxy_config(listen: &str, upstreams: &[Upstream]) -> String {
    let servers: String = upstreams
        .iter()
        .enumerate()
        .map(|(i, u)| format!("    server n{i} {} maxconn {}\n", u.addr, u.capacity))
        .collect();
    let timeout = PER_TRY_TIMEOUT.as_secs();
    format!(
        "global
    maxconn 8000
    nbthread {threads}
defaults
    mode http
    timeout connect 1s
    timeout client 100s
    timeout server {timeout}s
    timeout queue {timeout}s
    timeout http-request 10s
    timeout http-keep-alive 90s
    retries 2
    option redispatch 1
    retry-on conn-failure empty-response response-timeout 502 503 504
    option http-buffer-request
frontend proxy
    bind {listen}
    default_backend fleet
backend fleet
    balance leastconn
    option httpchk GET /health
    default-server check inter 2s fastinter 250ms downinter 2s fall 2 rise 2 observe layer7 error-limit 3 on-error mark-down
{servers}",
        threads = support::cpus(),
    )
}

/// Caddy: least_conn; active checks (GET /health every 2 s, 1 s timeout) and passive ones (3 failures
/// or a 502/503/504 within 5 s); retries POST too (`lb_retry_match`) for up to 10 s, every 100 ms,
/// which also makes a request wait while every node is at `unhealthy_request_count` — the nearest
/// Caddy has to a queue (one count for every node: the largest node's capacity); no retry on a
/// status code (Caddy 2.6 passes a node's 503 on).
fn caddy_config(port: u16, upstreams: &[Upstream]) -> String {
    let addrs: Vec<&str> = upstreams.iter().map(|u| u.addr.as_str()).collect();
    let most = upstreams.iter().map(|u| u.capacity).max().unwrap_or(1);
    let timeout = PER_TRY_TIMEOUT.as_secs();
    format!(
        "{{
\tadmin off
\tauto_https off
}}
:{port} {{
\tbind 127.0.0.1
\treverse_proxy {addrs} {{
\t\tlb_policy least_conn
\t\tlb_try_duration {timeout}s
\t\tlb_try_interval 100ms
\t\tlb_retry_match {{
\t\t\tmethod GET POST
\t\t}}
\t\thealth_uri /health
\t\thealth_interval 2s
\t\thealth_timeout 1s
\t\tfail_duration 5s
\t\tmax_fails 3
\t\tunhealthy_status 502 503 504
\t\tunhealthy_request_count {most}
\t\tflush_interval -1
\t\ttransport http {{
\t\t\tdial_timeout 1s
\t\t\tresponse_header_timeout {timeout}s
\t\t}}
\t}}
}}
",
        addrs = addrs.join(" "),
    )
}

/// nginx as the instant origin: one worker, two ports, `200 ok` to everything (health checks too).
pub fn origin_config(dir: &Path, ports: &[u16]) -> String {
    let servers: String = ports
        .iter()
        .map(|port| {
            format!(
                "    server {{ listen 127.0.0.1:{port} backlog=4096; keepalive_requests 1000000; \
                 location / {{ default_type text/plain; return 200 \"ok\\n\"; }} }}\n"
            )
        })
        .collect();
    format!(
        "{}\n{servers}}}\n",
        support::nginx_head(dir, 1, 8192, "origin")
    )
}
