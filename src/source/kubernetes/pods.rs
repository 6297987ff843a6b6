//! From a pod to an endpoint: which pods serve, and at which address (the rules, first match wins).
//!
//! Pure functions over [`PodFacts`], the few fields of a pod tongs needs (kept instead of the whole
//! object, so 5,000 pods cost little memory). An address taken from an annotation is used only if the
//! allowlist allows it: whoever can annotate a pod must not be able to make tongs send traffic anywhere
//! they like (and the SaladCloud key never follows an annotation: a SaladCloud pod's gateway URL is
//! looked up so the API can confirm it, see [`crate::upstream::GatewayKey`]). Addresses from the API
//! server (`status.podIP`) and from the SaladCloud API are trusted, and come before the Tailscale
//! address a node registers itself (`tailscale` last, see [`Rules::other_source`]).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use super::object::WatchedPod;
use crate::config::{AllowRule, EndpointUrl, AddressGuard, KubernetesConfig, Rule, guard, parse_address};
use crate::endpoint::Origin;
use crate::registry::EndpointSpec;

/// The SaladCloud Virtual Kubelet's node taint, which its pods tolerate.
pub const SALAD_TAINT_KEY: &str = "virtual-kubelet.io/provider";
pub const SALAD_PROVIDER: &str = "saladcloud";
/// An annotation only pods meant for the SaladCloud VK carry (it configures the Container Gateway).
pub const SALAD_PORT_ANNOTATION: &str = "salad.com/networking-port";

/// Why an annotation (or a pod) could not be used, as counted in `tongs_discovery_rejections_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    BadUrl,
    UrlNotAllowed,
    BadTailscaleAddress,
    TailscaleNotAllowed,
    BadPort,
    /// A loopback, link-local or unspecified podIP that no allow range names.
    LoopbackPodIp,
    BadWeight,
    BadMaxOutstanding,
    BadEngine,
}

impl Reason {
    pub const ALL: [Reason; 9] = [
        Reason::BadUrl,
        Reason::UrlNotAllowed,
        Reason::BadTailscaleAddress,
        Reason::TailscaleNotAllowed,
        Reason::BadPort,
        Reason::LoopbackPodIp,
        Reason::BadWeight,
        Reason::BadMaxOutstanding,
        Reason::BadEngine,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::BadUrl => "bad-url",
            Reason::UrlNotAllowed => "url-not-allowed",
            Reason::BadTailscaleAddress => "bad-tailscale-address",
            Reason::TailscaleNotAllowed => "tailscale-not-allowed",
            Reason::BadPort => "bad-port",
            Reason::LoopbackPodIp => "loopback-pod-ip",
            Reason::BadWeight => "bad-weight",
            Reason::BadMaxOutstanding => "bad-max-outstanding",
            Reason::BadEngine => "bad-engine",
        }
    }
}

/// One problem with one pod, in words for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: Reason,
    pub detail: String,
}

/// What tongs keeps of a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    /// `namespace/name`.
    pub key: Arc<str>,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub phase: String,
    pub ready: bool,
    pub terminating: bool,
    /// When the pod is deleted (its `deletionTimestamp`: the deletion's request time plus its grace
    /// period), Unix milliseconds.
    pub deleting_at_ms: Option<i64>,
    /// When its node said it goes (its drain annotation, `POST /v1/nodes/drain`), Unix milliseconds; a
    /// value that is not an RFC 3339 time counts as past.
    pub drain_at_ms: Option<i64>,
    pub pod_ip: Option<IpAddr>,
    /// The port of the containerPort named by `port_name`.
    pub named_port: Option<u16>,
    /// A pod of the SaladCloud Virtual Kubelet.
    pub salad: bool,
    /// The annotations the rules read (by config key), present ones only.
    pub annotations: BTreeMap<String, String>,
}

