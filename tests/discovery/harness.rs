//! What every discovery test uses: pods as a Virtual Kubelet reports them, a fake cluster with its
//! kubeconfig, tongs' admin views, backends that count or hold requests, and tongs' logs.

use std::collections::BTreeSet;
use std::future::Future;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::kube_api::{FakeKubeApi, RecordedRequest};
use crate::support::*;

pub const NS: &str = "gpu";
/// How long any one outcome may take to show before the test fails.
pub const WAIT: Duration = Duration::from_secs(30);
/// Idle endpoints are picked by a fair coin, so sequential requests reach every endpoint.
pub const COIN_TOSS: &str = "balancer: { policy: least-outstanding }\n";

/// The allowlist of tests whose pods serve at loopback podIPs: tongs serves a loopback podIP only where
/// an `allow` range inside 127.0.0.0/8 names it.
pub const LOOPBACK_PODS: &str = "allow: [127.0.0.0/8]";

/// A pod as a Virtual Kubelet reports it: by default Running and Ready, labelled `app=llm`, on node
/// `vk-node`, with no podIP.
#[derive(Clone)]
pub struct PodBuilder {
    name: String,
    namespace: String,
    phase: String,
    ready: bool,
    ip: Option<String>,
    node: String,
    labels: Vec<(String, String)>,
    annotations: Vec<(String, String)>,
    http_port: Option<u16>,
    salad: bool,
}

impl PodBuilder {
    pub fn new(name: &str) -> PodBuilder {
        PodBuilder {
            name: name.into(),
            namespace: NS.into(),
            phase: "Running".into(),
            ready: true,
            ip: None,
            node: "vk-node".into(),
            labels: vec![("app".into(), "llm".into())],
            annotations: Vec::new(),
            http_port: None,
            salad: false,
        }
    }

    pub fn namespace(mut self, namespace: &str) -> Self {
        self.namespace = namespace.into();
        self
    }

    pub fn phase(mut self, phase: &str) -> Self {
        self.phase = phase.into();
        self
    }

    pub fn ready(mut self, ready: bool) -> Self {
        self.ready = ready;
        self
    }

    pub fn ip(mut self, ip: &str) -> Self {
        self.ip = Some(ip.into());
        self
    }

    pub fn node(mut self, node: &str) -> Self {
        self.node = node.into();
        self
    }

    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.retain(|(k, _)| k != key);
        self.labels.push((key.into(), value.into()));
        self
    }

    pub fn annotate(mut self, key: &str, value: &str) -> Self {
        self.annotations.push((key.into(), value.into()));
        self
    }

    /// A containerPort named `http`.
    pub fn http_port(mut self, port: u16) -> Self {
        self.http_port = Some(port);
        self
    }

    /// Scheduled on the SaladCloud Virtual Kubelet (tolerates its taint).
    pub fn salad(mut self) -> Self {
        self.salad = true;
        self
    }

    pub fn json(&self) -> Value {
        let labels: serde_json::Map<String, Value> = self
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        let annotations: serde_json::Map<String, Value> = self
            .annotations
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        let mut ports = vec![json!({"name": "metrics", "containerPort": 9100, "protocol": "TCP"})];
        if let Some(port) = self.http_port {
            ports.push(json!({"name": "http", "containerPort": port, "protocol": "TCP"}));
        }
        let mut tolerations = vec![json!({
            "key": "node.kubernetes.io/not-ready", "operator": "Exists",
            "effect": "NoExecute", "tolerationSeconds": 300
        })];
        if self.salad {
            tolerations.push(json!({
                "key": "virtual-kubelet.io/provider", "operator": "Equal",
                "value": "saladcloud", "effect": "NoSchedule"
            }));
        }
        let mut pod = json!({
            "metadata": {
                "name": self.name, "namespace": self.namespace,
                "labels": labels, "annotations": annotations,
            },
            "spec": {
                "nodeName": self.node,
                "restartPolicy": "Always",
                "containers": [{"name": "llm", "image": "ghcr.io/example/llm:1", "ports": ports}],
                "tolerations": tolerations,
            },
            "status": {"phase": self.phase, "conditions": conditions(self.ready)},
        });
        if let Some(ip) = &self.ip {
            pod["status"]["podIP"] = json!(ip);
            pod["status"]["podIPs"] = json!([{"ip": ip}]);
        }
        pod
    }
}

