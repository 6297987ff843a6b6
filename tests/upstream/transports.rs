//! Upstream transports: Tailscale addresses through tailscaled's proxy, everything else directly.
//!
//! tailscaled itself cannot run here (no tailnet), so its two outbound proxies are played by real
//! servers from Debian's packages that speak the same protocols: `microsocks` for
//! `--socks5-server` and `tinyproxy` for `--outbound-http-proxy-listen` (HTTP CONNECT). A "Tailscale
//! node" is a backend on another loopback address that `upstream.tailscale.ranges` names. Each proxy
//! binds its outgoing connections to an address of its own (`-b` / `Bind`), so the node can tell from
//! the peer address whether a request came through the proxy or straight from tongs. The nodes are
//! in-process backends and `tongs::sim` nodes standing in for GPU nodes on the tailnet.

use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Where microsocks' and tinyproxy's outgoing connections come from.
const SOCKS_OUT: &str = "127.0.0.3";
const CONNECT_OUT: &str = "127.0.0.5";

/// What a node saw of one request: the peer it came from and the path.
#[derive(Clone, Debug)]
struct Seen {
    peer: IpAddr,
    path: String,
}

/// A node on `bind` answering `200 node` and recording every request.
struct Node {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: CancellationToken,
}

impl Node {
    async fn start(bind: &str) -> Node {
        let listener = TcpListener::bind(bind).await.expect("node binds");
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let recorded = Arc::clone(&seen);
        serve_connections(listener, stop.clone(), move |stream, peer| {
            let recorded = Arc::clone(&recorded);
            serve_http(stream, Http::Auto, move |request: Request<Incoming>| {
                recorded.lock().unwrap().push(Seen {
                    peer: peer.ip(),
                    path: request.uri().path().to_owned(),
                });
                async { Response::new(full("node")) }
            })
        });
        Node { addr, seen, stop }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A proxy server process, killed on drop.
struct ProxyProcess {
    child: Child,
    port: u16,
    /// tinyproxy's config file lives here.
    _dir: Option<TempDir>,
}

impl ProxyProcess {
    /// Runs `command` (quietly) and waits until it listens on `port`; `dir` lives as long as it does.
    async fn start(
        mut command: Command,
        what: &str,
        port: u16,
        dir: Option<TempDir>,
    ) -> ProxyProcess {
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| panic!("{what} starts: {err}"));
        wait_listening(port, what).await;
        ProxyProcess {
            child,
            port,
            _dir: dir,
        }
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until something accepts connections on `port`.
async fn wait_listening(port: u16, what: &str) {
    let listening = || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    };
    eventually_async(
        &format!("{what} listening on port {port}"),
        Duration::from_secs(10),
        listening,
    )
    .await;
}

/// Debian's microsocks on 127.0.0.1:`port`, its outgoing connections bound to [`SOCKS_OUT`].
async fn microsocks(port: u16) -> ProxyProcess {
    let mut socks = ProxyProcess::start(microsocks_command(port), "microsocks", port, None).await;
    // Something listens there; make sure it is this microsocks (see `microsocks_anywhere`).
    assert!(
        speaks_socks5(port).await && matches!(socks.child.try_wait(), Ok(None)),
        "microsocks on port {port}: another process holds the port"
    );
    socks
}

fn microsocks_command(port: u16) -> Command {
    let mut command = Command::new(require("microsocks"));
    command
        .args(["-i", "127.0.0.1", "-p", &port.to_string(), "-b", SOCKS_OUT])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

/// microsocks on a free port. A port [`free_port`] found can be taken before microsocks binds it (by
/// another test's listener or connection, the tests running several at once): microsocks then exits,
/// and a listener that is not microsocks may answer there. So each try waits until the port answers a
/// SOCKS5 greeting, and a microsocks that exited is started again on another port.
async fn microsocks_anywhere() -> ProxyProcess {
    for _ in 0..5 {
        let port = free_port();
        let mut child = microsocks_command(port)
            .spawn()
            .unwrap_or_else(|err| panic!("microsocks starts: {err}"));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::time::Instant::now() < deadline {
            if !matches!(child.try_wait(), Ok(None)) {
                break;
            }
            if speaks_socks5(port).await {
                return ProxyProcess {
                    child,
                    port,
                    _dir: None,
                };
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("microsocks did not start on any of 5 free ports");
}

/// Whether a SOCKS5 server answers on `port`: a greeting offering no authentication, answered in kind.
async fn speaks_socks5(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let greet = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        stream.write_all(&[5, 1, 0]).await.ok()?;
        let mut reply = [0u8; 2];
        stream.read_exact(&mut reply).await.ok()?;
        Some(reply == [5, 0])
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), greet).await,
        Ok(Some(true))
    )
}

/// Debian's tinyproxy (HTTP CONNECT) on 127.0.0.1, its outgoing connections bound to [`CONNECT_OUT`].
async fn tinyproxy() -> ProxyProcess {
    let program = require("tinyproxy");
    let dir = TempDir::new("tongs-tinyproxy");
    let port = free_port();
    let config = dir.0.join("tinyproxy.conf");
    // No ConnectPort line: CONNECT to any port, as tailscaled's proxy allows.
    std::fs::write(
        &config,
        format!(
            "Port {port}\nListen 127.0.0.1\nBind {CONNECT_OUT}\nAllow 127.0.0.1\nLogLevel Error\nMaxClients 100\n"
        ),
    )
    .unwrap();
    let mut command = Command::new(program);
    command.arg("-d").arg("-c").arg(&config);
    ProxyProcess::start(command, "tinyproxy", port, Some(dir)).await
}

/// tongs with `proxy` for `node_range`, heartbeats as `health`, and these endpoints.
async fn proxy_via(proxy: &str, node_range: &str, health: &str, endpoints: &[String]) -> TestProxy {
    let yaml = format!(
        "upstream: {{ tailscale: {{ proxy: {proxy:?}, ranges: [{node_range:?}] }} }}\n\
         timeouts: {{ connect: 500ms }}\n{health}"
    );
    start_proxy(config_with(&yaml, endpoints)).await
}

/// A Tailscale node on 127.0.0.2 and tongs reaching it through `proxy`, heartbeats as `health`.
async fn one_node_via(proxy: &str, health: &str) -> (Node, TestProxy) {
    let node = Node::start("127.0.0.2:0").await;
    let proxy = proxy_via(proxy, "127.0.0.2/32", health, &[node.url()]).await;
    (node, proxy)
}

#[tokio::test]
async fn tailscale_addresses_go_through_a_real_socks5_server_and_others_go_direct() {
    let socks = microsocks_anywhere().await;
    let tailscale_node = Node::start("127.0.0.2:0").await;
    let pod_ip_node = Node::start("127.0.0.4:0").await;
    let proxy = proxy_via(
        &format!("socks5://127.0.0.1:{}", socks.port),
        "127.0.0.2/32",
        "",
        &[tailscale_node.url(), pod_ip_node.url()],
    )
    .await;
    for _ in 0..20 {
        assert_eq!(get(&proxy.url("/v1/generate")).await, (200, "node".into()));
    }
    let through_socks = tailscale_node.seen();
    let direct = pod_ip_node.seen();
    assert!(
        !through_socks.is_empty() && !direct.is_empty(),
        "both nodes served"
    );
    let socks_out: IpAddr = SOCKS_OUT.parse().unwrap();
    assert!(
        through_socks.iter().all(|s| s.peer == socks_out),
        "the Tailscale node was reached only through microsocks: {through_socks:?}"
    );
    assert!(
        direct.iter().all(|s| s.peer != socks_out),
        "the other node was reached directly: {direct:?}"
    );
    proxy.stop().await;
}

/// tongs with `proxy` for the host names in `domains` (no ranges), and these endpoints.
async fn proxy_for_domains(proxy: &str, domains: &str, endpoints: &[String]) -> TestProxy {
    let yaml = format!(
        "upstream: {{ tailscale: {{ proxy: {proxy:?}, ranges: [], domains: {domains} }} }}\n\
         timeouts: {{ connect: 500ms }}\n"
    );
    start_proxy(config_with(&yaml, endpoints)).await
}

/// An endpoint named by a host name that `upstream.tailscale.domains` matches goes through the proxy;
/// without the pattern, the same name is resolved here and dialled directly. `localhost` stands in
/// for a MagicDNS name: a name only the proxy's side resolves cannot be made on one machine, so this
/// shows the routing by name, and `src/upstream/route.rs`'s unit tests show the wire format (SOCKS5
/// address type 3 carrying the name; `CONNECT name:port`) that leaves the resolving to tailscaled.
#[tokio::test]
async fn names_matching_a_domain_pattern_go_through_a_real_socks5_server() {
    let socks = microsocks_anywhere().await;
    let socks_url = format!("socks5://127.0.0.1:{}", socks.port);
    let node = Node::start("127.0.0.1:0").await;
    let by_name = format!("http://localhost:{}", node.addr.port());
    let socks_out: IpAddr = SOCKS_OUT.parse().unwrap();

    let proxy = proxy_for_domains(&socks_url, "[localhost]", std::slice::from_ref(&by_name)).await;
    for _ in 0..5 {
        assert_eq!(get(&proxy.url("/v1/generate")).await, (200, "node".into()));
    }
    let seen = node.seen();
    assert_eq!(seen.len(), 5);
    assert!(
        seen.iter().all(|s| s.peer == socks_out),
        "the named node was reached only through microsocks: {seen:?}"
    );
    proxy.stop().await;

    let proxy = proxy_for_domains(&socks_url, "[\"*.ts.net\"]", &[by_name]).await;
    for _ in 0..5 {
        assert_eq!(get(&proxy.url("/v1/generate")).await, (200, "node".into()));
    }
    let seen = node.seen();
    assert_eq!(seen.len(), 10);
    assert!(
        seen[5..].iter().all(|s| s.peer != socks_out),
        "a name no pattern matches was dialled directly: {seen:?}"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn names_matching_a_domain_pattern_go_through_http_connect_too() {
    let connect = tinyproxy().await;
    let node = Node::start("127.0.0.1:0").await;
    let by_name = format!("http://localhost:{}", node.addr.port());
    let proxy = proxy_for_domains(
        &format!("http://127.0.0.1:{}", connect.port),
        "[localhost]",
        &[by_name],
    )
    .await;
    for _ in 0..5 {
        assert_eq!(get(&proxy.url("/x")).await, (200, "node".into()));
    }
    let connect_out: IpAddr = CONNECT_OUT.parse().unwrap();
    let seen = node.seen();
    assert_eq!(seen.len(), 5);
    assert!(
        seen.iter().all(|s| s.peer == connect_out),
        "every request came through tinyproxy: {seen:?}"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn heartbeats_take_the_endpoints_own_transport() {
    let socks = microsocks_anywhere().await;
    let (node, proxy) = one_node_via(
        &format!("socks5://127.0.0.1:{}", socks.port),
        "health: { interval: 100ms, timeout: 1s }\n",
    )
    .await;
    eventually("a heartbeat reaches the node", HANG, || {
        node.seen().iter().any(|s| s.path == "/health")
    })
    .await;
    let socks_out: IpAddr = SOCKS_OUT.parse().unwrap();
    assert!(node.seen().iter().all(|s| s.peer == socks_out));
    proxy.stop().await;
}

#[tokio::test]
async fn http_connect_proxies_work_like_socks5() {
    let connect = tinyproxy().await;
    let (node, proxy) = one_node_via(&format!("http://127.0.0.1:{}", connect.port), "").await;
    for _ in 0..5 {
        assert_eq!(get(&proxy.url("/x")).await, (200, "node".into()));
    }
    let connect_out: IpAddr = CONNECT_OUT.parse().unwrap();
    let seen = node.seen();
    assert_eq!(seen.len(), 5);
    assert!(
        seen.iter().all(|s| s.peer == connect_out),
        "every request came through tinyproxy: {seen:?}"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn a_dead_socks_proxy_gets_a_clear_502_and_recovery_when_it_returns() {
    let socks = microsocks_anywhere().await;
    let port = socks.port;
    let (node, proxy) = one_node_via(&format!("socks5://127.0.0.1:{port}"), "").await;
    assert_eq!(get(&proxy.url("/")).await.0, 200);
    drop(socks);
    // Pooled connections to the node ran through the dead proxy: they are gone too, and new ones fail.
    let mut answer = get(&proxy.url("/")).await;
    for _ in 0..5 {
        if answer.0 != 200 {
            break;
        }
        answer = get(&proxy.url("/")).await;
    }
    let (status, body) = answer;
    assert_eq!(status, 502, "{body}");
    assert!(
        body.contains("tailscaled's proxy"),
        "the error says the proxy failed: {body}"
    );
    assert!(
        !body.contains(&node.addr.to_string()),
        "the client is not told the node's address (the log is): {body}"
    );
    let socks = microsocks(port).await;
    eventually_async(
        "requests succeed again once the proxy is back",
        Duration::from_secs(30),
        || async { get(&proxy.url("/")).await.0 == 200 },
    )
    .await;
    drop(socks);
    proxy.stop().await;
}

#[tokio::test]
async fn a_proxy_that_accepts_and_stalls_cannot_hang_the_request() {
    // Accepts TCP connections and never says a word of SOCKS.
    let stalled = Silent::start().await;
    let port = stalled.addr.port();
    let (node, proxy) = one_node_via(&format!("socks5://127.0.0.1:{port}"), "").await;
    let (status, body) = get(&proxy.url("/")).await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("no connection within"), "{body}");
    assert!(stalled.accepted() > 0, "tongs did reach the proxy");
    assert!(node.seen().is_empty());
    proxy.stop().await;
}

/// Two simulated GPU nodes on Tailscale-range addresses behind microsocks: when one is reset (its
/// listener closed, in-flight connections RST), microsocks reports the refused connect in its SOCKS
/// reply, tongs counts it as a connect failure and retries on the other node; no client sees a
/// failure, and the node serves again once it is back. Heartbeats are off, so only requests can notice.
#[tokio::test]
async fn interrupted_tailscale_nodes_behind_socks5_are_retried_elsewhere() {
    use tongs::sim::{Condition, InterruptionKind, NodeSpec};
    let socks = microsocks_anywhere().await;
    let nodes = ["127.0.0.2", "127.0.0.6"]
        .iter()
        .enumerate()
        .map(|(index, ip)| {
            let mut spec = NodeSpec::new(&format!("ts-{index}"), Duration::from_millis(20));
            spec.listen = format!("{ip}:0").parse().unwrap();
            spec.capacity = 8;
            spec
        })
        .collect();
    let fleet = sim_fleet(5, nodes).await;
    let proxy = proxy_via(
        &format!("socks5://127.0.0.1:{}", socks.port),
        "127.0.0.0/8",
        "balancer: { policy: least-outstanding }\n",
        &fleet.urls(),
    )
    .await;
    let interrupted = &fleet.nodes()[0];
    let mut answers = Vec::new();
    for i in 0..60 {
        if i == 20 {
            interrupted.set_condition(Condition::Interrupted {
                kind: InterruptionKind::Refuse,
                factor: 1.0,
            });
        }
        if i == 45 {
            interrupted.set_condition(Condition::Up);
        }
        let (status, body) = get(&proxy.url("/v1/generate")).await;
        answers.push((i, status, body));
    }
    let failed: Vec<_> = answers
        .iter()
        .filter(|(_, status, _)| *status != 200)
        .collect();
    assert!(failed.is_empty(), "clients saw failures: {failed:?}");
    let (_, metrics) = get(&format!("http://{}/metrics", proxy.admin)).await;
    let connect_retries: f64 = metrics
        .lines()
        .find(|l| l.starts_with("tongs_retries_total{pool=\"default\",reason=\"connect-failure\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(
        connect_retries >= 1.0,
        "the refused connect through the proxy was retried as a connect failure:\n{metrics}"
    );
    // Its breaker opened while it refused: it returns after the ejection (5 s) and a probe.
    let served_before = interrupted.stats().served;
    eventually_async(
        "the node serves again once it is back",
        Duration::from_secs(20),
        || async {
            assert_eq!(get(&proxy.url("/v1/generate")).await.0, 200);
            interrupted.stats().served > served_before
        },
    )
    .await;
    assert!(fleet.nodes()[1].stats().served > 0);
    proxy.stop().await;
}
