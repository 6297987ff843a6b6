//! deploy/node/register.sh, the GPU node's entrypoint example, run against a scripted registration
//! endpoint on loopback. Its test mode (`SKIP_TAILSCALE=1`) leaves out what needs a tailnet: tailscaled,
//! `tailscale up`, finding the node's Tailscale IP and the SOCKS5 proxy (the address is given, curl goes
//! direct). What this shows is the rest: the body it sends (from the downward API variables or
//! SaladCloud's POD_METADATA_YAML), the token, retrying 404 / 409 / 5xx / refused connections until
//! 200, and stopping at once with a message when tongs refuses for good.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::ROOT;

const SCRIPT: &str = "deploy/node/register.sh";
const TOKEN: &str = "fleet-token-0123";

/// One request the fake endpoint received: request line, Authorization header, body.
#[derive(Debug)]
struct Received {
    line: String,
    authorization: Option<String>,
    body: Value,
}

/// Serves one connection per entry of `answers` (status, body; status 0 closes the connection without
/// an answer), then stops listening.
fn endpoint(answers: Vec<(u16, &'static str)>) -> (String, JoinHandle<Vec<Received>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "http://{}/v1/nodes/register",
        listener.local_addr().unwrap()
    );
    let server = std::thread::spawn(move || {
        let mut received = Vec::new();
        for (status, answer) in answers {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream);
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let (mut length, mut authorization) = (0, None);
            loop {
                let mut header = String::new();
                reader.read_line(&mut header).unwrap();
                let header = header.trim_end();
                if header.is_empty() {
                    break;
                }
                let (name, value) = header.split_once(':').unwrap();
                match name.to_ascii_lowercase().as_str() {
                    "content-length" => length = value.trim().parse().unwrap(),
                    "authorization" => authorization = Some(value.trim().to_owned()),
                    _ => {}
                }
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            received.push(Received {
                line: line.trim_end().to_owned(),
                authorization,
                body: serde_json::from_slice(&body).unwrap_or(Value::Null),
            });
            if status == 0 {
                continue;
            }
            write!(
                reader.get_mut(),
                "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
                answer.len()
            )
            .unwrap();
        }
        received
    });
    (url, server)
}

/// Runs the script in test mode with only `env` (and PATH) set; its exit code and stderr. Killed
/// after 30 s: a script that never stops fails the test rather than hanging it.
fn run(env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut command = Command::new("sh");
    command
        .arg(format!("{ROOT}/{SCRIPT}"))
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs([("SKIP_TAILSCALE", "1"), ("REGISTER_MAX_DELAY", "1")])
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("sh runs");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{SCRIPT} did not finish within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status.code(), stderr)
}

fn pod_env(url: &str) -> Vec<(&'static str, String)> {
    vec![
        ("TONGS_REGISTER_URL", url.to_owned()),
        ("TONGS_REGISTRATION_TOKEN", TOKEN.to_owned()),
        ("MODEL_PORT", "8000".to_owned()),
        ("TONGS_NODE_IP", "100.101.102.103".to_owned()),
        ("POD_NAMESPACE", "gpu".to_owned()),
        ("POD_NAME", "llm-7d9f-abcde".to_owned()),
        ("POD_UID", "4b1e0f6e-2c1d-4c55-9d0e-3f7a1c9b8e21".to_owned()),
    ]
}

fn borrowed<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn expected_body() -> Value {
    json!({
        "namespace": "gpu",
        "pod": "llm-7d9f-abcde",
        "uid": "4b1e0f6e-2c1d-4c55-9d0e-3f7a1c9b8e21",
        "address": "100.101.102.103:8000",
    })
}

