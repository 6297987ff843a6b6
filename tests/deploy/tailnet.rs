//! tongs on the tailnet: where the Tailscale sidecar runs, its serve configuration (containerboot's
//! `TS_SERVE_CONFIG`) publishes exactly the nodes' calls, `POST /v1/nodes/register` and
//! `POST /v1/nodes/drain`, of tongs' admin port, over HTTPS on
//! the sidecar's stable MagicDNS name, and nothing else of the pod: no other path, port or Funnel.
//! What serve cannot close (the other ports of the pod's Tailscale IP) the tailnet policy must; that is
//! deploy/README.md's part.

use serde_json::Value;
use tongs::config::Config;

use crate::objects::{name_of, tongs_pod_spec};
use crate::read;
use crate::render::rendered;

/// The registration path as tongs' admin server routes it (`src/admin/register.rs`, private there).
const REGISTER: &str = "/v1/nodes/register";

/// The path where a node says it is going (`src/admin/register.rs`).
const DRAIN: &str = "/v1/nodes/drain";

/// containerboot replaces this with the node's MagicDNS name when it reads the file.
const CERT_DOMAIN: &str = "${TS_CERT_DOMAIN}";

/// The tailscale sidecar of tongs' pod, if the rendering has one.
fn sidecar(documents: &mut [Value]) -> Option<Value> {
    let spec = tongs_pod_spec(documents);
    spec["initContainers"]
        .as_array()?
        .iter()
        .find(|container| container["name"] == "tailscale")
        .cloned()
}

fn env<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()?
        .iter()
        .find(|var| var["name"] == name)
}

