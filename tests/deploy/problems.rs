//! Collecting problems to report together, and parsing objects as their Kubernetes types so that
//! fields the types drop (misspelt keys) are reported.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Every problem found, each naming the kustomization and the object, reported together at the end.
#[derive(Default)]
pub(crate) struct Problems(pub(crate) Vec<String>);

impl Problems {
    pub(crate) fn fail(&mut self, at: &str, message: impl Into<String>) {
        self.0.push(format!("{at}: {}", message.into()));
    }

    pub(crate) fn assert_none(self, what: &str) {
        let count = self.0.len();
        assert!(
            count == 0,
            "{what}: {count} problem(s):\n  - {}",
            self.0.join("\n  - ")
        );
    }
}

/// Parses `value` as `T`. The Kubernetes types skip fields they do not know, so the object is also
/// written back, and every field that did not survive is reported: a misspelt key, most likely.
pub(crate) fn typed<T: DeserializeOwned + Serialize>(
    value: &Value,
    at: &str,
    problems: &mut Problems,
) -> Option<T> {
    let object: T = serde_json::from_value(value.clone())
        .map_err(|err| problems.fail(at, format!("does not parse as its Kubernetes type: {err}")))
        .ok()?;
    let written = serde_json::to_value(&object).unwrap_or(Value::Null);
    let mut dropped = Vec::new();
    dropped_fields(value, &written, "", &mut dropped);
    for field in dropped {
        problems.fail(at, format!("unknown field `{field}` (misspelt?)"));
    }
    Some(object)
}

/// Paths of the keys of `original` that `written` lacks (null values aside).
fn dropped_fields(original: &Value, written: &Value, path: &str, out: &mut Vec<String>) {
    match (original, written) {
        (Value::Object(original), Value::Object(written)) => {
            for (key, child) in original {
                let child_path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match written.get(key) {
                    Some(written) => dropped_fields(child, written, &child_path, out),
                    None if child.is_null() => {}
                    None => out.push(child_path),
                }
            }
        }
        (Value::Array(original), Value::Array(written)) => {
            for (index, (child, written)) in original.iter().zip(written).enumerate() {
                dropped_fields(child, written, &format!("{path}[{index}]"), out);
            }
        }
        _ => {}
    }
}

/// Parses a built-in kind, checking its apiVersion against the Rust type's.
pub(crate) fn parse<T>(value: &Value, at: &str, problems: &mut Problems) -> Option<T>
where
    T: k8s_openapi::Resource + DeserializeOwned + Serialize,
{
    let version = &value["apiVersion"];
    ensure!(
        problems,
        at,
        *version == T::API_VERSION,
        "apiVersion {version}, expected {}",
        T::API_VERSION
    );
    typed(value, at, problems)
}

/// Reports every key of a custom resource's object that its schema lacks (`allowed`, space-separated).
pub(crate) fn known_keys(
    at: &str,
    what: &str,
    value: &Value,
    allowed: &str,
    problems: &mut Problems,
) {
    for key in value.as_object().into_iter().flat_map(|map| map.keys()) {
        let known = allowed.split_whitespace().any(|field| field == key);
        ensure!(
            problems,
            at,
            known,
            "{what} has unknown field `{key}` (misspelt? else list it in tests/deploy.rs)"
        );
    }
}