#[test]
fn the_script_is_posix_sh_and_shellcheck_clean() {
    let status = Command::new("sh")
        .arg("-n")
        .arg(format!("{ROOT}/{SCRIPT}"))
        .status()
        .expect("sh runs");
    assert!(status.success(), "sh -n {SCRIPT}");
    // As POSIX sh (dash, busybox): a GPU image's /bin/sh is seldom bash.
    let output = Command::new("shellcheck")
        .args(["--shell=sh", "--severity=style"])
        .arg(format!("{ROOT}/{SCRIPT}"))
        .output()
        .expect("shellcheck is missing (Debian's shellcheck; scripts/test.sh installs it)");
    assert!(
        output.status.success(),
        "shellcheck {SCRIPT}:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
}

#[test]
fn it_retries_until_tongs_answers_200() {
    // Not watched yet, another address for now, a replica restarting, then registered.
    let (url, server) = endpoint(vec![(404, "{}"), (409, "{}"), (503, ""), (200, "{}")]);
    let env = pod_env(&url);
    let (code, stderr) = run(&borrowed(&env));
    assert_eq!(code, Some(0), "{stderr}");
    let received = server.join().unwrap();
    assert_eq!(received.len(), 4, "{received:#?}");
    for request in &received {
        assert_eq!(request.line, "POST /v1/nodes/register HTTP/1.1");
        assert_eq!(
            request.authorization.as_deref(),
            Some(format!("Bearer {TOKEN}").as_str())
        );
        assert_eq!(request.body, expected_body());
    }
    assert!(stderr.contains("registered gpu/llm-7d9f-abcde"), "{stderr}");
}

#[test]
fn a_connection_closed_without_an_answer_is_retried_too() {
    // A replica that dies mid-request: the connection closes with no answer at all.
    let (url, server) = endpoint(vec![(0, ""), (200, "{}")]);
    let env = pod_env(&url);
    let (code, stderr) = run(&borrowed(&env));
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(server.join().unwrap().len(), 2);
    assert!(stderr.contains("not registered yet (000)"), "{stderr}");
}

#[test]
fn the_pod_comes_from_pod_metadata_yaml_on_saladcloud() {
    assert!(
        Command::new("jq").arg("--version").output().is_ok(),
        "jq is missing (Debian's jq)"
    );
    let (url, server) = endpoint(vec![(200, "{}")]);
    let mut env = pod_env(&url);
    env.retain(|(key, _)| !key.starts_with("POD_"));
    let metadata = json!({
        "namespace": "gpu",
        "name": "llm-7d9f-abcde",
        "uid": "4b1e0f6e-2c1d-4c55-9d0e-3f7a1c9b8e21",
        "labels": {"app.kubernetes.io/part-of": "tongs-fleet"},
    });
    env.push(("POD_METADATA_YAML", metadata.to_string()));
    let (code, stderr) = run(&borrowed(&env));
    assert_eq!(code, Some(0), "{stderr}");
    let received = server.join().unwrap();
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].body, expected_body());
}

#[test]
fn it_stops_at_once_when_tongs_refuses_for_good() {
    for (status, answer, hint) in [
        (
            401,
            r#"{"error":"unauthorized"}"#,
            "TONGS_REGISTRATION_TOKEN",
        ),
        (403, r#"{"error":"wrong-uid"}"#, "wrong-uid"),
        (400, r#"{"error":"bad body"}"#, "bad body"),
    ] {
        let (url, server) = endpoint(vec![(status, answer)]);
        let env = pod_env(&url);
        let (code, stderr) = run(&borrowed(&env));
        assert_eq!(code, Some(3), "{status}: {stderr}");
        assert_eq!(
            server.join().unwrap().len(),
            1,
            "{status}: one attempt only"
        );
        assert!(
            stderr.contains(&format!("refused the registration with {status}")),
            "{stderr}"
        );
        assert!(stderr.contains(hint), "{status}: {stderr}");
    }
}

#[test]
fn a_missing_setting_is_named() {
    let (url, _server) = endpoint(Vec::new());
    let mut env = pod_env(&url);
    env.retain(|(key, _)| *key != "TONGS_REGISTRATION_TOKEN");
    let (code, stderr) = run(&borrowed(&env));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("TONGS_REGISTRATION_TOKEN is not set"),
        "{stderr}"
    );
}

/// With a command (the model server), SIGTERM first tells tongs the node is going
/// (`POST /v1/nodes/drain`, its pod and DRAIN_WAIT as the seconds left, with the fleet's token), waits
/// DRAIN_WAIT, then passes SIGTERM on to the command, whose status the script exits with.
#[test]
fn sigterm_tells_tongs_the_node_is_going_then_stops_the_server() {
    let (url, server) = endpoint(vec![(200, "{}"), (200, "{}")]);
    let mut env = pod_env(&url);
    env.push(("DRAIN_WAIT", "1".to_owned()));
    let mut child = Command::new("sh")
        .arg(format!("{ROOT}/{SCRIPT}"))
        .args(["sleep", "60"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs([("SKIP_TAILSCALE", "1"), ("REGISTER_MAX_DELAY", "1")])
        .envs(borrowed(&env))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sh runs");
    // The server runs; then the pod is deleted.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the script waits on its command"
    );
    let signalled = Instant::now();
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill is missing (Debian's procps; scripts/test.sh installs it)");
    assert!(kill.success());
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(20),
            "the script did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let waited = signalled.elapsed();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    // The command ended by SIGTERM, passed on: 128 + 15.
    assert_eq!(status.code(), Some(143), "{stderr}");
    assert!(
        waited >= Duration::from_secs(1),
        "DRAIN_WAIT first: {waited:?}"
    );
    let received = server.join().unwrap();
    let drain = received
        .iter()
        .find(|r| r.line.starts_with("POST /v1/nodes/drain "))
        .unwrap_or_else(|| panic!("no drain notice: {received:?}\n{stderr}"));
    assert_eq!(
        drain.authorization.as_deref(),
        Some("Bearer fleet-token-0123")
    );
    assert_eq!(
        drain.body,
        json!({
            "namespace": "gpu",
            "pod": "llm-7d9f-abcde",
            "uid": "4b1e0f6e-2c1d-4c55-9d0e-3f7a1c9b8e21",
            "seconds": 1,
        })
    );
    assert!(
        received
            .iter()
            .any(|r| r.line.starts_with("POST /v1/nodes/register ")),
        "{received:?}"
    );
}
