//! The alert rules of deploy/components/alerts: the rendered PrometheusRule's groups pass `promtool
//! check rules`, the unit tests of tongs-alerts.test.yaml pass `promtool test rules`, every alert is
//! seen firing there, and every selector of the rules, of the tests' series and of the Grafana
//! dashboard's queries uses a metric, labels and label values that a real tongs /metrics page has.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::problems::{Problems, known_keys};
use crate::render::rendered;
use crate::support::TempDir;
use crate::{PROMETHEUS_RULE_GROUP, PROMETHEUS_RULE_RULE, ROOT, read};

/// The unit tests of the rules, for `promtool test rules`.
pub(crate) const ALERT_TESTS: &str = "deploy/components/alerts/tongs-alerts.test.yaml";
/// Labels the scrape adds to every series (Prometheus Operator's ServiceMonitor), which the rules may
/// group and match by.
const TARGET_LABELS: [&str; 2] = ["namespace", "pod"];
/// Labels whose values depend on the fleet or the configuration (pool names) rather than on tongs'
/// code: not checked against the page.
const FLEET_VALUES: [&str; 5] = ["endpoint", "source", "pool", "from", "to"];
/// An alert's `severity` label, as Alertmanager routes are usually written.
const SEVERITIES: [&str; 2] = ["critical", "warning"];

/// One series selector of a PromQL expression: a metric name and its label matchers.
#[derive(Debug, PartialEq)]
pub(crate) struct Selector {
    pub(crate) name: String,
    /// (label, operator, value), the operator one of `=`, `!=`, `=~`, `!~`.
    pub(crate) matchers: Vec<(String, String, String)>,
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Every selector of a `tongs_*` metric (or of a rule recorded from them, `level:tongs_...:ops`) in
/// `expr`.
pub(crate) fn selectors(expr: &str) -> Result<Vec<Selector>, String> {
    let mut found = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("tongs_") {
        // The whole word around "tongs_": a recorded name starts before it.
        let begin = rest[..start]
            .char_indices()
            .rev()
            .take_while(|(_, c)| is_word(*c))
            .last()
            .map_or(start, |(i, _)| i);
        let tail = &rest[begin..];
        let end = tail.find(|c: char| !is_word(c)).unwrap_or(tail.len());
        let name = tail[..end].to_owned();
        let mut after = &tail[end..];
        // A word that merely contains "tongs_" (xtongs_a) names something else.
        if begin != start && !rest[..start].ends_with(':') {
            rest = after;
            continue;
        }
        let mut matchers = Vec::new();
        if let Some(inside) = after.strip_prefix('{') {
            let close = inside
                .find('}')
                .ok_or_else(|| format!("unclosed {{ after {name}"))?;
            matchers = parse_matchers(&inside[..close])?;
            after = &inside[close + 1..];
        }
        found.push(Selector { name, matchers });
        rest = after;
    }
    Ok(found)
}

/// `label op "value", ...` (quotes may be escaped inside a value).
fn parse_matchers(text: &str) -> Result<Vec<(String, String, String)>, String> {
    let mut matchers = Vec::new();
    let mut rest = text.trim_start_matches([' ', ',']);
    while !rest.is_empty() {
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .ok_or_else(|| format!("a matcher without a value: {rest:?}"))?;
        let label = rest[..end].to_owned();
        rest = rest[end..].trim_start();
        let op = ["=~", "!~", "!=", "="]
            .into_iter()
            .find(|op| rest.starts_with(op))
            .ok_or_else(|| format!("no operator after {label}: {rest:?}"))?;
        rest = rest[op.len()..].trim_start();
        let quoted = rest
            .strip_prefix('"')
            .ok_or_else(|| format!("{label}{op} needs a quoted value"))?;
        let mut value = String::new();
        let mut chars = quoted.char_indices();
        let close = loop {
            match chars.next() {
                Some((_, '\\')) => value.extend(chars.next().map(|(_, c)| c)),
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => return Err(format!("unclosed value of {label}")),
            }
        };
        matchers.push((label, op.to_owned(), value));
        rest = quoted[close + 1..].trim_start_matches([' ', ',']);
    }
    Ok(matchers)
}

/// The labels named in `by (...)`, `without (...)`, `on (...)`, `ignoring (...)`, `group_left (...)`
/// and `group_right (...)` clauses.
pub(crate) fn grouping_labels(expr: &str) -> Vec<String> {
    let mut labels = Vec::new();
    let words: Vec<(usize, &str)> = expr
        .match_indices(|c: char| !is_word(c))
        .scan(0, |start, (i, sep)| {
            let word = (*start, &expr[*start..i]);
            *start = i + sep.len();
            Some(word)
        })
        .collect();
    for (start, word) in words {
        let keyword = matches!(
            word,
            "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
        );
        if !keyword {
            continue;
        }
        let after = expr[start + word.len()..].trim_start();
        let Some(inside) = after.strip_prefix('(') else {
            continue;
        };
        let inside = &inside[..inside.find(')').unwrap_or(inside.len())];
        labels.extend(
            inside
                .split(',')
                .map(str::trim)
                .filter(|label| !label.is_empty())
                .map(str::to_owned),
        );
    }
    labels
}

/// The series of a Prometheus text exposition page: name and labels of every sample.
pub(crate) fn page_series(text: &str) -> Vec<(String, BTreeMap<String, String>)> {
    text.lines()
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| {
            let (series, _value) = line.rsplit_once(' ')?;
            let selector = selectors(series).ok()?.into_iter().next()?;
            let labels = selector
                .matchers
                .into_iter()
                .map(|(label, _, value)| (label, value))
                .collect();
            Some((selector.name, labels))
        })
        .collect()
}

