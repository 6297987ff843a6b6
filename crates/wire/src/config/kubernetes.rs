//! `discovery.kubernetes`: endpoints from the pods a Virtual Kubelet runs remotely.
//!
//! Which pods (namespace, selectors, readiness), how a pod becomes an endpoint (the rules, in order, and
//! the annotation keys they read), which addresses taken from annotations tongs may send traffic to (the
//! allowlist), and node self-registration.

use std::net::IpAddr;
use std::path::PathBuf;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::Problem;
use super::address::{canonical_range, range_admits};

/// Pod discovery through the Kubernetes API.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesConfig {
    /// Watch pods and serve the ones that qualify.
    pub enabled: bool,
    /// A kubeconfig file; unset means the pod's service account (in cluster) or `$KUBECONFIG`.
    pub kubeconfig: Option<PathBuf>,
    /// Namespace to watch: empty means tongs' own (the service account's), `*` means all namespaces.
    pub namespace: String,
    /// Which pods are endpoints, e.g. `app.kubernetes.io/part-of=tongs-fleet`. Required when enabled.
    pub label_selector: String,
    /// An optional field selector, e.g. `spec.nodeName=saladcloud-node`.
    pub field_selector: String,
    /// Serve a pod only while its Ready condition is true (besides Running and not terminating).
    pub require_ready: bool,
    /// How a pod becomes an endpoint: the first rule that yields an address wins. With registration
    /// on, `tailscale` must come after every other rule listed (see [`RegistrationConfig`]).
    pub rules: Vec<Rule>,
    pub annotations: AnnotationKeys,
    /// The containerPort name the `pod-ip` rule uses when the port annotation is absent.
    pub port_name: String,
    /// Where an address taken from an annotation may point: `https://*.salad.cloud` style URL patterns
    /// (scheme, host with an optional leading `*.`, optional port) and CIDR ranges for IP addresses.
    /// A loopback, link-local or unspecified address, or one of Tailscale's own (100.100.100.100,
    /// fd7a:115c:a1e0::53, 100.115.92.0/23), is admitted only by a range inside its block (`127.0.0.0/8`,
    /// not `0.0.0.0/0`; `100.100.100.100/32`, not the default `100.64.0.0/10`); for a podIP of the
    /// first kind, that range is what lets `pod-ip` serve it.
    pub allow: Vec<String>,
    /// Write the URL found through the SaladCloud API into the pod's URL annotation, so every replica
    /// and `kubectl get pod` see it (needs `patch` on pods).
    pub write_back: bool,
    /// Whether a deleted pod's node runs until the pod's grace period ends (its `deletionTimestamp`).
    /// False (the default): its streams move at once, since SaladCloud's and interLink's virtual kubelets
    /// stop the remote container as soon as the pod is deleted, whatever its grace period. True: they
    /// move shortly before the grace period ends, for pods on kubelets that honour it.
    pub trust_grace_period: bool,
    pub registration: RegistrationConfig,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            kubeconfig: None,
            namespace: String::new(),
            label_selector: String::new(),
            field_selector: String::new(),
            require_ready: true,
            // Addresses the API server or the SaladCloud API vouch for, and the url annotation, come
            // before the Tailscale address a node registers itself.
            rules: vec![Rule::Url, Rule::SaladApi, Rule::PodIp, Rule::Tailscale],
            annotations: AnnotationKeys::default(),
            port_name: "http".into(),
            allow: vec![
                "https://*.salad.cloud".into(),
                "100.64.0.0/10".into(),
                "fd7a:115c:a1e0::/48".into(),
            ],
            write_back: false,
            trust_grace_period: false,
            registration: RegistrationConfig::default(),
        }
    }
}

/// One way a pod becomes an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rule {
    /// The URL annotation holds a full URL.
    Url,
    /// The Tailscale annotation holds `IP:port` (written by node self-registration).
    Tailscale,
    /// A SaladCloud pod: its container group's gateway host from the SaladCloud API.
    SaladApi,
    /// `status.podIP` and the port annotation or the named containerPort (interLink, ordinary pods).
    PodIp,
}

impl Rule {
    pub fn name(self) -> &'static str {
        match self {
            Rule::Url => "url",
            Rule::Tailscale => "tailscale",
            Rule::SaladApi => "salad-api",
            Rule::PodIp => "pod-ip",
        }
    }
}

