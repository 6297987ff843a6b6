//! Configuration reload the way Kubernetes delivers it: a ConfigMap volume whose `..data` symlink is
//! swapped to a new directory (the file tongs reads never changes itself). Real files, real inotify,
//! real sockets; only the kubelet is played by the test.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use http::{Request, Response};
use hyper::body::Incoming;
use tokio_util::sync::CancellationToken;
use tongs::App;
use tongs::config::Config;

/// A ConfigMap volume: `root/tongs.yaml` → `..data/tongs.yaml`, `..data` → `..<version>`.
struct Volume {
    root: PathBuf,
    version: u32,
}

impl Volume {
    fn new(text: &str) -> Volume {
        let root = std::env::temp_dir().join(format!(
            "tongs-reload-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&root).unwrap();
        let mut volume = Volume { root, version: 0 };
        volume.publish(text);
        std::os::unix::fs::symlink("..data/tongs.yaml", volume.file()).unwrap();
        volume
    }

    fn file(&self) -> PathBuf {
        self.root.join("tongs.yaml")
    }

    /// What the kubelet does: write the new version beside the old, then swap `..data` atomically.
    fn publish(&mut self, text: &str) {
        self.version += 1;
        let dir = format!("..2026_12_02_v{}", self.version);
        std::fs::create_dir(self.root.join(&dir)).unwrap();
        std::fs::write(self.root.join(&dir).join("tongs.yaml"), text).unwrap();
        let staging = self.root.join("..data_tmp");
        let _ = std::fs::remove_file(&staging);
        std::os::unix::fs::symlink(&dir, &staging).unwrap();
        std::fs::rename(&staging, self.root.join("..data")).unwrap();
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn config_text(endpoint: &str, extra: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\nadmin: {{ listen: 127.0.0.1:0 }}\nhealth: {{ enabled: false }}\n{extra}\
         discovery:\n  static:\n    - url: {endpoint}\n"
    )
}

async fn start(path: &Path) -> (TestProxy, Arc<tongs::proxy::Proxy>) {
    let config = Config::load(path).unwrap();
    let app = App::bind(&config)
        .await
        .unwrap()
        .watch_config(path.to_owned());
    let proxy = app.parts().proxy();
    let test = TestProxy {
        addr: app.proxy_addr(),
        admin: app.admin_addr(),
        app_registry: app.registry(),
        app_queue: app.queue(),
        shutdown: CancellationToken::new(),
        task: tokio::spawn(async {}),
    };
    let shutdown = test.shutdown.clone();
    let task = tokio::spawn(app.run(shutdown));
    (TestProxy { task, ..test }, proxy)
}

const TEN_SECONDS: Duration = Duration::from_secs(10);

/// The value of one sample on the /metrics page.
async fn metric(proxy: &TestProxy, series: &str) -> Option<f64> {
    let (_, text) = get(&format!("http://{}/metrics", proxy.admin)).await;
    crate::support::one_pool(&text).lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok()).flatten()
    })
}