/// What a /metrics page shows of each metric: its label names and the values of each.
#[derive(Default)]
pub(crate) struct Exported(BTreeMap<String, BTreeMap<String, BTreeSet<String>>>);

impl Exported {
    pub(crate) fn of(text: &str) -> Exported {
        let mut exported = Exported::default();
        for (name, labels) in page_series(text) {
            let metric = exported.0.entry(name).or_default();
            for (label, value) in labels {
                metric.entry(label).or_default().insert(value);
            }
        }
        exported
    }

    /// Problems of one selector (`recorded`: the names of recording rules, which may be selected too).
    fn check(&self, at: &str, selector: &Selector, recorded: &BTreeSet<String>) -> Vec<String> {
        let name = &selector.name;
        if recorded.contains(name) {
            return Vec::new();
        }
        let Some(labels) = self.0.get(name) else {
            return vec![format!("{at}: {name} is not on tongs' /metrics page")];
        };
        let mut problems = Vec::new();
        for (label, op, value) in &selector.matchers {
            if TARGET_LABELS.contains(&label.as_str()) {
                continue;
            }
            let Some(values) = labels.get(label) else {
                let known: Vec<&String> = labels.keys().collect();
                problems.push(format!(
                    "{at}: {name} has no label {label} (it has {known:?}, and the scrape adds \
                     {TARGET_LABELS:?})"
                ));
                continue;
            };
            if FLEET_VALUES.contains(&label.as_str()) {
                continue;
            }
            let alternatives: Vec<&str> = if op.contains('~') {
                let plain = value
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '|'));
                if !plain {
                    problems.push(format!(
                        "{at}: {name}{{{label}{op}\"{value}\"}}: write regular expressions as \
                         alternatives of plain values (a|b), which this test can check"
                    ));
                    continue;
                }
                value.split('|').collect()
            } else {
                vec![value.as_str()]
            };
            for alternative in alternatives {
                if !values.contains(alternative) {
                    problems.push(format!(
                        "{at}: {name} never has {label}=\"{alternative}\" (tongs exports {values:?})"
                    ));
                }
            }
        }
        problems
    }
}