/// What is wrong with how a rendering puts tongs on the tailnet; nothing without the sidecar.
fn tailnet_problems(documents: &[Value]) -> Vec<String> {
    let mut documents = documents.to_vec();
    let Some(sidecar) = sidecar(&mut documents) else {
        return Vec::new();
    };
    let mut problems = Vec::new();
    let hostname = env(&sidecar, "TS_HOSTNAME").and_then(|var| var["value"].as_str());
    if hostname.is_none_or(str::is_empty) {
        problems.push(
            "TS_HOSTNAME must be a literal name: nodes register with one stable MagicDNS name"
                .into(),
        );
    }
    let Some(path) = env(&sidecar, "TS_SERVE_CONFIG").and_then(|var| var["value"].as_str()) else {
        problems.push("no TS_SERVE_CONFIG: registration is not published on the tailnet".into());
        return problems;
    };
    let Some((dir, file)) = path.rsplit_once('/') else {
        problems.push(format!("TS_SERVE_CONFIG {path:?} is not an absolute path"));
        return problems;
    };
    let spec = tongs_pod_spec(&mut documents).clone();
    let volume = sidecar["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|mount| mount["mountPath"] == dir && mount["subPath"].is_null())
        .and_then(|mount| {
            spec["volumes"]
                .as_array()?
                .iter()
                .find(|volume| volume["name"] == mount["name"])
        });
    let Some(config_map) = volume.and_then(|volume| volume["configMap"]["name"].as_str()) else {
        problems.push(format!(
            "{dir} is not a ConfigMap mounted as a directory (containerboot watches the directory)"
        ));
        return problems;
    };
    let Some(text) = documents
        .iter()
        .find(|doc| doc["kind"] == "ConfigMap" && name_of(doc) == config_map)
        .and_then(|doc| doc["data"][file].as_str())
    else {
        problems.push(format!("ConfigMap {config_map} has no {file}"));
        return problems;
    };
    let serve: Value = match serde_json::from_str(text) {
        Ok(serve) => serve,
        Err(err) => {
            problems.push(format!("{file} is not JSON: {err}"));
            return problems;
        }
    };
    let admin_port = documents
        .iter()
        .filter(|doc| doc["kind"] == "ConfigMap")
        .find_map(|doc| doc["data"]["tongs.yaml"].as_str())
        .and_then(|yaml| Config::parse(yaml, "tongs.yaml").ok())
        .map(|config| config.admin.listen.port());
    let wanted = serde_json::json!({
        "TCP": { "443": { "HTTPS": true } },
        "Web": {
            format!("{CERT_DOMAIN}:443"): {
                "Handlers": {
                    REGISTER: { "Proxy": format!("http://127.0.0.1:{}{REGISTER}", admin_port.unwrap_or(0)) },
                    DRAIN: { "Proxy": format!("http://127.0.0.1:{}{DRAIN}", admin_port.unwrap_or(0)) }
                }
            }
        }
    });
    if serve != wanted {
        problems.push(format!(
            "{file} must publish HTTPS on 443 of the MagicDNS name with two handlers, {REGISTER} and \
             {DRAIN} to the admin port, and nothing else (no other port, path or Funnel):\n{serve:#}\n\
             wanted\n{wanted:#}"
        ));
    }
    problems
}

#[test]
fn the_tailnet_sees_only_the_nodes_calls_over_https_on_a_stable_name() {
    let source = read("src/admin/register.rs");
    assert!(
        source.contains(&format!("REGISTER_PATH: &str = \"{REGISTER}\""))
            && source.contains(&format!("DRAIN_PATH: &str = \"{DRAIN}\"")),
        "tongs' node paths moved: update {REGISTER} and {DRAIN} here and in the serve config"
    );
    let mut with_sidecar = 0;
    for (overlay, documents) in rendered() {
        let mut copy = documents.clone();
        if copy
            .iter()
            .any(|doc| doc["kind"] == "Deployment" && name_of(doc) == crate::TONGS)
            && sidecar(&mut copy).is_some()
        {
            with_sidecar += 1;
        }
        let problems = tailnet_problems(documents);
        assert!(problems.is_empty(), "{overlay}: {problems:#?}");
    }
    assert!(with_sidecar > 0, "no rendering runs the Tailscale sidecar");
}

/// The check above finds what would publish more than registration, or publish it where nodes cannot
/// find it.
#[test]
fn the_tailnet_check_catches_more_than_registration_published() {
    let (_, documents) = rendered()
        .iter()
        .find(|(source, _)| source == "deploy/overlays/salad-tailscale")
        .expect("salad-tailscale renders");
    assert_eq!(tailnet_problems(documents), Vec::<String>::new());
    let serve_map = |documents: &mut Vec<Value>| -> usize {
        documents
            .iter()
            .position(|doc| {
                doc["kind"] == "ConfigMap" && name_of(doc).starts_with("tongs-tailscale-serve")
            })
            .expect("the serve ConfigMap")
    };
    let with_serve = |change: &dyn Fn(&mut Value)| {
        let mut documents = documents.clone();
        let index = serve_map(&mut documents);
        let text = documents[index]["data"]["serve.json"]
            .as_str()
            .unwrap()
            .to_owned();
        let mut serve: Value = serde_json::from_str(&text).unwrap();
        change(&mut serve);
        documents[index]["data"]["serve.json"] = Value::String(serve.to_string());
        tailnet_problems(&documents)
    };
    let web = format!("{CERT_DOMAIN}:443");
    // The whole admin port.
    let problems = with_serve(&|serve| {
        serve["Web"][&web]["Handlers"]["/"] = serde_json::json!({"Proxy": "http://127.0.0.1:9090"});
    });
    assert_eq!(problems.len(), 1, "{problems:#?}");
    // The client port behind the registration path.
    let problems = with_serve(&|serve| {
        serve["Web"][&web]["Handlers"][REGISTER]["Proxy"] =
            Value::String(format!("http://127.0.0.1:8080{REGISTER}"));
    });
    assert_eq!(problems.len(), 1, "{problems:#?}");
    // Plain HTTP, and the public internet.
    let problems = with_serve(&|serve| serve["TCP"]["80"] = serde_json::json!({"HTTP": true}));
    assert_eq!(problems.len(), 1, "{problems:#?}");
    let problems =
        with_serve(&|serve| serve["AllowFunnel"] = serde_json::json!({ web.clone(): true }));
    assert_eq!(problems.len(), 1, "{problems:#?}");
    // A per-pod name no node can know in advance.
    let mut documents = documents.clone();
    let spec = tongs_pod_spec(&mut documents);
    for container in spec["initContainers"].as_array_mut().unwrap() {
        for var in container["env"].as_array_mut().into_iter().flatten() {
            if var["name"] == "TS_HOSTNAME" {
                *var = serde_json::json!({
                    "name": "TS_HOSTNAME",
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}
                });
            }
        }
    }
    let problems = tailnet_problems(&documents);
    assert!(
        problems.iter().any(|p| p.contains("TS_HOSTNAME")),
        "{problems:#?}"
    );
}