impl PodFacts {
    /// Extracts the facts from a pod, reading only the annotations named in `config`.
    pub fn from_pod(pod: &WatchedPod, config: &KubernetesConfig) -> PodFacts {
        let meta = &pod.metadata;
        let namespace = meta.namespace.clone().unwrap_or_default();
        let name = meta.name.clone().unwrap_or_default();
        let keys = &config.annotations;
        let wanted = [
            &keys.url,
            &keys.tailscale_address,
            &keys.port,
            &keys.weight,
            &keys.max_outstanding,
            &keys.engine,
            &keys.drain,
        ];
        let mut annotations = BTreeMap::new();
        let mut salad = false;
        if let Some(all) = &meta.annotations {
            for key in wanted {
                if let Some(value) = all.get(key.as_str()) {
                    annotations.insert(key.clone(), value.trim().to_owned());
                }
            }
            salad |= all.contains_key(SALAD_PORT_ANNOTATION);
        }
        // The engine may be a label as well (a Deployment's pods are labelled alike); the annotation wins.
        if let Some(label) = meta.labels.as_ref().and_then(|l| l.get(keys.engine.as_str())) {
            annotations
                .entry(keys.engine.clone())
                .or_insert_with(|| label.trim().to_owned());
        }
        let spec = pod.spec.as_ref();
        salad |= spec
            .and_then(|s| s.tolerations.as_ref())
            .is_some_and(|tolerations| {
                tolerations.iter().any(|t| {
                    t.key.as_deref() == Some(SALAD_TAINT_KEY)
                        && t.value.as_deref().is_none_or(|v| v == SALAD_PROVIDER)
                })
            });
        let named_port = spec.and_then(|s| {
            s.containers.iter().flatten().find_map(|c| {
                c.ports.as_ref()?.iter().find_map(|p| {
                    (p.name.as_deref() == Some(config.port_name.as_str()))
                        .then(|| u16::try_from(p.container_port).ok())
                        .flatten()
                })
            })
        });
        let status = pod.status.as_ref();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|conditions| {
                conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
        PodFacts {
            key: Arc::from(format!("{namespace}/{name}")),
            namespace,
            name,
            uid: meta.uid.clone().unwrap_or_default(),
            phase: status.and_then(|s| s.phase.clone()).unwrap_or_default(),
            ready,
            terminating: meta.deletion_timestamp.is_some(),
            deleting_at_ms: meta
                .deletion_timestamp
                .as_ref()
                .map(|at| at.0.as_millisecond()),
            drain_at_ms: annotations.get(&keys.drain).map(|at| {
                at.parse::<k8s_openapi::jiff::Timestamp>()
                    .map_or(i64::MIN, |at| at.as_millisecond())
            }),
            pod_ip: status
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse().ok()),
            named_port,
            salad,
            annotations,
        }
    }

    /// The SaladCloud container group the Virtual Kubelet made for this pod.
    pub fn container_group(&self) -> String {
        format!("{}-{}", self.namespace, self.name)
    }

    fn annotation(&self, key: &str) -> Option<&str> {
        self.annotations
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }
}

/// Where a pod stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodState {
    /// An endpoint.
    Serving,
    /// Not Running, not Ready, terminating, or its node said it is going: no endpoint (an existing one
    /// drains).
    Ineligible,
    /// Eligible, but no rule gave an address (yet: a SaladCloud lookup may be under way).
    NoAddress,
}

impl PodState {
    pub const ALL: [PodState; 3] = [PodState::Serving, PodState::Ineligible, PodState::NoAddress];

    pub fn as_str(self) -> &'static str {
        match self {
            PodState::Serving => "serving",
            PodState::Ineligible => "ineligible",
            PodState::NoAddress => "no-address",
        }
    }
}

/// What the rules made of a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Derived {
    pub state: PodState,
    pub spec: Option<EndpointSpec>,
    /// The rule that gave the address.
    pub rule: Option<Rule>,
    pub rejections: Vec<Rejection>,
    /// The salad-api rule needs the container group's gateway host, not known yet.
    pub wants_lookup: bool,
}

/// The rules with their allowlist parsed once.
pub struct Rules {
    config: KubernetesConfig,
    allow: Vec<AllowRule>,
    /// Whether the SaladCloud API is configured (the salad-api rule can run).
    salad_api: bool,
}

impl Rules {
    pub fn new(config: &KubernetesConfig, salad_api: bool) -> Rules {
        Rules {
            allow: config.allow_rules(),
            config: config.clone(),
            salad_api,
        }
    }

    pub fn config(&self) -> &KubernetesConfig {
        &self.config
    }

    /// Whether the allowlist lets traffic go to `url` (taken from an annotation).
    pub fn allows_url(&self, url: &EndpointUrl) -> bool {
        let port = url
            .authority
            .port_u16()
            .unwrap_or(if url.scheme == http::uri::Scheme::HTTPS {
                443
            } else {
                80
            });
        let host = url.authority.host();
        self.allow
            .iter()
            .any(|rule| rule.allows_url(url.scheme.as_str(), host, port))
    }