/// A PrometheusRule of a rendering, checked on its own (promtool runs on the rendered rules in the
/// tests below).
pub(crate) fn check_prometheus_rule(at: &str, rule: &Value, problems: &mut Problems) {
    let spec = crate::custom_resources::custom_resource_spec(
        at,
        rule,
        "monitoring.coreos.com/v1",
        "groups",
        problems,
    );
    let groups = spec["groups"].as_array().map_or(&[][..], Vec::as_slice);
    ensure!(problems, at, !groups.is_empty(), "has no rule groups");
    let recorded: BTreeSet<String> = groups
        .iter()
        .flat_map(|group| group["rules"].as_array().into_iter().flatten())
        .filter_map(|rule| rule["record"].as_str().map(str::to_owned))
        .collect();
    for group in groups {
        known_keys(at, "a rule group", group, PROMETHEUS_RULE_GROUP, problems);
        let rules = group["rules"].as_array().map_or(&[][..], Vec::as_slice);
        ensure!(
            problems,
            at,
            !rules.is_empty(),
            "group {} has no rules",
            group["name"]
        );
        for rule in rules {
            known_keys(at, "a rule", rule, PROMETHEUS_RULE_RULE, problems);
            let name = rule["alert"].as_str().or(rule["record"].as_str());
            let Some(name) = name.filter(|_| rule["alert"].is_null() != rule["record"].is_null())
            else {
                problems.fail(at, format!("a rule needs either alert or record: {rule}"));
                continue;
            };
            let at = &format!("{at} ({name})");
            let expr = rule["expr"].as_str().unwrap_or("");
            match selectors(expr) {
                Ok(found) => {
                    for selector in found {
                        let known = recorded.contains(&selector.name)
                            || crate::dashboard::exported(&selector.name);
                        ensure!(
                            problems,
                            at,
                            known,
                            "{} is neither a metric src/metrics/catalog.rs defines nor a recorded rule",
                            selector.name
                        );
                    }
                }
                Err(message) => problems.fail(at, message),
            }
            if rule["alert"].is_null() {
                continue;
            }
            let severity = rule["labels"]["severity"].as_str().unwrap_or("");
            ensure!(
                problems,
                at,
                SEVERITIES.contains(&severity),
                "labels.severity {severity:?}: one of {SEVERITIES:?}"
            );
            for annotation in ["summary", "description"] {
                ensure!(
                    problems,
                    at,
                    rule["annotations"][annotation].is_string(),
                    "needs annotation {annotation}"
                );
            }
        }
    }
}

/// The rule groups of every PrometheusRule the renderings hold, once each.
pub(crate) fn rendered_rule_groups() -> Vec<(String, Value)> {
    let mut seen = BTreeSet::new();
    let mut found = Vec::new();
    for (source, documents) in rendered() {
        for document in documents
            .iter()
            .filter(|doc| doc["kind"] == "PrometheusRule")
        {
            let groups = document["spec"]["groups"].clone();
            if seen.insert(groups.to_string()) {
                found.push((source.clone(), groups));
            }
        }
    }
    assert!(
        !found.is_empty(),
        "no kustomization under deploy/ renders the PrometheusRule of components/alerts"
    );
    found
}

/// The unit tests file, as YAML.
pub(crate) fn alert_tests() -> Value {
    serde_saphyr::from_str(&read(ALERT_TESTS))
        .unwrap_or_else(|err| panic!("{ALERT_TESTS} is not YAML: {err}"))
}