pub fn conditions(ready: bool) -> Value {
    let ready = if ready { "True" } else { "False" };
    json!([
        {"type": "PodScheduled", "status": "True"},
        {"type": "Initialized", "status": "True"},
        {"type": "ContainersReady", "status": ready},
        {"type": "Ready", "status": ready},
    ])
}

pub fn set_ready(pod: &mut Value, ready: bool) {
    pod["status"]["conditions"] = conditions(ready);
}

pub fn set_phase(pod: &mut Value, phase: &str) {
    pod["status"]["phase"] = json!(phase);
}

pub fn set_label(pod: &mut Value, key: &str, value: &str) {
    pod["metadata"]["labels"][key] = json!(value);
}

/// A fake API server and a directory for the kubeconfig and other files.
pub struct Cluster {
    pub api: FakeKubeApi,
    dir: TempDir,
    pub kubeconfig: std::path::PathBuf,
}

impl Cluster {
    pub async fn start(name: &str) -> Cluster {
        capture_logs();
        let api = FakeKubeApi::start().await;
        let dir = TempDir::new(name);
        let kubeconfig = api.write_kubeconfig(&dir.0, NS);
        Cluster {
            api,
            dir,
            kubeconfig,
        }
    }

    /// Config text: `discovery.kubernetes` on this cluster in namespace `gpu` with selector
    /// `app=llm` (unless `settings` name others), plus `settings` (YAML lines under `discovery.kubernetes`) and `top` (top-level).
    pub fn config(&self, settings: &[&str], top: &str) -> tongs::config::Config {
        self.config_and_static(settings, top, &[])
    }

    /// [`Cluster::config`] with `statics` as `discovery.static` endpoints too.
    pub fn config_and_static(
        &self,
        settings: &[&str],
        top: &str,
        statics: &[String],
    ) -> tongs::config::Config {
        let mut yaml = format!(
            "{top}\ndiscovery:\n  kubernetes:\n    enabled: true\n    kubeconfig: {}\n",
            self.kubeconfig.display()
        );
        if !settings.iter().any(|s| s.starts_with("namespace")) {
            yaml.push_str(&format!("    namespace: {NS}\n"));
        }
        if !settings.iter().any(|s| s.starts_with("label_selector")) {
            yaml.push_str("    label_selector: app=llm\n");
        }
        for line in settings {
            yaml.push_str(&format!("    {line}\n"));
        }
        if !statics.is_empty() {
            yaml.push_str("  static:\n");
            for url in statics {
                yaml.push_str(&format!("    - url: {url}\n"));
            }
        }
        config_with(&yaml, &[])
    }

    /// Writes `contents` to a file in the cluster's directory.
    pub fn file(&self, name: &str, contents: &str) -> std::path::PathBuf {
        let path = self.dir.0.join(name);
        std::fs::write(&path, contents).expect("file written");
        path
    }

    /// The fake must not have been asked anything it does not implement.
    pub fn assert_faithful(&self) {
        assert_eq!(
            self.api.unexpected(),
            Vec::<String>::new(),
            "requests the fake API does not implement"
        );
    }

    /// The end of a test: the fake was asked nothing it does not implement, and the proxy stops.
    pub async fn finish(self, proxy: TestProxy) {
        self.assert_faithful();
        proxy.stop().await;
    }
}

/// Polls the async `check` until it holds, failing with `what` after [`WAIT`].
pub async fn until<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually_async(what, WAIT, check).await;
}

pub async fn admin_get(proxy: &TestProxy, path: &str) -> (u16, String) {
    get(&format!("http://{}{path}", proxy.admin)).await
}