    /// Whether the allowlist lets traffic go to a bare address (a Tailscale `IP:port`).
    pub fn allows_address(&self, address: SocketAddr) -> bool {
        self.allows_ip(address.ip())
    }

    fn allows_ip(&self, ip: IpAddr) -> bool {
        self.allow.iter().any(|rule| rule.allows_ip(ip))
    }

    /// Applies the rules to `pod`; `gateway_host` is its container group's DNS name when known.
    pub fn derive(&self, pod: &PodFacts, gateway_host: Option<&str>) -> Derived {
        let mut rejections = Vec::new();
        let eligible = pod.phase == "Running"
            && !pod.terminating
            && pod.drain_at_ms.is_none()
            && (pod.ready || !self.config.require_ready);
        if !eligible {
            return Derived {
                state: PodState::Ineligible,
                spec: None,
                rule: None,
                rejections,
                wants_lookup: false,
            };
        }
        let keys = &self.config.annotations;
        let mut wants_lookup = false;
        let found = self.address(pod, gateway_host, &mut rejections, &mut wants_lookup, None);
        let weight = match pod.annotation(&keys.weight) {
            None => 1,
            Some(text) => match text.parse::<u32>() {
                Ok(weight) if (1..=10_000).contains(&weight) => weight,
                _ => {
                    rejections.push(Rejection {
                        reason: Reason::BadWeight,
                        detail: format!(
                            "{}: {text:?} is not a weight from 1 to 10000; using 1",
                            keys.weight
                        ),
                    });
                    1
                }
            },
        };
        let max_outstanding = match pod.annotation(&keys.max_outstanding) {
            None => None,
            Some(text) => match text.parse::<u64>() {
                Ok(limit) if limit >= 1 => Some(limit),
                _ => {
                    rejections.push(Rejection {
                        reason: Reason::BadMaxOutstanding,
                        detail: format!(
                            "{}: {text:?} is not a whole number of at least 1; ignored",
                            keys.max_outstanding
                        ),
                    });
                    None
                }
            },
        };
        let engine = match pod.annotation(&keys.engine) {
            None => None,
            Some(text) => match text.parse::<crate::engine::Engine>() {
                Ok(engine) => Some(engine),
                Err(error) => {
                    rejections.push(Rejection {
                        reason: Reason::BadEngine,
                        detail: format!("{}: {error}; signals.engine is used", keys.engine),
                    });
                    None
                }
            },
        };
        let Some((rule, (url, parsed))) = found else {
            return Derived {
                state: PodState::NoAddress,
                spec: None,
                rule: None,
                rejections,
                wants_lookup,
            };
        };
        Derived {
            state: PodState::Serving,
            spec: Some(EndpointSpec {
                url,
                parsed,
                weight,
                origin: Origin {
                    source: "kubernetes",
                    pod: Some(Arc::clone(&pod.key)),
                    max_outstanding,
                    engine,
                },
            }),
            rule: Some(rule),
            rejections,
            // A later rule serves the pod meanwhile; the lookup still runs, so salad-api (earlier in
            // the order) takes over once the gateway is known.
            wants_lookup,
        }
    }

    /// The first rule (but `skip`) that gives `pod` an address, and the address. Sets `wants_lookup`
    /// when the pod's container group should be looked up in the SaladCloud API: for the salad-api
    /// rule, whose address it is, and for a SaladCloud pod's `https://` url annotation, which gets the
    /// SaladCloud key only once the API confirms the host is the group's gateway
    /// ([`crate::upstream::GatewayKey`]).
    fn address(
        &self,
        pod: &PodFacts,
        gateway_host: Option<&str>,
        rejections: &mut Vec<Rejection>,
        wants_lookup: &mut bool,
        skip: Option<Rule>,
    ) -> Option<(Rule, (String, EndpointUrl))> {
        let lookups = pod.salad && self.salad_api;
        for &rule in &self.config.rules {
            if Some(rule) == skip {
                continue;
            }
            let url = match rule {
                Rule::Url => {
                    let url = self.url_rule(pod, rejections);
                    if lookups
                        && gateway_host.is_none()
                        && url
                            .as_ref()
                            .is_some_and(|(_, parsed)| parsed.scheme == http::uri::Scheme::HTTPS)
                    {
                        *wants_lookup = true;
                    }
                    url
                }
                Rule::Tailscale => self.tailscale_rule(pod, rejections),
                Rule::SaladApi if lookups => match gateway_host {
                    Some(host) => EndpointUrl::parse(&format!("https://{host}"))
                        .ok()
                        .map(|parsed| (format!("https://{host}"), parsed)),
                    None => {
                        *wants_lookup = true;
                        None
                    }
                },
                Rule::SaladApi => None,
                Rule::PodIp => self.pod_ip_rule(pod, rejections),
            };
            if let Some(url) = url {
                return Some((rule, url));
            }
        }
        None
    }