/// The pod annotations tongs reads (and writes: `url` by write-back, `tailscale_address` by
/// registration).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AnnotationKeys {
    pub url: String,
    pub tailscale_address: String,
    pub port: String,
    pub weight: String,
    pub max_outstanding: String,
    /// The model server the pod runs (`vllm`, `sglang`, `tgi`), for the names of its metrics; read
    /// from the pod's annotations, then its labels. Unset: `signals.engine`.
    pub engine: String,
    /// When the pod's node goes (RFC 3339), written by `POST /v1/nodes/drain`: the pod stops serving
    /// and its streams move before then.
    pub drain: String,
}

impl Default for AnnotationKeys {
    fn default() -> Self {
        Self {
            url: "tongs.dev/url".into(),
            tailscale_address: "tongs.dev/tailscale-address".into(),
            port: "tongs.dev/port".into(),
            weight: "tongs.dev/weight".into(),
            max_outstanding: "tongs.dev/max-outstanding".into(),
            engine: "tongs.dev/engine".into(),
            drain: "tongs.dev/drain-at".into(),
        }
    }
}

/// `POST /v1/nodes/register` on the admin port: a node reports its Tailscale address.
///
/// A registration needs two things: the fleet's token (this file, `Authorization: Bearer`), which keeps
/// out whoever is not a node, and the pod's own `metadata.uid`, which ties the registration to the one
/// pod the caller runs as (`discovery::register` says why the UID, and who knows it). A
/// registration fills only the Tailscale address of a pod no other rule gives an address, and
/// `tailscale` must come last in `rules`, so a registered address never overrides one from the API
/// server, the SaladCloud API or the url annotation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistrationConfig {
    /// A file holding the fleet's token nodes present (`Authorization: Bearer`), besides their pod's
    /// UID in the body; unset turns registration off.
    pub token_file: Option<PathBuf>,
}

impl RegistrationConfig {
    /// Whether nodes may register.
    pub fn enabled(&self) -> bool {
        self.token_file.is_some()
    }
}

/// One entry of the allowlist, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowRule {
    /// An IP range (canonical: IPv4-mapped ranges are IPv4): addresses in it are allowed, by any
    /// scheme and port, guarded ones only when the range lies inside their block.
    Range(IpNet),
    /// A URL pattern: this scheme, this host (or, with `*.`, any name under it), any or this port.
    Url {
        scheme: String,
        host: HostPattern,
        port: Option<u16>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostPattern {
    Exact(String),
    /// `*.salad.cloud` is stored as `.salad.cloud`: one or more labels in front of it.
    Suffix(String),
}

impl AllowRule {
    pub fn parse(text: &str) -> Result<AllowRule, String> {
        let text = text.trim();
        if let Ok(range) = text.parse::<IpNet>() {
            return Ok(AllowRule::Range(canonical_range(range.trunc())));
        }
        if let Ok(ip) = text.parse::<IpAddr>() {
            return Ok(AllowRule::Range(IpNet::from(ip.to_canonical())));
        }
        let (scheme, rest) = text.split_once("://").ok_or_else(|| {
            format!("{text:?} is neither a CIDR range (100.64.0.0/10) nor a URL pattern (https://*.salad.cloud)")
        })?;
        let scheme = scheme.to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err(format!(
                "{text:?}: only http and https patterns are allowed"
            ));
        }
        let rest = rest.trim_end_matches('/');
        if rest.contains('/') || rest.contains('@') || rest.contains('?') {
            return Err(format!(
                "{text:?}: a pattern names a scheme, host and optional port only"
            ));
        }
        let (host, port) = match rest.strip_prefix('[') {
            // [v6]:port
            Some(bracketed) => match bracketed.split_once(']') {
                Some((host, "")) => (host, None),
                Some((host, port)) => (host, Some(parse_port(text, port.trim_start_matches(':'))?)),
                None => return Err(format!("{text:?}: unclosed [")),
            },
            None => match rest.rsplit_once(':') {
                Some((host, port)) => (host, Some(parse_port(text, port)?)),
                None => (rest, None),
            },
        };
        let host = host.to_ascii_lowercase();
        let host = match host.strip_prefix("*.") {
            Some(suffix) if !suffix.is_empty() && !suffix.contains('*') => {
                HostPattern::Suffix(format!(".{suffix}"))
            }
            _ if host.is_empty() || host.contains('*') => {
                return Err(format!(
                    "{text:?}: the host must be a name, optionally with one leading `*.`"
                ));
            }
            _ => HostPattern::Exact(host),
        };
        Ok(AllowRule::Url { scheme, host, port })
    }

    /// Whether a URL with this scheme, host and port (the scheme's default when absent) is allowed.
    pub fn allows_url(&self, scheme: &str, host: &str, port: u16) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        match self {
            AllowRule::Range(range) => host
                .parse::<IpAddr>()
                .is_ok_and(|ip| range_admits(range, ip)),
            AllowRule::Url {
                scheme: allowed_scheme,
                host: pattern,
                port: allowed_port,
            } => {
                let host = host.to_ascii_lowercase();
                allowed_scheme.eq_ignore_ascii_case(scheme)
                    && allowed_port.is_none_or(|p| p == port)
                    && match pattern {
                        HostPattern::Exact(name) => host == *name,
                        HostPattern::Suffix(suffix) => {
                            host.len() > suffix.len() && host.ends_with(suffix.as_str())
                        }
                    }
            }
        }
    }

    /// Whether a bare address (a Tailscale `IP:port`, a podIP) is allowed: only ranges speak of bare
    /// addresses.
    pub fn allows_ip(&self, ip: IpAddr) -> bool {
        matches!(self, AllowRule::Range(range) if range_admits(range, ip))
    }
}