/// `/debug/endpoints`' endpoints.
pub async fn endpoints(proxy: &TestProxy) -> Vec<Value> {
    let (status, body) = admin_get(proxy, "/debug/endpoints").await;
    assert_eq!(status, 200, "{body}");
    let view: Value = serde_json::from_str(&body).expect("/debug/endpoints is JSON");
    view["endpoints"].as_array().cloned().unwrap_or_default()
}

/// The URLs in the set (not those that left it and still hold requests).
pub async fn urls(proxy: &TestProxy) -> BTreeSet<String> {
    endpoints(proxy)
        .await
        .iter()
        .filter(|e| e["removed"] == false)
        .filter_map(|e| e["url"].as_str().map(str::to_owned))
        .collect()
}

/// The endpoint with `url` in `/debug/endpoints`.
pub async fn endpoint(proxy: &TestProxy, url: &str) -> Value {
    endpoints(proxy)
        .await
        .into_iter()
        .find(|e| e["url"] == url)
        .unwrap_or_else(|| panic!("no endpoint {url} in /debug/endpoints"))
}

/// Waits until the endpoint URLs are exactly `expected`.
pub async fn until_urls(proxy: &TestProxy, expected: &[&str]) {
    let expected: BTreeSet<String> = expected.iter().map(|s| s.to_string()).collect();
    let deadline = Instant::now() + WAIT;
    loop {
        let seen = urls(proxy).await;
        if seen == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {WAIT:?}: endpoints {seen:?}, want {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The value of the `/metrics` series `series` (name with labels, as printed), if present.
pub async fn metric(proxy: &TestProxy, series: &str) -> Option<f64> {
    let (status, body) = admin_get(proxy, "/metrics").await;
    assert_eq!(status, 200);
    crate::support::one_pool(&body).lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.trim().parse().ok()
    })
}

pub async fn metric_or_zero(proxy: &TestProxy, series: &str) -> f64 {
    metric(proxy, series).await.unwrap_or(0.0)
}

/// Pods tongs tracks, in every state.
pub async fn pods_tracked(proxy: &TestProxy) -> f64 {
    let mut total = 0.0;
    for state in ["serving", "ineligible", "no-address"] {
        total += metric_or_zero(proxy, &format!("tongs_discovery_pods{{state=\"{state}\"}}")).await;
    }
    total
}

/// Waits until tongs has applied every change the API server made so far: a Pending pod is created
/// and deleted, and tongs' pod count follows both (watch events arrive in order).
pub async fn settle(api: &FakeKubeApi, proxy: &TestProxy) {
    static BARRIERS: AtomicUsize = AtomicUsize::new(0);
    let name = format!("barrier-{}", BARRIERS.fetch_add(1, Ordering::Relaxed));
    let before = pods_tracked(proxy).await;
    api.create(PodBuilder::new(&name).phase("Pending").ready(false).json());
    until("tongs sees the barrier pod", || async {
        pods_tracked(proxy).await == before + 1.0
    })
    .await;
    api.delete(NS, &name);
    until("tongs sees the barrier pod go", || async {
        pods_tracked(proxy).await == before
    })
    .await;
}

/// The `metadata.uid` the API server gave pod `name` (of namespace `gpu`).
pub fn uid_of(api: &FakeKubeApi, name: &str) -> String {
    let pod = api.pod(NS, name).unwrap_or_else(|| panic!("no pod {name}"));
    pod["metadata"]["uid"].as_str().expect("a uid").to_owned()
}

/// Creates pod `name`, Running and Ready at `ip:port` (its containerPort named `http`).
pub fn serve_pod(api: &FakeKubeApi, name: &str, ip: &str, port: u16) {
    api.create(PodBuilder::new(name).ip(ip).http_port(port).json());
}

/// A [`named`] backend on `ip` and a ready pod of the same name pointing at it.
pub async fn named_pod(api: &FakeKubeApi, ip: &str, name: &'static str) -> Named {
    let node = named(ip, name).await;
    serve_pod(api, name, ip, node.port());
    node
}

/// Makes the open watch fail as a server-expired one does (410), so tongs lists again; returns once
/// the list that makes `lists` in all is applied.
pub async fn expire_the_watch(api: &FakeKubeApi, proxy: &TestProxy, lists: f64) {
    api.atomically(|c| {
        c.expire_next_watches(1);
        c.drop_watches();
    });
    until("the re-list is applied", || async {
        metric_or_zero(proxy, "tongs_discovery_lists_total").await == lists
    })
    .await;
}

/// A backend on `ip` answering its name, counting requests.
pub struct Named {
    backend: Backend,
    hits: Arc<AtomicUsize>,
}

impl Named {
    pub fn port(&self) -> u16 {
        self.backend.addr.port()
    }

    pub fn url(&self) -> String {
        self.backend.url()
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

pub async fn named(ip: &str, name: &'static str) -> Named {
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&hits);
    let backend = backend_on(&format!("{ip}:0"), move |_request: Request<Incoming>| {
        let counted = Arc::clone(&counted);
        async move {
            counted.fetch_add(1, Ordering::SeqCst);
            Response::new(full(name))
        }
    })
    .await;
    Named { backend, hits }
}

/// A backend on `ip` that holds each request until the test lets one go, then answers its name.
pub struct Gated {
    backend: Backend,
    arrived: Arc<AtomicUsize>,
    gate: Gate,
}

impl Gated {
    pub fn port(&self) -> u16 {
        self.backend.addr.port()
    }

    pub fn url(&self) -> String {
        self.backend.url()
    }

    pub fn arrived(&self) -> usize {
        self.arrived.load(Ordering::SeqCst)
    }

    pub fn release(&self, count: usize) {
        self.gate.release(count);
    }
}

pub async fn gated(ip: &str, name: &'static str) -> Gated {
    let arrived = Arc::new(AtomicUsize::new(0));
    let gate = Gate::default();
    let (counted, held) = (Arc::clone(&arrived), gate.clone());
    let backend = backend_on(&format!("{ip}:0"), move |_request: Request<Incoming>| {
        let (counted, held) = (Arc::clone(&counted), held.clone());
        async move {
            counted.fetch_add(1, Ordering::SeqCst);
            held.pass().await;
            Response::new(full(name))
        }
    })
    .await;
    Gated {
        backend,
        arrived,
        gate,
    }
}

/// Requests sent one after another in the background until stopped; their statuses.
pub struct Load {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<u16>>,
}

impl Load {
    pub fn start(url: String) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let mut statuses = Vec::new();
            while !stopped.load(Ordering::SeqCst) {
                statuses.push(get(&url).await.0);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            statuses
        });
        Load { stop, task }
    }

    pub async fn finish(self) -> Vec<u16> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("load task")
    }
}

/// Everything tongs logs at info and above, from every thread of this test binary.
pub static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();

pub struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub fn capture_logs() {
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let writer = Arc::clone(&logs);
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_ansi(false)
            .with_writer(move || LogWriter(Arc::clone(&writer)))
            .try_init();
        logs
    });
}

/// Log lines containing every one of `needles`.
pub fn logged(needles: &[&str]) -> usize {
    let Some(logs) = LOGS.get() else { return 0 };
    let logs = logs.lock().unwrap_or_else(|p| p.into_inner());
    String::from_utf8_lossy(&logs)
        .lines()
        .filter(|line| needles.iter().all(|n| line.contains(n)))
        .count()
}

pub fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a port")
}

pub fn last_watch(api: &FakeKubeApi) -> RecordedRequest {
    api.requests()
        .into_iter()
        .rev()
        .find(RecordedRequest::is_watch)
        .expect("a watch request")
}

pub fn watches(api: &FakeKubeApi) -> Vec<RecordedRequest> {
    api.requests()
        .into_iter()
        .filter(RecordedRequest::is_watch)
        .collect()
}