/// Runs promtool in `dir`; fails naming promtool when it is not installed.
pub(crate) fn promtool(dir: &Path, args: &[&str]) -> String {
    let output = match Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
    {
        Ok(output) => output,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => panic!(
            "promtool is missing: install Debian's prometheus package, which has it (scripts/test.sh \
             does)"
        ),
        Err(err) => panic!("cannot run promtool: {err}"),
    };
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "`promtool {}` failed ({}):\n{stdout}{}",
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// `promtool check rules` on the rendered groups, then `promtool test rules` on the unit tests, which
/// read the groups from the file their `rule_files` names.
#[test]
fn alert_rules_pass_promtool_check_and_unit_tests() {
    let tests = alert_tests();
    let files = tests["rule_files"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    let [Value::String(rules_file)] = files else {
        panic!("{ALERT_TESTS}: rule_files must name one file, got {files:?}");
    };
    let test_file = Path::new(ALERT_TESTS)
        .file_name()
        .expect("a file name")
        .to_str()
        .expect("UTF-8");
    for (source, groups) in rendered_rule_groups() {
        let dir = TempDir::new("tongs-alerts");
        // JSON is YAML: the groups as kustomize rendered them, in Prometheus' rule file format.
        let rules = serde_json::json!({ "groups": groups });
        std::fs::write(dir.0.join(rules_file), rules.to_string()).expect("rules written");
        std::fs::copy(Path::new(ROOT).join(ALERT_TESTS), dir.0.join(test_file))
            .expect("tests copied");
        let checked = promtool(&dir.0, &["check", "rules", rules_file]);
        assert!(checked.contains("SUCCESS"), "{source}: {checked}");
        let tested = promtool(&dir.0, &["test", "rules", test_file]);
        assert!(tested.contains("SUCCESS"), "{source}: {tested}");
    }
}

/// promtool passes a test of an alert that does not exist (nothing fires, as expected) and says
/// nothing of an alert no test covers: every alert must be seen firing, and every alert tested exist.
#[test]
fn every_alert_is_seen_firing_in_the_unit_tests() {
    let tests = alert_tests();
    let cases = tests["tests"].as_array().map_or(&[][..], Vec::as_slice);
    let alert_cases = cases
        .iter()
        .flat_map(|case| case["alert_rule_test"].as_array().into_iter().flatten());
    let mut tested = BTreeSet::new();
    let mut fired = BTreeSet::new();
    for alert in alert_cases {
        let name = alert["alertname"].as_str().unwrap_or("").to_owned();
        let expects_some = alert["exp_alerts"]
            .as_array()
            .is_some_and(|list| !list.is_empty());
        if expects_some {
            fired.insert(name.clone());
        }
        tested.insert(name);
    }
    for (source, groups) in rendered_rule_groups() {
        let alerts: BTreeSet<String> = groups
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|group| group["rules"].as_array().into_iter().flatten())
            .filter_map(|rule| rule["alert"].as_str().map(str::to_owned))
            .collect();
        let never_fired: Vec<&String> = alerts.difference(&fired).collect();
        assert!(
            never_fired.is_empty(),
            "{source}: {ALERT_TESTS} never sees these alerts fire: {never_fired:?}"
        );
        let unknown: Vec<&String> = tested.difference(&alerts).collect();
        assert!(
            unknown.is_empty(),
            "{ALERT_TESTS} tests alerts {source} does not define: {unknown:?}"
        );
    }
}

/// A real /metrics page, from a running proxy with pools (one falling back to another) beside the
/// pool `default`, one endpoint each and a static limit, so every series is on it with the labels
/// pools give it.
async fn pooled_metrics_page() -> Exported {
    let pools = r#"
concurrency: { limit: static, max_outstanding_per_endpoint: 4 }
pools:
  - name: llm
    match: { models: [llm] }
    fallback: [llm-in-cluster]
    discovery: { static: [{ url: "LLM_URL" }] }
  - name: llm-in-cluster
    match: { models: [llm-in-cluster] }
    discovery: { static: [{ url: "IN_CLUSTER_URL" }] }
"#
    .replace("LLM_URL", &crate::support::closed_url())
    .replace("IN_CLUSTER_URL", &crate::support::closed_url());
    let config = crate::support::config_with(&pools, &[crate::support::closed_url()]);
    let proxy = crate::support::start_proxy(config).await;
    let (status, text) = crate::support::get(&format!("http://{}/metrics", proxy.admin)).await;
    proxy.stop().await;
    assert_eq!(status, 200, "{text}");
    Exported::of(&text)
}

/// Per-endpoint gauges a fresh proxy has no sample of yet (no request answered, heartbeats off), and
/// the per-endpoint series they share their labels with (src/metrics/render.rs writes them in one
/// loop), whose labels they are checked against instead.
const NOT_YET_ON_THE_PAGE: [&str; 2] = [
    "tongs_endpoint_latency_seconds",
    "tongs_endpoint_heartbeat_seconds",
];
const SAME_LABELS_AS: &str = "tongs_endpoint_outstanding";

/// Problems of the selectors and groupings of one PromQL expression against the page.
fn check_expr(
    exported: &Exported,
    at: &str,
    expr: &str,
    recorded: &BTreeSet<String>,
    problems: &mut Vec<String>,
) {
    match selectors(expr) {
        Ok(found) => {
            for mut selector in found {
                if NOT_YET_ON_THE_PAGE.contains(&selector.name.as_str())
                    && !exported.0.contains_key(&selector.name)
                {
                    selector.name = SAME_LABELS_AS.to_owned();
                }
                problems.extend(exported.check(at, &selector, recorded));
            }
        }
        Err(message) => problems.push(format!("{at}: {message}")),
    }
    let label_names: BTreeSet<&str> = exported
        .0
        .values()
        .flat_map(|labels| labels.keys().map(String::as_str))
        .chain(TARGET_LABELS)
        .collect();
    for label in grouping_labels(expr) {
        if !label_names.contains(label.as_str()) {
            problems.push(format!("{at}: groups by {label}, which no series has"));
        }
    }
}

/// The rules select only what tongs exports (names, labels, label values: a misspelt state or outcome
/// would select nothing, and the alert would never fire), and the unit tests feed the rules series
/// shaped as the real ones, with the labels the scrape adds.
#[tokio::test]
async fn alerts_and_their_tests_use_the_series_tongs_exports() {
    let exported = pooled_metrics_page().await;
    let mut problems = Vec::new();

    for (source, groups) in rendered_rule_groups() {
        let rules: Vec<&Value> = groups
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|group| group["rules"].as_array().into_iter().flatten())
            .collect();
        let recorded: BTreeSet<String> = rules
            .iter()
            .filter_map(|rule| rule["record"].as_str().map(str::to_owned))
            .collect();
        for rule in rules {
            let name = rule["alert"].as_str().or(rule["record"].as_str());
            let at = format!("{source} ({})", name.unwrap_or("?"));
            let expr = rule["expr"].as_str().unwrap_or("");
            check_expr(&exported, &at, expr, &recorded, &mut problems);
        }
    }

    let tests = alert_tests();
    let cases = tests["tests"].as_array().map_or(&[][..], Vec::as_slice);
    for case in cases {
        let at = format!("{ALERT_TESTS} ({})", case["name"].as_str().unwrap_or("?"));
        let series = case["input_series"].as_array().into_iter().flatten();
        for text in series.filter_map(|series| series["series"].as_str()) {
            let parsed = selectors(text).map_err(|message| format!("{at}: {message}"));
            let Some(selector) = parsed.map(|mut all| all.pop()).transpose() else {
                problems.push(format!("{at}: {text:?} names no tongs_ metric"));
                continue;
            };
            match selector {
                Ok(selector) => {
                    for label in TARGET_LABELS {
                        let has = selector.matchers.iter().any(|(name, _, _)| name == label);
                        if !has {
                            problems.push(format!("{at}: {text} lacks the scrape's {label} label"));
                        }
                    }
                    problems.extend(exported.check(&at, &selector, &BTreeSet::new()));
                }
                Err(message) => problems.push(message),
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} problem(s):\n  - {}",
        problems.len(),
        problems.join("\n  - ")
    );
}

/// The Grafana dashboard's queries filter and group by labels tongs exports (a `pool` filter on a
/// metric without that label would empty the panel whenever a pool is picked), with label values it
/// exports.
#[tokio::test]
async fn dashboard_queries_use_the_series_tongs_exports() {
    let exported = pooled_metrics_page().await;
    let file = "deploy/grafana/tongs-dashboard.json";
    let dashboard: Value = serde_json::from_str(&read(file)).expect("the dashboard is JSON");
    let mut problems = Vec::new();
    let panels = dashboard["panels"].as_array().into_iter().flatten();
    for panel in panels {
        let at = format!("{file} ({})", panel["title"].as_str().unwrap_or("?"));
        let targets = panel["targets"].as_array().into_iter().flatten();
        for expr in targets.filter_map(|target| target["expr"].as_str()) {
            check_expr(&exported, &at, expr, &BTreeSet::new(), &mut problems);
        }
    }
    let variables = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten();
    for variable in variables {
        let at = format!(
            "{file} (variable {})",
            variable["name"].as_str().unwrap_or("?")
        );
        let Some(query) = variable["definition"].as_str() else {
            continue;
        };
        check_expr(&exported, &at, query, &BTreeSet::new(), &mut problems);
        // label_values(SERIES, LABEL): the values of a label the series has.
        let inside = query
            .strip_prefix("label_values(")
            .and_then(|rest| rest.strip_suffix(')'));
        if let Some((series, label)) = inside.and_then(|inside| inside.rsplit_once(',')) {
            let label = label.trim();
            let metric = selectors(series)
                .ok()
                .and_then(|found| found.into_iter().next());
            let has = TARGET_LABELS.contains(&label)
                || metric
                    .and_then(|metric| exported.0.get(&metric.name))
                    .is_some_and(|labels| labels.contains_key(label));
            if !has {
                problems.push(format!("{at}: {series} has no label {label}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} problem(s):\n  - {}",
        problems.len(),
        problems.join("\n  - ")
    );
}

#[test]
fn selectors_and_groupings_are_read_from_promql() {
    let expr = r#"sum by (namespace, le) (rate(tongs_queue_wait_seconds_bucket{le="+Inf", a!~"x|y"}[5m]))
        / ignoring(pod) namespace:tongs_errors:ratio_rate5m > 0 or xtongs_no"#;
    let found = selectors(expr).unwrap();
    assert_eq!(
        found,
        vec![
            Selector {
                name: "tongs_queue_wait_seconds_bucket".into(),
                matchers: vec![
                    ("le".into(), "=".into(), "+Inf".into()),
                    ("a".into(), "!~".into(), "x|y".into()),
                ],
            },
            Selector {
                name: "namespace:tongs_errors:ratio_rate5m".into(),
                matchers: vec![],
            },
        ]
    );
    assert_eq!(grouping_labels(expr), vec!["namespace", "le", "pod"]);
    let escaped = selectors(r#"tongs_x{endpoint="a\"b"}"#).unwrap();
    assert_eq!(escaped[0].matchers[0].2, "a\"b");
    assert!(selectors("tongs_x{a=b}").is_err());

    let page =
        "# HELP tongs_x x\ntongs_x{state=\"healthy\",endpoint=\"http://a:1\"} 1\ntongs_y 2\n";
    let exported = Exported::of(page);
    let check = |expr: &str| {
        let selector = selectors(expr).unwrap().remove(0);
        exported.check("t", &selector, &BTreeSet::new())
    };
    assert_eq!(
        check(r#"tongs_x{state=~"healthy",pod="p"}"#),
        Vec::<String>::new()
    );
    assert_eq!(
        check(r#"tongs_x{endpoint="anything"}"#),
        Vec::<String>::new()
    );
    assert_eq!(check(r#"tongs_x{state="healty"}"#).len(), 1);
    assert_eq!(check(r#"tongs_x{state=~"healthy|up"}"#).len(), 1);
    assert_eq!(check(r#"tongs_x{state=~"heal.*"}"#).len(), 1);
    assert_eq!(check(r#"tongs_x{outcome="ok"}"#).len(), 1);
    assert_eq!(check("tongs_z").len(), 1);
}

#[test]
fn broken_alert_rules_are_reported() {
    use serde_json::json;

    use crate::objects::problems_after;

    const FULL: &str = "deploy/overlays/salad-gateway-full";
    let edit = |change: fn(&mut Value)| {
        problems_after(FULL, |documents| {
            let doc = documents
                .iter_mut()
                .find(|doc| doc["kind"] == "PrometheusRule")
                .expect("a PrometheusRule");
            change(&mut doc["spec"]["groups"]);
        })
    };
    let reported = |problems: &[String], wanted: &str| {
        assert!(
            problems.iter().any(|problem| problem.contains(wanted)),
            "expected a problem containing {wanted:?}, got {problems:#?}"
        );
    };
    let problems = edit(|groups| groups[1]["rules"][0]["expr"] = json!("tongs_no_such_total > 0"));
    reported(&problems, "tongs_no_such_total is neither a metric");
    let problems = edit(|groups| groups[1]["rules"][0]["labels"] = json!({}));
    reported(&problems, "labels.severity \"\"");
    let problems = edit(|groups| groups[1]["rules"][0]["annotations"] = json!({ "summary": "x" }));
    reported(&problems, "needs annotation description");
    let problems = edit(|groups| groups[1]["evaluation_interval"] = json!("1m"));
    reported(&problems, "unknown field `evaluation_interval`");
    let problems = edit(|groups| groups[1]["rules"][0]["record"] = json!("x:y"));
    reported(&problems, "needs either alert or record");
    // A recording rule's name is known only where it is recorded.
    let problems = edit(|groups| groups[0]["rules"] = json!([{ "record": "x", "expr": "1" }]));
    reported(
        &problems,
        "namespace_pool:tongs_request_errors:ratio_rate1h is neither",
    );
}
