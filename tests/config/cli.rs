//! The `tongs` binary itself: config checking with exit code 64, and a SIGTERM drain that lets an
//! in-flight stream run to its end while new connections are refused.
//!
//! The endpoints are in-process backends standing in for GPU nodes.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http_body_util::BodyExt;
use http_body_util::channel::Channel;

const TONGS: &str = env!("CARGO_BIN_EXE_tongs");

fn write_config(name: &str, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("tongs-cli-{}-{name}.yaml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

/// Replaces `path`'s content the way editors save: a new file beside it, renamed over it. A reload
/// never reads it half written (`std::fs::write` truncates first: a reload reading in between finds an
/// empty file, which is a valid configuration of defaults).
fn replace(path: &Path, text: &str) {
    let staging = path.with_extension("yaml.new");
    std::fs::write(&staging, text).unwrap();
    std::fs::rename(&staging, path).unwrap();
}

#[test]
fn check_config_prints_the_effective_config() {
    let path = write_config(
        "good",
        "listen: 127.0.0.1:8080\ndiscovery:\n  static:\n    - url: http://10.0.0.7:8000\n",
    );
    let output = Command::new(TONGS)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let effective = String::from_utf8(output.stdout).unwrap();
    for expected in [
        "listen: 127.0.0.1:8080",
        "url: http://10.0.0.7:8000",
        "weight: 1",
        "connect: 2s",
        "grace: 25s",
    ] {
        assert!(
            effective.contains(expected),
            "missing {expected:?} in:\n{effective}"
        );
    }
}

#[test]
fn bad_config_exits_64_naming_every_field() {
    let path = write_config(
        "semantic",
        "discovery:\n  static:\n    - url: 10.0.0.7:8000\n      weight: 0\ntimeouts: { connect: 0s }\n",
    );
    for command in ["check-config", "run"] {
        let mut cmd = Command::new(TONGS);
        match command {
            "run" => cmd.arg("run").arg("--config").arg(&path),
            _ => cmd.arg(command).arg(&path),
        };
        let output = cmd.output().unwrap();
        assert_eq!(output.status.code(), Some(64), "{command}: {output:?}");
        let stderr = String::from_utf8(output.stderr).unwrap();
        for field in [
            "discovery.static[0].url",
            "discovery.static[0].weight",
            "timeouts.connect",
        ] {
            assert!(
                stderr.contains(field),
                "{command}: {field} not named in:\n{stderr}"
            );
        }
    }
}

#[test]
fn endpoint_urls_with_a_bad_port_or_an_empty_host_label_are_named() {
    let path = write_config(
        "endpoint-urls",
        "discovery:\n  static:\n    - url: http://10.0.0.7:0\n    - url: http://10.0.0.7:99999\n\
         \x20   - url: https://a..salad.cloud\n    - url: http://10.0.0.7:8000\n",
    );
    let output = Command::new(TONGS)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64), "{output:?}");
    let stderr = String::from_utf8(output.stderr).unwrap();
    for line in [
        "discovery.static[0].url: \"http://10.0.0.7:0\" has port 0",
        "discovery.static[1].url: \"http://10.0.0.7:99999\" has port 99999",
        "discovery.static[2].url: \"https://a..salad.cloud\"",
    ] {
        assert!(stderr.contains(line), "{line:?} not in:\n{stderr}");
    }
    assert!(stderr.contains("empty label"), "{stderr}");
    assert!(!stderr.contains("static[3]"), "{stderr}");
}