#[tokio::test]
async fn a_configmap_swap_changes_behaviour_without_dropping_a_request() {
    // A answers only once the test lets it (after the swap); B at once.
    let gate = Gate::default();
    let held = gate.clone();
    let a = backend(move |_request: Request<Incoming>| {
        let gate = held.clone();
        async move {
            gate.pass().await;
            Response::new(full("A"))
        }
    })
    .await;
    let b = text_backend("B").await;
    let mut volume = Volume::new(&config_text(&a.url(), ""));
    let (proxy, handle) = start(&volume.file()).await;
    let url = proxy.url("/v1/generate");

    // In flight on A while the configuration moves everything to B.
    let in_flight = tokio::spawn({
        let url = url.clone();
        async move { get(&url).await }
    });
    eventually("the request on A", HANG, || {
        proxy.app_registry.snapshot()[0].outstanding() == 1
    })
    .await;
    volume.publish(&config_text(
        &b.url(),
        "concurrency: { limit: static, max_outstanding_per_endpoint: 2 }\n\
         timeouts: { total: 40s, response_headers: 20s }\n\
         balancer: { policy: least-outstanding }\n",
    ));
    eventually("B in the set", Duration::from_secs(10), || {
        proxy
            .app_registry
            .snapshot()
            .iter()
            .any(|e| e.url() == b.url())
    })
    .await;
    assert_eq!(get(&url).await, (200, "B".to_owned()));
    gate.release(1);
    assert_eq!(
        in_flight.await.unwrap(),
        (200, "A".to_owned()),
        "the request under way finished on the endpoint that left"
    );
    let endpoint = Arc::clone(&proxy.app_registry.snapshot()[0]);
    assert_eq!(endpoint.load().limit(), Some(2), "limits applied live");
    assert_eq!(
        handle.settings().total_timeout,
        Duration::from_secs(40),
        "timeouts applied live"
    );
    assert_eq!(
        handle.settings().balance.policy,
        tongs::config::BalancePolicy::LeastOutstanding,
        "the balancer policy switched live"
    );
    let (_, debug) = get(&format!("http://{}/debug/endpoints", proxy.admin)).await;
    assert!(debug.contains(r#""policy":"least-outstanding""#), "{debug}");
    assert_eq!(
        metric(&proxy, r#"tongs_config_reloads_total{result="applied"}"#).await,
        Some(1.0)
    );

    // An invalid version: rejected, counted, and the configuration in force stays.
    volume.publish(&config_text(
        &a.url(),
        "retry: { max_attempts: 99 }\nbalancer: { polcy: least-outstanding }\n",
    ));
    eventually_async("the invalid reload counted", TEN_SECONDS, || async {
        metric(&proxy, r#"tongs_config_reloads_total{result="invalid"}"#).await == Some(1.0)
    })
    .await;
    assert_eq!(get(&url).await, (200, "B".to_owned()));
    assert_eq!(proxy.app_registry.snapshot().len(), 1);
    assert_eq!(proxy.app_registry.snapshot()[0].url(), b.url());

    // An empty version (a ConfigMap emptied or caught half written): rejected too, not read as "every
    // default", which would have dropped every endpoint.
    volume.publish("# nothing yet\n");
    eventually_async("the empty reload counted", TEN_SECONDS, || async {
        metric(&proxy, r#"tongs_config_reloads_total{result="invalid"}"#).await == Some(2.0)
    })
    .await;
    assert_eq!(get(&url).await, (200, "B".to_owned()));
    assert_eq!(proxy.app_registry.snapshot().len(), 1);

    // Fixed again: applied.
    volume.publish(&config_text(&a.url(), ""));
    eventually_async("the fixed version applied", TEN_SECONDS, || async {
        metric(&proxy, r#"tongs_config_reloads_total{result="applied"}"#).await == Some(2.0)
    })
    .await;
    assert_eq!(proxy.app_registry.snapshot()[0].url(), a.url());
    assert_eq!(
        proxy.app_registry.snapshot()[0].load().limit(),
        None,
        "limit back to none"
    );
    proxy.stop().await;
}

/// Replaces `file`'s content the way editors save: a new file beside it, renamed over it (a reload never
/// sees it half written).
fn save(file: &Path, content: impl AsRef<[u8]>) {
    let staging = file.with_extension("yaml.new");
    std::fs::write(&staging, content).unwrap();
    std::fs::rename(&staging, file).unwrap();
}

/// A plain file (no ConfigMap volume): tongs' own reads of it must not count as
/// changes, and a bad version is reported once, not on every look at it.
#[tokio::test]
async fn a_bad_version_is_reported_once_and_reads_do_not_trigger_reloads() {
    let a = text_backend("A").await;
    let b = text_backend("B").await;
    let dir = TempDir::new("reload-plain");
    let file = dir.0.join("tongs.yaml");
    std::fs::write(&file, config_text(&a.url(), "")).unwrap();
    let (proxy, _) = start(&file).await;
    let invalid = r#"tongs_config_reloads_total{result="invalid"}"#;
    let applied = r#"tongs_config_reloads_total{result="applied"}"#;

    // Not UTF-8: the file cannot even be read as text.
    save(&file, b"listen: \xff\xfe127.0.0.1:0\n");
    eventually_async("the unreadable version counted", TEN_SECONDS, || async {
        metric(&proxy, invalid).await == Some(1.0)
    })
    .await;
    // Seven times the watcher's 200 ms debounce: a watcher woken by its own reads would count again.
    tokio::time::sleep(Duration::from_millis(1400)).await;
    assert_eq!(metric(&proxy, invalid).await, Some(1.0), "counted once");

    // Another bad version is news, and is counted, once.
    save(
        &file,
        config_text(&b.url(), "balancer: { polcy: least-outstanding }\n"),
    );
    eventually_async("the invalid version counted", TEN_SECONDS, || async {
        metric(&proxy, invalid).await == Some(2.0)
    })
    .await;
    // The same window on purpose: nothing may happen during it, which no poll can show sooner.
    tokio::time::sleep(Duration::from_millis(1400)).await;
    assert_eq!(metric(&proxy, invalid).await, Some(2.0), "counted once");
    assert_eq!(get(&proxy.url("/")).await, (200, "A".to_owned()));

    // Fixed: applied.
    save(&file, config_text(&b.url(), ""));
    eventually_async("the fixed version applied", TEN_SECONDS, || async {
        metric(&proxy, applied).await == Some(1.0)
    })
    .await;
    assert_eq!(get(&proxy.url("/")).await, (200, "B".to_owned()));
    assert_eq!(metric(&proxy, invalid).await, Some(2.0));
    proxy.stop().await;
}

/// A rotated admin token (the Secret's file rewritten, as the kubelet does) takes effect with the next
/// reload, without a restart; the old token stops working then.
#[tokio::test]
async fn a_rotated_admin_token_takes_effect_on_reload() {
    let backend = text_backend("ok").await;
    let dir = TempDir::new("admin-token");
    let token_file = dir.0.join("token");
    std::fs::write(&token_file, "first\n").unwrap();
    let extra = format!(
        "admin: {{ listen: 127.0.0.1:0, bearer_token_file: {} }}\n",
        token_file.display()
    );
    let text = config_text(&backend.url(), "").replace("admin: { listen: 127.0.0.1:0 }\n", &extra);
    let mut volume = Volume::new(&text);
    let (proxy, _) = start(&volume.file()).await;
    let status = |token: &'static str| {
        let url = format!("http://{}/debug/endpoints", proxy.admin);
        async move {
            let request = Request::get(url)
                .header("authorization", format!("Bearer {token}"))
                .body(full(""))
                .unwrap();
            send(request).await.0
        }
    };
    assert_eq!(status("first").await, 200);
    assert_eq!(status("second").await, 401);

    std::fs::write(&token_file, "second\n").unwrap();
    // The file alone is not watched: the token in force stays until a reload.
    assert_eq!(status("first").await, 200);
    volume.publish(&format!("{text}# rotated\n"));
    eventually_async("the rotated token in force", TEN_SECONDS, || async {
        status("second").await == 200
    })
    .await;
    assert_eq!(status("first").await, 401);

    // An empty token file makes the new version invalid (validation names the field): rejected, and the
    // token in force stays.
    std::fs::write(&token_file, "   \n").unwrap();
    volume.publish(&format!("{text}# emptied\n"));
    let rejected = || async {
        let request = Request::get(format!("http://{}/metrics", proxy.admin))
            .header("authorization", "Bearer second")
            .body(full(""))
            .unwrap();
        let (_, text) = send(request).await;
        text.contains("tongs_config_reloads_total{result=\"invalid\"} 1")
    };
    eventually_async("the emptied version rejected", TEN_SECONDS, rejected).await;
    assert_eq!(status("second").await, 200);
    assert_eq!(status("").await, 401);
    proxy.shutdown.cancel();
}