    /// The rule other than `tailscale` that gives `pod` an address now, whatever its phase: a node's
    /// registration must not fill the Tailscale address of such a pod (`discovery::register`).
    /// A salad-api lookup still under way gives none yet; once it does, salad-api (listed before
    /// `tailscale`, as validation requires) takes over from the registered address.
    pub fn other_source(&self, pod: &PodFacts, gateway_host: Option<&str>) -> Option<Rule> {
        let (mut ignored, mut lookup) = (Vec::new(), false);
        self.address(
            pod,
            gateway_host,
            &mut ignored,
            &mut lookup,
            Some(Rule::Tailscale),
        )
        .map(|(rule, _)| rule)
    }

    fn url_rule(
        &self,
        pod: &PodFacts,
        rejections: &mut Vec<Rejection>,
    ) -> Option<(String, EndpointUrl)> {
        let key = &self.config.annotations.url;
        let text = pod.annotation(key)?;
        let parsed = match EndpointUrl::parse(text) {
            Ok(parsed) => parsed,
            Err(message) => {
                rejections.push(Rejection {
                    reason: Reason::BadUrl,
                    detail: format!("{key}: {message}"),
                });
                return None;
            }
        };
        if !self.allows_url(&parsed) {
            rejections.push(Rejection {
                reason: Reason::UrlNotAllowed,
                detail: format!("{key}: {text:?} is not in discovery.kubernetes.allow; not used"),
            });
            return None;
        }
        Some((text.to_owned(), parsed))
    }

    fn tailscale_rule(
        &self,
        pod: &PodFacts,
        rejections: &mut Vec<Rejection>,
    ) -> Option<(String, EndpointUrl)> {
        let key = &self.config.annotations.tailscale_address;
        let text = pod.annotation(key)?;
        let address = match parse_address(text) {
            Ok(address) => address,
            Err(message) => {
                rejections.push(Rejection {
                    reason: Reason::BadTailscaleAddress,
                    detail: format!("{key}: {message}"),
                });
                return None;
            }
        };
        if !self.allows_address(address) {
            rejections.push(Rejection {
                reason: Reason::TailscaleNotAllowed,
                detail: format!("{key}: {address} is not in discovery.kubernetes.allow; not used"),
            });
            return None;
        }
        // `[::ffff:100.64.1.2]` is dialled as 100.64.1.2, which `upstream.tailscale.ranges` routes.
        let url = format!(
            "http://{}",
            SocketAddr::new(address.ip().to_canonical(), address.port())
        );
        EndpointUrl::parse(&url).ok().map(|parsed| (url, parsed))
    }

