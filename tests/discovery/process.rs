//! The `tongs` binary with discovery: an `HTTPS_PROXY` in its environment (set for other traffic)
//! does not keep it from reaching the API server, which kube would otherwise route through that proxy
//! and fail to build a client for.
//!
//! The Kubernetes API server is the fake of `tests/support/kube_api/` (kube-rs's real client talks to it
//! through a kubeconfig); the GPU nodes the pods stand for are in-process backends on loopback addresses.

use std::process::{Command, Stdio};

use crate::harness::*;
use crate::support::*;

const TONGS: &str = env!("CARGO_BIN_EXE_tongs");

/// Kills the child on drop.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn an_https_proxy_in_the_environment_does_not_stop_discovery() {
    let cluster = Cluster::start("tongs-discovery-proxy-env").await;
    let node = named("127.0.0.2", "node").await;
    serve_pod(&cluster.api, "llm-0", "127.0.0.2", node.port());
    // Fixed ports for the binary's listeners: free ones, taken and released.
    let (listen, admin) = (free_port(), free_port());
    let config = cluster.file(
        "tongs.yaml",
        &format!(
            "listen: 127.0.0.1:{listen}\nadmin: {{ listen: 127.0.0.1:{admin} }}\nhealth: {{ enabled: false }}\n\
             discovery:\n  kubernetes:\n    enabled: true\n    kubeconfig: {}\n    namespace: {NS}\n\
             \x20   label_selector: app=llm\n    allow: [127.0.0.0/8]\n",
            cluster.kubeconfig.display()
        ),
    );
    let _tongs = Child(
        Command::new(TONGS)
            .args(["run", "--config"])
            .arg(&config)
            // Nothing listens on port 9: traffic sent through this proxy would fail.
            .env("HTTPS_PROXY", "http://127.0.0.1:9")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("tongs starts"),
    );
    let proxy_url = format!("http://127.0.0.1:{listen}/");
    until("tongs serves the pod it discovered", || {
        let url = proxy_url.clone();
        async move {
            match tokio::time::timeout(std::time::Duration::from_secs(2), async {
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build_http::<TestBody>()
                    .request(http::Request::get(&url).body(full("")).expect("request"))
                    .await
            })
            .await
            {
                Ok(Ok(response)) => response.status() == 200,
                _ => false,
            }
        }
    })
    .await;
    assert!(node.hits() > 0);
    cluster.assert_faithful();
}