fn parse_port(pattern: &str, port: &str) -> Result<u16, String> {
    port.parse::<u16>()
        .map_err(|_| format!("{pattern:?}: {port:?} is not a port"))
}

impl KubernetesConfig {
    /// With registration on, the first rule listed after `tailscale` (which a registered address would
    /// then override); none when `tailscale` is last, absent, or registration is off.
    fn registration_outranked(&self) -> Option<&'static str> {
        if !self.registration.enabled() {
            return None;
        }
        let at = self
            .rules
            .iter()
            .position(|rule| *rule == Rule::Tailscale)?;
        self.rules[at + 1..]
            .iter()
            .find(|rule| **rule != Rule::Tailscale)
            .map(|rule| rule.name())
    }

    /// The allowlist, parsed; entries that do not parse are left out (validation reports them).
    pub fn allow_rules(&self) -> Vec<AllowRule> {
        self.allow
            .iter()
            .filter_map(|entry| AllowRule::parse(entry).ok())
            .collect()
    }

    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem = |field: &str, message: String| {
            problems.push(Problem {
                field: format!("discovery.kubernetes.{field}"),
                message,
            })
        };
        for (index, entry) in self.allow.iter().enumerate() {
            if let Err(message) = AllowRule::parse(entry) {
                problem(&format!("allow[{index}]"), message);
            }
        }
        let keys = [
            ("annotations.url", &self.annotations.url),
            (
                "annotations.tailscale_address",
                &self.annotations.tailscale_address,
            ),
            ("annotations.port", &self.annotations.port),
            ("annotations.weight", &self.annotations.weight),
            (
                "annotations.max_outstanding",
                &self.annotations.max_outstanding,
            ),
            ("annotations.engine", &self.annotations.engine),
            ("annotations.drain", &self.annotations.drain),
        ];
        for (field, key) in keys {
            if let Err(message) = annotation_key(key) {
                problem(field, message);
            }
        }
        // The token itself is read when tongs starts and on every reload (`Status::configure`), not
        // here: `check-config` runs where the Secret is not mounted.
        if self
            .registration
            .token_file
            .as_ref()
            .is_some_and(|path| path.as_os_str().is_empty())
        {
            problem(
                "registration.token_file",
                "is empty; leave it out to turn registration off".into(),
            );
        }
        if !self.enabled {
            return;
        }
        if self.label_selector.trim().is_empty() {
            problem(
                "label_selector",
                "required when discovery is enabled, so tongs serves only the inference pods \
                 (e.g. app.kubernetes.io/part-of=tongs-fleet)"
                    .into(),
            );
        } else if let Err(message) = super::parse_label_selector(&self.label_selector) {
            problem("label_selector", message);
        }
        if self.rules.is_empty() {
            problem(
                "rules",
                "needs at least one of url, tailscale, salad-api, pod-ip".into(),
            );
        }
        for (index, rule) in self.rules.iter().enumerate() {
            if self.rules[..index].contains(rule) {
                problem(
                    &format!("rules[{index}]"),
                    format!("{} is listed twice", rule.name()),
                );
            }
        }
        if let Some(trusted) = self.registration_outranked() {
            problem(
                "rules",
                format!(
                    "with registration on (registration.token_file), tailscale must come after {trusted}: \
                     an address a node registers must never override one from the API server, the \
                     SaladCloud API or the url annotation; list tailscale last, e.g. \
                     [url, salad-api, pod-ip, tailscale]"
                ),
            );
        }
        if let Some(path) = &self.kubeconfig
            && !path.is_file()
        {
            problem(
                "kubeconfig",
                format!("{} is not a readable file", path.display()),
            );
        }
        if self.port_name.is_empty() {
            problem(
                "port_name",
                "must name a containerPort (default http)".into(),
            );
        }
    }
}