    fn pod_ip_rule(
        &self,
        pod: &PodFacts,
        rejections: &mut Vec<Rejection>,
    ) -> Option<(String, EndpointUrl)> {
        let ip = pod.pod_ip?.to_canonical();
        let key = &self.config.annotations.port;
        let port = match pod.annotation(key) {
            Some(text) => match text.parse::<u16>() {
                Ok(port) if port > 0 => port,
                _ => {
                    rejections.push(Rejection {
                        reason: Reason::BadPort,
                        detail: format!("{key}: {text:?} is not a port"),
                    });
                    return None;
                }
            },
            None => pod.named_port?,
        };
        if guard(ip) == Some(AddressGuard::Local) && !self.allows_ip(ip) {
            // interLink reports 127.0.0.1 when it has no tunnel to the pod: unreachable from here. Any
            // other local address is tongs' own machine or link (cloud metadata at 169.254.169.254).
            let kind = if ip.is_loopback() {
                "loopback"
            } else if ip.is_unspecified() {
                "unspecified"
            } else {
                "link-local"
            };
            rejections.push(Rejection {
                reason: Reason::LoopbackPodIp,
                detail: format!(
                    "status.podIP {ip} is {kind}, not a remote pod (interLink without wstunnel or pod \
                     VPN?); not used unless a discovery.kubernetes.allow range inside its block names it"
                ),
            });
            return None;
        }
        let url = format!("http://{}", SocketAddr::new(ip, port));
        EndpointUrl::parse(&url).ok().map(|parsed| (url, parsed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> PodFacts {
        PodFacts {
            key: Arc::from("gpu/llm-0"),
            namespace: "gpu".into(),
            name: "llm-0".into(),
            uid: "u1".into(),
            phase: "Running".into(),
            ready: true,
            terminating: false,
            deleting_at_ms: None,
            drain_at_ms: None,
            pod_ip: None,
            named_port: None,
            salad: false,
            annotations: BTreeMap::new(),
        }
    }

    fn with(mut pod: PodFacts, key: &str, value: &str) -> PodFacts {
        pod.annotations.insert(key.into(), value.into());
        pod
    }

    fn rules() -> Rules {
        Rules::new(&KubernetesConfig::default(), true)
    }

    fn url_of(derived: &Derived) -> Option<&str> {
        derived.spec.as_ref().map(|s| s.url.as_str())
    }

    #[test]
    fn the_first_rule_that_applies_wins() {
        let mut pod = with(facts(), "tongs.dev/url", "https://a-b.salad.cloud");
        pod = with(pod, "tongs.dev/tailscale-address", "100.64.1.2:8000");
        pod.pod_ip = Some("10.1.2.3".parse().unwrap());
        pod.named_port = Some(8080);
        let derived = rules().derive(&pod, None);
        assert_eq!(url_of(&derived), Some("https://a-b.salad.cloud"));
        assert_eq!(derived.rule, Some(Rule::Url));
        pod.annotations.remove("tongs.dev/url");
        // The podIP (from the API server) comes before the Tailscale address a node registers.
        assert_eq!(
            url_of(&rules().derive(&pod, None)),
            Some("http://10.1.2.3:8080")
        );
        pod.pod_ip = None;
        assert_eq!(
            url_of(&rules().derive(&pod, None)),
            Some("http://100.64.1.2:8000")
        );
        pod.annotations.clear();
        pod.pod_ip = Some("10.1.2.3".parse().unwrap());
        assert_eq!(
            url_of(&rules().derive(&pod, None)),
            Some("http://10.1.2.3:8080")
        );
        let reordered = Rules::new(
            &KubernetesConfig {
                rules: vec![Rule::PodIp, Rule::Url],
                ..KubernetesConfig::default()
            },
            true,
        );
        let pod = with(pod, "tongs.dev/url", "https://a-b.salad.cloud");
        assert_eq!(
            url_of(&reordered.derive(&pod, None)),
            Some("http://10.1.2.3:8080")
        );
    }

    #[test]
    fn salad_pods_ask_for_a_lookup_and_use_the_gateway_host() {
        let mut pod = facts();
        pod.salad = true;
        let derived = rules().derive(&pod, None);
        assert_eq!(derived.state, PodState::NoAddress);
        assert!(derived.wants_lookup);
        let derived = rules().derive(&pod, Some("tamarind-x.salad.cloud"));
        assert_eq!(url_of(&derived), Some("https://tamarind-x.salad.cloud"));
        assert_eq!(derived.rule, Some(Rule::SaladApi));
        // Without the SaladCloud API configured the rule does not apply.
        let derived = Rules::new(&KubernetesConfig::default(), false).derive(&pod, None);
        assert!(!derived.wants_lookup);
        // An ordinary pod never asks.
        assert!(!rules().derive(&facts(), None).wants_lookup);
    }

    #[test]
    fn a_salad_pod_served_by_a_later_rule_still_asks_for_its_gateway() {
        let mut pod = facts();
        pod.salad = true;
        pod.pod_ip = Some("10.1.2.3".parse().unwrap());
        pod.named_port = Some(8000);
        let derived = rules().derive(&pod, None);
        assert_eq!(url_of(&derived), Some("http://10.1.2.3:8000"));
        assert!(derived.wants_lookup);
        let derived = rules().derive(&pod, Some("plum-2.salad.cloud"));
        assert_eq!(url_of(&derived), Some("https://plum-2.salad.cloud"));
        assert!(!derived.wants_lookup);
        // An earlier rule that gives a plain-HTTP address makes the lookup moot.
        let plain = with(pod.clone(), "tongs.dev/url", "http://100.64.0.9:8000");
        assert!(!rules().derive(&plain, None).wants_lookup);
        // A gateway URL in the annotation serves at once, and is looked up all the same: only the
        // SaladCloud API can say the host is this group's gateway (and so may get the key).
        let annotated = with(pod, "tongs.dev/url", "https://x.salad.cloud");
        let derived = rules().derive(&annotated, None);
        assert_eq!(url_of(&derived), Some("https://x.salad.cloud"));
        assert!(derived.wants_lookup);
        let derived = rules().derive(&annotated, Some("other.salad.cloud"));
        assert_eq!(url_of(&derived), Some("https://x.salad.cloud"));
        assert!(!derived.wants_lookup);
        // Not a SaladCloud pod: no group to ask about.
        let mut ordinary = annotated;
        ordinary.salad = false;
        assert!(!rules().derive(&ordinary, None).wants_lookup);
    }

    #[test]
    fn other_sources_than_tailscale_are_named_for_registration() {
        let registered = with(facts(), "tongs.dev/tailscale-address", "100.64.1.2:8000");
        assert_eq!(rules().other_source(&registered, None), None);
        let mut pending = registered.clone();
        pending.phase = "Pending".into();
        assert_eq!(rules().other_source(&pending, None), None);
        // A podIP, whatever the phase.
        let mut with_ip = pending.clone();
        with_ip.pod_ip = Some("10.1.2.3".parse().unwrap());
        with_ip.named_port = Some(8000);
        assert_eq!(rules().other_source(&with_ip, None), Some(Rule::PodIp));
        // A loopback podIP gives no address, so it does not count.
        with_ip.pod_ip = Some("127.0.0.1".parse().unwrap());
        assert_eq!(rules().other_source(&with_ip, None), None);
        // A url annotation, when the allowlist admits it.
        let url = with(registered.clone(), "tongs.dev/url", "https://a.salad.cloud");
        assert_eq!(rules().other_source(&url, None), Some(Rule::Url));
        let refused = with(registered.clone(), "tongs.dev/url", "https://evil.example");
        assert_eq!(rules().other_source(&refused, None), None);
        // A SaladCloud gateway, once the API has named it.
        let mut salad = registered;
        salad.salad = true;
        assert_eq!(rules().other_source(&salad, None), None);
        assert_eq!(
            rules().other_source(&salad, Some("plum.salad.cloud")),
            Some(Rule::SaladApi)
        );
        // Only listed rules count.
        let only_tailscale = Rules::new(
            &KubernetesConfig {
                rules: vec![Rule::Tailscale],
                ..KubernetesConfig::default()
            },
            true,
        );
        assert_eq!(
            only_tailscale.other_source(&salad, Some("plum.salad.cloud")),
            None
        );
    }

    #[test]
    fn disallowed_annotations_are_rejected_and_the_next_rule_is_tried() {
        let mut pod = with(facts(), "tongs.dev/url", "https://attacker.example");
        pod = with(pod, "tongs.dev/tailscale-address", "169.254.169.254:80");
        pod.pod_ip = Some("10.1.2.3".parse().unwrap());
        pod = with(pod, "tongs.dev/port", "9000");
        let derived = rules().derive(&pod, None);
        assert_eq!(url_of(&derived), Some("http://10.1.2.3:9000"));
        let reasons: Vec<_> = derived.rejections.iter().map(|r| r.reason).collect();
        // pod-ip gave the address before tailscale was tried.
        assert_eq!(reasons, [Reason::UrlNotAllowed]);
        pod.pod_ip = None;
        let derived = rules().derive(&pod, None);
        assert_eq!(derived.state, PodState::NoAddress);
        let reasons: Vec<_> = derived.rejections.iter().map(|r| r.reason).collect();
        assert_eq!(
            reasons,
            [Reason::UrlNotAllowed, Reason::TailscaleNotAllowed]
        );
    }

    #[test]
    fn malformed_annotations_say_what_is_wrong() {
        for (key, value, reason) in [
            ("tongs.dev/url", "not a url", Reason::BadUrl),
            ("tongs.dev/url", "ftp://a.salad.cloud", Reason::BadUrl),
            (
                "tongs.dev/tailscale-address",
                "100.64.0.1",
                Reason::BadTailscaleAddress,
            ),
            ("tongs.dev/weight", "0", Reason::BadWeight),
            ("tongs.dev/weight", "heavy", Reason::BadWeight),
            ("tongs.dev/max-outstanding", "-1", Reason::BadMaxOutstanding),
            ("tongs.dev/url", "https://a..salad.cloud", Reason::BadUrl),
            (
                "tongs.dev/url",
                "https://a.salad.cloud:99999",
                Reason::BadUrl,
            ),
            ("tongs.dev/url", "http://100.64.0.1:0", Reason::BadUrl),
        ] {
            let derived = rules().derive(&with(facts(), key, value), None);
            assert_eq!(
                derived.rejections.first().map(|r| r.reason),
                Some(reason),
                "{key}={value}"
            );
            assert!(derived.rejections[0].detail.contains(key));
        }
        let mut pod = with(facts(), "tongs.dev/port", "http");
        pod.pod_ip = Some("10.0.0.1".parse().unwrap());
        assert_eq!(
            rules().derive(&pod, None).rejections[0].reason,
            Reason::BadPort
        );
    }

    #[test]
    fn weight_and_limit_annotations_reach_the_endpoint() {
        let mut pod = with(facts(), "tongs.dev/weight", "3");
        pod = with(pod, "tongs.dev/max-outstanding", "2");
        pod = with(pod, "tongs.dev/url", "https://x.salad.cloud");
        let spec = rules().derive(&pod, None).spec.unwrap();
        assert_eq!(spec.weight, 3);
        assert_eq!(spec.origin.max_outstanding, Some(2));
        assert_eq!(spec.origin.source, "kubernetes");
        assert_eq!(spec.origin.pod.as_deref(), Some("gpu/llm-0"));
    }

    #[test]
    fn only_running_ready_live_pods_serve() {
        let pod = with(facts(), "tongs.dev/url", "https://x.salad.cloud");
        assert_eq!(rules().derive(&pod, None).state, PodState::Serving);
        for change in [
            |p: &mut PodFacts| p.phase = "Pending".into(),
            |p: &mut PodFacts| p.ready = false,
            |p: &mut PodFacts| p.terminating = true,
            |p: &mut PodFacts| p.phase = "Succeeded".into(),
        ] {
            let mut changed = pod.clone();
            change(&mut changed);
            assert_eq!(rules().derive(&changed, None).state, PodState::Ineligible);
        }
        let lenient = Rules::new(
            &KubernetesConfig {
                require_ready: false,
                ..KubernetesConfig::default()
            },
            false,
        );
        let mut not_ready = pod.clone();
        not_ready.ready = false;
        assert_eq!(lenient.derive(&not_ready, None).state, PodState::Serving);
    }

    #[test]
    fn loopback_pod_ips_are_refused() {
        let mut pod = facts();
        pod.pod_ip = Some("127.0.0.1".parse().unwrap());
        pod.named_port = Some(8000);
        let derived = rules().derive(&pod, None);
        assert_eq!(derived.state, PodState::NoAddress);
        assert_eq!(derived.rejections[0].reason, Reason::LoopbackPodIp);
    }

    fn allowing(ranges: &[&str]) -> Rules {
        let config = KubernetesConfig {
            allow: ranges.iter().map(|r| r.to_string()).collect(),
            ..KubernetesConfig::default()
        };
        Rules::new(&config, false)
    }

    fn at_pod_ip(rules: &Rules, ip: &str) -> Derived {
        let mut pod = facts();
        pod.pod_ip = Some(ip.parse().unwrap());
        pod.named_port = Some(8000);
        rules.derive(&pod, None)
    }

    #[test]
    fn local_pod_ips_in_any_form_are_refused_unless_an_allow_range_names_them() {
        let local = [
            "127.0.0.1",
            "127.0.0.2",
            "127.255.255.254",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:127.0.0.2",
            "0.0.0.0",
            "::",
            "::ffff:0.0.0.0",
            "169.254.169.254",
            "::ffff:169.254.169.254",
            "fe80::1",
        ];
        // Neither the default allowlist nor a catch-all range names them.
        for rules in [rules(), allowing(&["0.0.0.0/0", "::/0"])] {
            for ip in local {
                let derived = at_pod_ip(&rules, ip);
                assert_eq!(derived.state, PodState::NoAddress, "{ip}");
                assert_eq!(derived.rejections[0].reason, Reason::LoopbackPodIp, "{ip}");
                assert!(
                    derived.rejections[0].detail.contains("status.podIP"),
                    "{}",
                    derived.rejections[0].detail
                );
            }
        }
        // A range inside the block names them; the endpoint dials the plain IPv4 form.
        let loopback = allowing(&["127.0.0.0/8"]);
        assert_eq!(
            url_of(&at_pod_ip(&loopback, "::ffff:127.0.0.2")),
            Some("http://127.0.0.2:8000")
        );
        assert_eq!(
            url_of(&at_pod_ip(&loopback, "127.0.0.1")),
            Some("http://127.0.0.1:8000")
        );
        for ip in ["::1", "169.254.169.254", "0.0.0.0"] {
            assert_eq!(at_pod_ip(&loopback, ip).state, PodState::NoAddress, "{ip}");
        }
        assert_eq!(
            url_of(&at_pod_ip(
                &allowing(&["169.254.169.254/32"]),
                "169.254.169.254"
            )),
            Some("http://169.254.169.254:8000")
        );
        assert_eq!(
            url_of(&at_pod_ip(&allowing(&["fe80::/10"]), "fe80::1")),
            Some("http://[fe80::1]:8000")
        );
        // Other podIPs need no rule (a cluster's pod network may be in 100.64.0.0/10 too).
        assert_eq!(
            url_of(&at_pod_ip(&rules(), "::ffff:10.1.2.3")),
            Some("http://10.1.2.3:8000")
        );
        assert_eq!(
            url_of(&at_pod_ip(&rules(), "100.100.100.100")),
            Some("http://100.100.100.100:8000")
        );
    }

    #[test]
    fn annotations_cannot_point_at_tailscales_own_addresses() {
        for address in [
            "100.100.100.100:80",
            "[::ffff:100.100.100.100]:80",
            "[fd7a:115c:a1e0::53]:80",
            "100.115.92.1:8000",
            "100.115.93.254:8000",
        ] {
            let pod = with(facts(), "tongs.dev/tailscale-address", address);
            let derived = rules().derive(&pod, None);
            assert_eq!(derived.state, PodState::NoAddress, "{address}");
            assert_eq!(
                derived.rejections[0].reason,
                Reason::TailscaleNotAllowed,
                "{address}"
            );
            let pod = with(facts(), "tongs.dev/url", &format!("http://{address}"));
            let derived = rules().derive(&pod, None);
            assert_eq!(derived.state, PodState::NoAddress, "{address}");
            assert_eq!(
                derived.rejections[0].reason,
                Reason::UrlNotAllowed,
                "{address}"
            );
        }
        // Their neighbours are ordinary Tailscale addresses; a mapped one dials its IPv4 form.
        for (address, url) in [
            ("100.100.100.101:80", "http://100.100.100.101:80"),
            ("100.115.94.1:80", "http://100.115.94.1:80"),
            ("[::ffff:100.101.1.2]:80", "http://100.101.1.2:80"),
        ] {
            let pod = with(facts(), "tongs.dev/tailscale-address", address);
            assert_eq!(url_of(&rules().derive(&pod, None)), Some(url), "{address}");
        }
        // A rule that names quad100 admits it.
        let pod = with(facts(), "tongs.dev/tailscale-address", "100.100.100.100:80");
        assert_eq!(
            url_of(&allowing(&["100.100.100.100/32"]).derive(&pod, None)),
            Some("http://100.100.100.100:80")
        );
    }

    #[test]
    fn ipv6_tailscale_addresses_work() {
        let pod = with(
            facts(),
            "tongs.dev/tailscale-address",
            "[fd7a:115c:a1e0::5]:8000",
        );
        assert_eq!(
            url_of(&rules().derive(&pod, None)),
            Some("http://[fd7a:115c:a1e0::5]:8000")
        );
    }

    #[test]
    fn facts_come_from_a_pod_object() {
        let pod: WatchedPod = serde_json::from_value(serde_json::json!({
            "metadata": {
                "namespace": "gpu", "name": "llm-1", "uid": "abc",
                "annotations": {"tongs.dev/weight": " 2 ", "other": "x", "salad.com/networking-port": "80"}
            },
            "spec": {
                "containers": [{"name": "c", "ports": [{"name": "metrics", "containerPort": 9100}, {"name": "http", "containerPort": 8000}]}],
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Equal", "value": "saladcloud", "effect": "NoSchedule"}]
            },
            "status": {"phase": "Running", "podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let facts = PodFacts::from_pod(&pod, &KubernetesConfig::default());
        assert_eq!(&*facts.key, "gpu/llm-1");
        assert_eq!(facts.named_port, Some(8000));
        assert!(facts.salad && facts.ready && !facts.terminating);
        assert_eq!(facts.pod_ip, Some("10.0.0.9".parse().unwrap()));
        assert_eq!(facts.annotations.len(), 1);
        assert_eq!(facts.annotations["tongs.dev/weight"], "2");
        assert_eq!(facts.container_group(), "gpu-llm-1");
    }
}
