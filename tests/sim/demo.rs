//! `tongs demo` end to end: the binary runs a simulated fleet with interruptions behind a real proxy
//! under open-loop load, and its JSON summary is sane and self-consistent.

use std::process::Command;

const TONGS: &str = env!("CARGO_BIN_EXE_tongs");

#[test]
fn demo_json_summary_is_consistent() {
    let output = Command::new(TONGS)
        .args([
            "demo",
            "--duration",
            "10s",
            "--rps",
            "30",
            "--seed",
            "7",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "demo failed: {output:?}");
    // The live table goes to stderr with --json, its legend under the first one.
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr
            .matches("tongs sees   the node's state in tongs")
            .count(),
        1,
        "{stderr}"
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one JSON line on stdout: {stdout}");
    let summary: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    let count = |key: &str| {
        summary[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {summary}"))
    };

    // Open loop: the rate is kept whatever the fleet does (30 req/s for 10 s).
    let requests = count("requests");
    assert!((280..=301).contains(&requests), "requests {requests}");
    let failed: u64 = summary["failed"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(
        count("succeeded") + failed + count("rejected"),
        requests,
        "{summary}"
    );
    assert!(
        count("succeeded") > requests / 2,
        "most requests succeed: {summary}"
    );
    assert!(
        count("interruptions_injected") >= 4,
        "every kind injected once: {summary}"
    );

    // 30 req/s is well within what the interruptions leave: the summary says so.
    let capacity = &summary["capacity"];
    assert_eq!(capacity["seconds"].as_f64(), Some(0.0), "{summary}");
    let lowest = capacity["lowest_rps"].as_f64().unwrap();
    assert!(
        lowest >= 30.0 && lowest < capacity["capacity_rps"].as_f64().unwrap(),
        "{summary}"
    );

    let latency = &summary["latency_ms"];
    let ms = |key: &str| latency[key].as_f64().unwrap();
    assert!(ms("p50") > 0.0);
    assert!(
        ms("p50") <= ms("p90") && ms("p90") <= ms("p99") && ms("p99") <= ms("max"),
        "{latency}"
    );
    assert_eq!(summary["nodes"], 6);
    assert_eq!(summary["seed"], 7);

    // The live view went to stderr, as plain blocks since stderr is not a terminal here.
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("a100-0"), "{stderr}");
    assert!(
        !stderr.contains('\x1b'),
        "no terminal escapes when not on a terminal"
    );
}

#[test]
fn demo_refuses_bad_options() {
    for args in [["--rps", "0"], ["--duration", "soon"], ["--nodes", "0"]] {
        let output = Command::new(TONGS).arg("demo").args(args).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}: {output:?}");
        assert!(!output.stderr.is_empty());
    }
}

#[test]
fn shipped_fleet_file_is_valid() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/fleet.yaml");
    let fleet = tongs::sim::FleetConfig::load(std::path::Path::new(path))
        .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(fleet.nodes.len(), 4);
}

#[test]
fn sim_serves_a_fleet_file_until_stopped() {
    use std::io::{BufRead, BufReader, Read};
    let path = std::env::temp_dir().join(format!("tongs-sim-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        "seed: 3\nnodes:\n  - name: one\n    service_time: { mean: 10ms }\n  - name: two\n",
    )
    .unwrap();
    let mut child = Command::new(TONGS)
        .args(["sim", "--config"])
        .arg(&path)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut urls = Vec::new();
    let mut line = String::new();
    while urls.len() < 2 {
        line.clear();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "sim ended early");
        if let Some(url) = line.trim().strip_prefix("- url: ") {
            urls.push(url.split_whitespace().next().unwrap().to_owned());
        }
    }
    for url in &urls {
        let addr = url.trim_start_matches("http://");
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        std::io::Write::write_all(
            &mut stream,
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(child.wait().unwrap().code(), Some(0));
}