/// A Kubernetes qualified name, the syntax of annotation and label keys: an optional DNS-subdomain
/// prefix and `/`, then a name of at most 63 characters of alphanumerics, `-`, `_` and `.`, starting
/// and ending alphanumeric.
pub fn is_qualified_name(key: &str) -> bool {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric();
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b))
    });
    name_ok && prefix_ok
}

/// An annotation key tongs may read or write.
pub fn annotation_key(key: &str) -> Result<(), String> {
    if is_qualified_name(key) {
        Ok(())
    } else {
        Err(format!(
            "{key:?} is not a valid annotation key (like tongs.dev/url)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(rules: &[&str], scheme: &str, host: &str, port: u16) -> bool {
        rules
            .iter()
            .map(|r| AllowRule::parse(r).unwrap())
            .any(|rule| rule.allows_url(scheme, host, port))
    }

    #[test]
    fn url_patterns_match_scheme_host_and_port() {
        let salad = ["https://*.salad.cloud"];
        assert!(allowed(&salad, "https", "tamarind-x.salad.cloud", 443));
        assert!(allowed(&salad, "https", "A.B.SALAD.CLOUD", 8443));
        assert!(!allowed(&salad, "http", "a.salad.cloud", 80));
        assert!(!allowed(&salad, "https", "salad.cloud", 443));
        assert!(!allowed(&salad, "https", "evilsalad.cloud", 443));
        assert!(!allowed(&salad, "https", "a.salad.cloud.evil.com", 443));
        let exact = ["http://gpu.internal:8000"];
        assert!(allowed(&exact, "http", "gpu.internal", 8000));
        assert!(!allowed(&exact, "http", "gpu.internal", 8001));
        assert!(!allowed(&exact, "http", "x.gpu.internal", 8000));
    }

    #[test]
    fn ranges_match_ip_hosts_and_bare_addresses() {
        let rules = ["100.64.0.0/10", "fd7a:115c:a1e0::/48"];
        assert!(allowed(&rules, "http", "100.101.2.3", 8000));
        assert!(allowed(&rules, "http", "[fd7a:115c:a1e0::1]", 8000));
        assert!(!allowed(&rules, "http", "100.128.0.1", 8000));
        assert!(!allowed(&rules, "http", "169.254.169.254", 80));
        assert!(!allowed(&rules, "https", "x.salad.cloud", 443));
        let range = AllowRule::parse("100.64.0.0/10").unwrap();
        assert!(range.allows_ip("100.64.0.1".parse().unwrap()));
        assert!(!range.allows_ip("10.0.0.1".parse().unwrap()));
        let url = AllowRule::parse("https://*.salad.cloud").unwrap();
        assert!(!url.allows_ip("100.64.0.1".parse().unwrap()));
    }

    /// `ip` as a URL's host.
    fn host(ip: &str) -> String {
        if ip.contains(':') {
            format!("[{ip}]")
        } else {
            ip.to_owned()
        }
    }

    #[test]
    fn local_addresses_need_a_range_inside_their_block() {
        let catch_all = ["0.0.0.0/0", "::/0"];
        for ip in [
            "127.0.0.1",
            "127.0.0.9",
            "::1",
            "::ffff:127.0.0.1",
            "169.254.169.254",
            "::ffff:169.254.169.254",
            "fe80::1",
            "0.0.0.0",
            "::",
        ] {
            assert!(!allowed(&catch_all, "http", &host(ip), 80), "{ip}");
            let rule = AllowRule::parse(catch_all[usize::from(ip.contains(':'))]).unwrap();
            assert!(!rule.allows_ip(ip.parse().unwrap()), "{ip}");
        }
        assert!(allowed(&catch_all, "http", "10.0.0.1", 80));
        assert!(allowed(&["127.0.0.0/8"], "http", "[::ffff:127.0.0.5]", 80));
        assert!(allowed(&["127.0.0.5"], "http", "127.0.0.5", 80));
        assert!(allowed(&["::ffff:127.0.0.0/104"], "http", "127.0.0.5", 80));
        assert!(allowed(
            &["169.254.169.254/32"],
            "http",
            "169.254.169.254",
            80
        ));
        assert!(!allowed(&["169.254.0.0/15"], "http", "169.254.169.254", 80));
        assert!(allowed(&["fe80::/64"], "http", "[fe80::1]", 80));
    }

    #[test]
    fn the_default_ranges_leave_out_tailscales_own_addresses() {
        let rules = KubernetesConfig::default().allow_rules();
        let by_ip = |ip: &str| {
            let ip: IpAddr = ip.parse().unwrap();
            rules.iter().any(|rule| rule.allows_ip(ip))
        };
        let by_url = |ip: &str| {
            rules
                .iter()
                .any(|rule| rule.allows_url("http", &host(ip), 80))
        };
        for ip in [
            "100.100.100.100",
            "::ffff:100.100.100.100",
            "fd7a:115c:a1e0::53",
            "100.115.92.0",
            "100.115.93.255",
        ] {
            assert!(!by_ip(ip), "{ip}");
            assert!(!by_url(ip), "{ip}");
        }
        for ip in [
            "100.64.0.1",
            "100.127.255.255",
            "100.100.100.99",
            "100.100.100.101",
            "100.115.91.255",
            "100.115.94.0",
            "fd7a:115c:a1e0::54",
            "::ffff:100.101.1.2",
        ] {
            assert!(by_ip(ip), "{ip}");
            assert!(by_url(ip), "{ip}");
        }
        // A rule that names them admits them.
        for (rule, ip) in [
            ("100.100.100.100/32", "100.100.100.100"),
            ("100.115.92.0/23", "100.115.93.1"),
            ("fd7a:115c:a1e0::53/128", "fd7a:115c:a1e0::53"),
        ] {
            let rule = AllowRule::parse(rule).unwrap();
            assert!(rule.allows_ip(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn bad_patterns_are_refused_with_a_reason() {
        for bad in [
            "*.salad.cloud",
            "ftp://x",
            "https://*",
            "https://a.*.b",
            "https://x/path",
            "10.0.0.0/33",
        ] {
            assert!(AllowRule::parse(bad).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn annotation_keys_are_checked() {
        assert!(annotation_key("tongs.dev/url").is_ok());
        assert!(annotation_key("weight").is_ok());
        assert!(annotation_key("Tongs.dev/url").is_err());
        assert!(annotation_key("tongs.dev/").is_err());
        assert!(annotation_key("tongs.dev/-x").is_err());
    }

    #[test]
    fn a_label_selector_that_does_not_parse_is_named() {
        let config = KubernetesConfig {
            enabled: true,
            label_selector: "app=llm,tier in (a".into(),
            ..KubernetesConfig::default()
        };
        let mut problems = Vec::new();
        config.validate(&mut problems);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].field, "discovery.kubernetes.label_selector");
        assert!(
            problems[0].message.contains("expected ',' or ')'"),
            "{problems:?}"
        );
    }

    #[test]
    fn enabled_discovery_needs_a_selector_and_sane_rules() {
        let config = KubernetesConfig {
            enabled: true,
            rules: vec![Rule::Url, Rule::Url],
            allow: vec!["nonsense".into()],
            ..KubernetesConfig::default()
        };
        let mut problems = Vec::new();
        config.validate(&mut problems);
        let fields: Vec<_> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "discovery.kubernetes.allow[0]",
                "discovery.kubernetes.label_selector",
                "discovery.kubernetes.rules[1]"
            ]
        );
    }

    #[test]
    fn with_registration_on_tailscale_comes_last() {
        let with = |rules: Vec<Rule>, token: bool| KubernetesConfig {
            enabled: true,
            label_selector: "app=llm".into(),
            rules,
            registration: RegistrationConfig {
                token_file: token.then(|| PathBuf::from("/etc/tongs-registration/token")),
            },
            ..KubernetesConfig::default()
        };
        let problems = |config: KubernetesConfig| {
            let mut problems = Vec::new();
            config.validate(&mut problems);
            problems
        };
        // The default order, and any order without registration, pass.
        assert!(problems(with(KubernetesConfig::default().rules, true)).is_empty());
        assert!(problems(with(vec![Rule::Tailscale], true)).is_empty());
        assert!(problems(with(vec![Rule::Url, Rule::PodIp], true)).is_empty());
        assert!(problems(with(vec![Rule::Tailscale, Rule::PodIp], false)).is_empty());
        for (rules, outranked) in [
            (
                vec![Rule::Url, Rule::Tailscale, Rule::SaladApi, Rule::PodIp],
                "salad-api",
            ),
            (vec![Rule::Tailscale, Rule::PodIp], "pod-ip"),
            (vec![Rule::Tailscale, Rule::Url], "url"),
        ] {
            let found = problems(with(rules, true));
            assert_eq!(found.len(), 1, "{found:?}");
            assert_eq!(found[0].field, "discovery.kubernetes.rules");
            assert!(
                found[0].message.contains(&format!("after {outranked}"))
                    && found[0].message.contains("registration.token_file")
                    && found[0]
                        .message
                        .contains("[url, salad-api, pod-ip, tailscale]"),
                "{}",
                found[0].message
            );
        }
    }
}