#[test]
fn unknown_key_and_unreadable_file_are_refused() {
    let path = write_config("typo", "timeouts:\n  conect: 2s\n");
    let output = Command::new(TONGS)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("timeouts.conect"), "{stderr}");

    let output = Command::new(TONGS)
        .args(["check-config", "/nonexistent/tongs.yaml"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    assert!(
        String::from_utf8(output.stderr)
            .unwrap()
            .contains("/nonexistent/tongs.yaml")
    );
}

/// One run names every problem of a file: unknown keys, values of the wrong type, a list entry without
/// its required field, a pool's section, and what only validation catches — not just the first one the
/// parser met. A YAML syntax error is the one problem of its file (nothing past it can be read).
#[test]
fn check_config_names_every_problem_in_one_run() {
    let path = write_config(
        "many",
        "timeouts:\n  conect: 2s\n  total: forever\nqueue:\n  max_length: -3\n  max_wiat: 10s\n\
         discovery:\n  static:\n    - url: http://a:1\n    - uri: http://b:2\n\
         workers: 5000\npools:\n  - name: x\n    balancer: { polcy: p2c }\n",
    );
    let output = Command::new(TONGS)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8(output.stderr).unwrap();
    for field in [
        "  - timeouts.conect: ",
        "  - timeouts.total: invalid duration",
        "  - queue.max_length: ",
        "  - queue.max_wiat: unknown field",
        "  - discovery.static[1].uri: unknown field",
        "  - pools[0].balancer.polcy: unknown field",
        "  - workers: must be at most 1024",
    ] {
        assert!(stderr.contains(field), "{field:?} not in:\n{stderr}");
    }
    assert_eq!(
        stderr.matches("timeouts.conect").count(),
        1,
        "each problem once:\n{stderr}"
    );

    let path = write_config("syntax", "listen: [\nworkers: x\n");
    let output = Command::new(TONGS)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(stderr.matches("\n  - ").count(), 1, "{stderr}");
}

/// A running `tongs run` process whose JSON log lines arrive on a channel.
struct Running {
    child: Child,
    logs: mpsc::Receiver<serde_json::Value>,
    /// Everything it wrote to stderr, line by line.
    raw: Arc<Mutex<Vec<String>>>,
}

impl Running {
    fn start(config: &PathBuf) -> Running {
        Running::start_with(config, "info", &[])
    }

    /// Starts with log filter `filter` (`RUST_LOG`) and extra environment variables.
    fn start_with(config: &PathBuf, filter: &str, env: &[(&str, &str)]) -> Running {
        let mut child = Command::new(TONGS)
            .args(["--log-format", "json", "run", "--config"])
            .arg(config)
            .env("RUST_LOG", filter)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (send, logs) = mpsc::channel();
        let raw = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&raw);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                kept.lock().unwrap().push(line.clone());
                if let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) {
                    // The receiver may be gone while the raw lines are still wanted.
                    let _ = send.send(value);
                }
            }
        });
        Running { child, logs, raw }
    }

    /// Waits for the log line with this message and returns it.
    fn wait_for_log(&self, message: &str) -> serde_json::Value {
        loop {
            let line = self
                .logs
                .recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("no log line {message:?} within 20s"));
            if line["message"] == message {
                return line;
            }
        }
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_an_in_flight_stream_then_exits_zero() {
    // The endpoint streams ten events, 150 ms apart: about 1.5 s in all.
    let backend = backend(|_request| async {
        let (mut sender, body) = Channel::<Bytes, BoxError>::new(1);
        tokio::spawn(async move {
            for i in 0..10 {
                if sender
                    .send_data(Bytes::from(format!("data: {i}\n\n")))
                    .await
                    .is_err()
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        });
        http::Response::builder()
            .header("content-type", "text/event-stream")
            .body(body.boxed())
            .unwrap()
    })
    .await;
    let config = write_config(
        "drain",
        &format!(
            "listen: 127.0.0.1:0\nadmin: {{ listen: 127.0.0.1:0 }}\nshutdown: {{ grace: 20s }}\n\
             discovery:\n  static:\n    - url: {}\n",
            backend.url()
        ),
    );
    let mut running = Running::start(&config);
    let serving = running.wait_for_log("tongs serving");
    let listen = serving["listen"].as_str().unwrap().to_owned();
    let admin = serving["admin"].as_str().unwrap().to_owned();
    assert_eq!(get(&format!("http://{admin}/readyz")).await.0, 200);

    let response = client()
        .get(format!("http://{listen}/v1/stream").parse().unwrap())
        .await
        .unwrap();
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, Bytes::from_static(b"data: 0\n\n"));

    running.signal("TERM");
    running.wait_for_log("stopped accepting; draining in-flight requests");
    // While draining, the pod reports unready so the Service stops sending it clients.
    assert_eq!(get(&format!("http://{admin}/readyz")).await.0, 503);
    // New connections are refused while the stream goes on (every worker closes its listener).
    eventually_async(
        "the listener refusing connections after SIGTERM",
        Duration::from_secs(5),
        || async { tokio::net::TcpStream::connect(&listen).await.is_err() },
    )
    .await;

    let mut rest = Vec::new();
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("stream keeps flowing during the drain")
    {
        rest.extend_from_slice(
            &frame
                .expect("stream not cut by the drain")
                .into_data()
                .unwrap(),
        );
    }
    let expected: String = (1..10).map(|i| format!("data: {i}\n\n")).collect();
    assert_eq!(String::from_utf8(rest).unwrap(), expected);

    running.wait_for_log("drained: every in-flight request finished");
    let status = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = running.child.try_wait().unwrap() {
                return Some(status);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap()
    .expect("tongs exits after the drain");
    assert_eq!(status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_configuration() {
    let a = text_backend("A").await;
    let b = text_backend("B").await;
    let text = |endpoint: &str| {
        format!(
            "listen: 127.0.0.1:0\nadmin: {{ listen: 127.0.0.1:0 }}\nhealth: {{ enabled: false }}\n\
             discovery:\n  static:\n    - url: {endpoint}\n"
        )
    };
    let config = write_config("sighup", &text(&a.url()));
    let running = Running::start(&config);
    let serving = running.wait_for_log("tongs serving");
    let listen = serving["listen"].as_str().unwrap().to_owned();
    assert_eq!(get(&format!("http://{listen}/")).await.1, "A");

    // Unchanged file: SIGHUP still reloads (an operator's explicit request), and says so.
    running.signal("HUP");
    let reloaded = running.wait_for_log("configuration reloaded");
    assert_eq!(reloaded["trigger"], "SIGHUP", "{reloaded}");

    // A changed file is picked up (by the directory watch, or by SIGHUP; either way once applied).
    // Saved whole (see `replace`): the log line awaited may be the watch's reload, and a SIGHUP still
    // to be handled must then not read the next version half written.
    replace(&config, &text(&b.url()));
    running.signal("HUP");
    running.wait_for_log("configuration reloaded");
    eventually_answer(&format!("http://{listen}/"), "B").await;

    // A listen address cannot change without a restart: applied otherwise, and the log says so.
    replace(
        &config,
        &text(&b.url()).replace("listen: 127.0.0.1:0\n", "listen: 127.0.0.1:1\n"),
    );
    running.signal("HUP");
    let restart = running.wait_for_log("these changed keys take effect only after a restart");
    assert_eq!(restart["keys"], "listen", "{restart}");
    std::fs::remove_file(&config).unwrap();
}

/// Polls `url` until it answers `text` (10 s at most).
async fn eventually_answer(url: &str, text: &str) {
    eventually_async(
        &format!("{url} answering {text:?}"),
        Duration::from_secs(10),
        || async { get(url).await.1 == text },
    )
    .await;
}

/// The SaladCloud key reaches the gateway, yet no log line carries it, not even with every crate
/// logging at trace level; nor does the key a client tried to send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_salad_api_key_is_sent_but_never_logged() {
    const KEY: &str = "sk-tongs-never-log-me-5e1f";
    const CLIENT_KEY: &str = "sk-client-never-log-me-77a0";
    // Plays a gateway: answers with the key it was sent, and counts heartbeats that carried it.
    let heartbeats = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&heartbeats);
    let gateway = backend(move |request: http::Request<hyper::body::Incoming>| {
        let counted = Arc::clone(&counted);
        async move {
            let key = request
                .headers()
                .get("salad-api-key")
                .map_or("none".to_owned(), |v| {
                    String::from_utf8_lossy(v.as_bytes()).into_owned()
                });
            if request.uri().path() == "/health" && key == KEY {
                counted.fetch_add(1, Ordering::Relaxed);
            }
            http::Response::new(full(key))
        }
    })
    .await;
    let config = write_config(
        "salad-key",
        &format!(
            "listen: 127.0.0.1:0\nadmin: {{ listen: 127.0.0.1:0 }}\n\
             health: {{ interval: 200ms, timeout: 1s }}\n\
             salad: {{ api_key_env: TONGS_SALAD_KEY, gateways: [\"http://127.0.0.1\"] }}\n\
             discovery:\n  static:\n    - url: {}\n",
            gateway.url()
        ),
    );
    let running = Running::start_with(&config, "trace", &[("TONGS_SALAD_KEY", KEY)]);
    let serving = running.wait_for_log("tongs serving");
    let listen = serving["listen"].as_str().unwrap().to_owned();
    for _ in 0..3 {
        let request = http::Request::get(format!("http://{listen}/v1/chat"))
            .header("salad-api-key", CLIENT_KEY)
            .body(full(""))
            .unwrap();
        assert_eq!(send(request).await, (200, KEY.to_owned()));
    }
    eventually("three heartbeats with the key", HANG, || {
        heartbeats.load(Ordering::Relaxed) >= 3
    })
    .await;
    let lines = running.raw.lock().unwrap().clone();
    assert!(
        lines.len() > 20,
        "trace logging wrote {} lines",
        lines.len()
    );
    let leaks: Vec<_> = lines
        .iter()
        .filter(|line| line.contains(KEY) || line.contains(CLIENT_KEY))
        .collect();
    assert!(leaks.is_empty(), "a key reached the log: {leaks:?}");
    std::fs::remove_file(&config).unwrap();
}

/// `check-config` refuses the examples' placeholders, naming each field; a parse error names the file
/// rather than the parser's `<input>`.
#[test]
fn check_config_refuses_placeholders_and_names_the_file_in_parse_errors() {
    let path = write_config(
        "placeholders",
        "salad:\n  api_key_env: TONGS_TEST_KEY\n  api:\n    organization: replace-with-organization-name\n\
         \x20   project: replace-with-project-name\n",
    );
    let output = Command::new(TONGS)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64), "{output:?}");
    let stderr = String::from_utf8(output.stderr).unwrap();
    for field in ["salad.api.organization:", "salad.api.project:"] {
        assert!(stderr.contains(field), "{field} not in:\n{stderr}");
    }
    assert!(stderr.contains("placeholder"), "{stderr}");
    assert!(
        output.stdout.is_empty(),
        "nothing printed as a valid config"
    );

    let path = write_config("parse-error", "timeouts:\n  connect: [\n");
    let output = Command::new(TONGS)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(!stderr.contains("<input>"), "{stderr}");
    assert!(
        stderr.matches(&path.display().to_string()).count() >= 2,
        "the file named in the heading and at the error's place:\n{stderr}"
    );
}

/// Logs written to a pipe (a file, a collector) carry no terminal colour codes.
#[test]
fn text_logs_to_a_pipe_are_plain() {
    let path = write_config(
        "plain-logs",
        "listen: 127.0.0.1:0\nadmin: { listen: 127.0.0.1:0 }\nhealth: { enabled: false }\n",
    );
    let mut child = Command::new(TONGS)
        .args(["run", "--config"])
        .arg(&path)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (send, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if send.send(line).is_err() {
                break;
            }
        }
    });
    let serving = loop {
        let line = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("tongs logs that it serves within 30 s");
        if line.contains("tongs serving") {
            break line;
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(!serving.contains('\u{1b}'), "colour codes in {serving:?}");
    assert!(serving.contains("INFO"), "{serving:?}");
}
