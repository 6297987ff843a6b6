//! Real vLLM servers for the tests: started once per test binary through `scripts/vllm.sh` (which
//! installs nothing: `scripts/test.sh` has installed vLLM and built the tiny model before), shared by
//! the tests one at a time, and brought back by whichever test finds one down. Each dies with the test
//! binary (`serve --watch`).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use tokio::sync::{Mutex, MutexGuard};

/// How many servers the tests share: three fit in 24 GiB beside tongs, and one can die or wedge while
/// two still serve.
pub const SERVERS: usize = 3;

/// The servers and whether each is up as the tests left it.
pub struct Fleet {
    pub ports: Vec<u16>,
}

static FLEET: Mutex<Option<Fleet>> = Mutex::const_new(None);

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/vllm.sh")
}

/// Runs `scripts/vllm.sh ARGS`, failing the test with its output when it fails.
pub fn vllm_sh(args: &[&str]) -> String {
    let output = Command::new("bash")
        .arg(script())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("bash scripts/vllm.sh {args:?} could not run: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "bash scripts/vllm.sh {} failed ({}); a real vLLM is needed: `bash scripts/vllm.sh install && \
         bash scripts/vllm.sh model` (scripts/test.sh runs both):\n{text}",
        args.join(" "),
        output.status
    );
    text
}

/// Runs `scripts/vllm.sh ARGS` off the runtime's thread.
pub async fn vllm_sh_async(args: Vec<String>) -> String {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        vllm_sh(&args)
    })
    .await
    .expect("vllm.sh ran")
}

fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("bound").port())
        .collect()
}

/// Whether `request` gets a 200 within `limit` (a refused connection is a no, not a panic).
async fn answers(request: http::Request<crate::support::TestBody>, limit: Duration) -> bool {
    let exchange = crate::support::client().request(request);
    matches!(
        tokio::time::timeout(limit, exchange).await,
        Ok(Ok(response)) if response.status() == 200
    )
}

async fn healthy(port: u16) -> bool {
    let request = http::Request::get(format!("http://127.0.0.1:{port}/health"))
        .body(crate::support::full(""))
        .expect("a request");
    answers(request, Duration::from_secs(2)).await
}

/// The fleet, every server up, held by the calling test alone until the guard drops.
pub async fn fleet() -> MutexGuard<'static, Option<Fleet>> {
    let mut guard = FLEET.lock().await;
    if guard.is_none() {
        let ports = free_ports(SERVERS);
        let mut args = vec![
            "serve".to_owned(),
            "--watch".into(),
            std::process::id().to_string(),
        ];
        args.extend(ports.iter().map(u16::to_string));
        vllm_sh_async(args).await;
        *guard = Some(Fleet { ports });
    }
    let fleet = guard.as_ref().expect("started");
    // A test before may have killed or wedged one: bring it back (a wedged one is woken first).
    let mut down = Vec::new();
    for &port in &fleet.ports {
        vllm_sh_async(vec!["unwedge".into(), port.to_string()]).await;
        if !healthy(port).await || !completes(port).await {
            down.push(port);
        }
    }
    if !down.is_empty() {
        let mut stop = vec!["stop".to_owned()];
        stop.extend(down.iter().map(u16::to_string));
        vllm_sh_async(stop).await;
        let mut serve = vec![
            "serve".to_owned(),
            "--watch".into(),
            std::process::id().to_string(),
        ];
        serve.extend(down.iter().map(u16::to_string));
        vllm_sh_async(serve).await;
    }
    guard
}

/// Whether the server at `port` completes a one-token request within 30 s.
async fn completes(port: u16) -> bool {
    let body = serde_json::json!({"model": "tiny", "prompt": "a", "max_tokens": 1});
    let request = http::Request::post(format!("http://127.0.0.1:{port}/v1/completions"))
        .header("content-type", "application/json")
        .body(crate::support::full(body.to_string()))
        .expect("a request");
    answers(request, Duration::from_secs(30)).await
}

/// The URL of the server at `port`.
pub fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}
