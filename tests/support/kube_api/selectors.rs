//! Label and field selectors, parsed and matched as the API server does (the subset the fake
//! implements; anything else is a 400, never ignored).

use serde_json::Value;

/// The pod fields the API server accepts in a field selector.
pub(crate) const POD_FIELDS: [&str; 10] = [
    "metadata.name",
    "metadata.namespace",
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
];

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A label selector, as `labelSelector` spells it.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct LabelSelector(Vec<Requirement>);

impl LabelSelector {
    pub(crate) fn parse(text: &str) -> Result<LabelSelector, String> {
        let mut requirements = Vec::new();
        if text.trim().is_empty() {
            return Ok(LabelSelector(requirements));
        }
        for part in split_top_level(text) {
            let part = part.trim();
            let requirement = if let Some(key) = part.strip_prefix('!') {
                Requirement::NotExists(label_key(key.trim())?)
            } else if let Some((key, value)) = part.split_once("!=") {
                Requirement::NotEquals(label_key(key.trim())?, label_value(value.trim())?)
            } else if let Some((key, value)) = part.split_once("==") {
                Requirement::Equals(label_key(key.trim())?, label_value(value.trim())?)
            } else if let Some((key, value)) = part.split_once('=') {
                Requirement::Equals(label_key(key.trim())?, label_value(value.trim())?)
            } else if let Some((key, rest)) = part.split_once(char::is_whitespace) {
                let rest = rest.trim();
                let (set, operator) = if let Some(set) = rest.strip_prefix("notin") {
                    (set, "notin")
                } else if let Some(set) = rest.strip_prefix("in") {
                    (set, "in")
                } else {
                    return Err(format!(
                        "unable to parse requirement: found '{rest}', expected: in, notin, =, ==, !=, gt, lt"
                    ));
                };
                let set = set.trim();
                let Some(inner) = set.strip_prefix('(').and_then(|s| s.strip_suffix(')')) else {
                    return Err(format!(
                        "unable to parse requirement: found '{set}', expected: '('"
                    ));
                };
                let values = inner
                    .split(',')
                    .map(|v| label_value(v.trim()))
                    .collect::<Result<Vec<_>, _>>()?;
                let key = label_key(key.trim())?;
                if operator == "in" {
                    Requirement::In(key, values)
                } else {
                    Requirement::NotIn(key, values)
                }
            } else {
                if part.contains(['<', '>', '(', ')']) {
                    return Err(format!(
                        "unable to parse requirement: {part:?}: the fake supports =, ==, !=, in, notin, exists and !exists"
                    ));
                }
                Requirement::Exists(label_key(part)?)
            };
            requirements.push(requirement);
        }
        Ok(LabelSelector(requirements))
    }

    pub(crate) fn matches(&self, pod: &Value) -> bool {
        let labels = pod
            .get("metadata")
            .and_then(|m| m.get("labels"))
            .and_then(Value::as_object);
        self.matches_labels(|key| labels.and_then(|l| l.get(key)).and_then(Value::as_str))
    }

    /// Whether labels, as `label` looks them up, satisfy every requirement.
    pub(crate) fn matches_labels<'a>(&self, label: impl Fn(&str) -> Option<&'a str>) -> bool {
        self.0.iter().all(|requirement| match requirement {
            Requirement::Equals(key, value) => label(key) == Some(value),
            Requirement::NotEquals(key, value) => label(key) != Some(value),
            Requirement::In(key, values) => {
                label(key).is_some_and(|l| values.iter().any(|v| v == l))
            }
            Requirement::NotIn(key, values) => {
                label(key).is_none_or(|l| values.iter().all(|v| v != l))
            }
            Requirement::Exists(key) => label(key).is_some(),
            Requirement::NotExists(key) => label(key).is_none(),
        })
    }
}

/// Splits at commas outside parentheses.
pub(crate) fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (index, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..index]);
                start = index + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

pub(crate) fn label_key(key: &str) -> Result<String, String> {
    // Label keys are qualified names, like annotation keys.
    if tongs::config::is_qualified_name(key) {
        Ok(key.to_owned())
    } else {
        Err(format!(
            "unable to parse requirement: invalid label key {key:?}: name part must consist of alphanumeric characters, '-', '_' or '.'"
        ))
    }
}

pub(crate) fn label_value(value: &str) -> Result<String, String> {
    let ok = value.is_empty()
        || (value.len() <= 63
            && value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            && value.as_bytes()[0].is_ascii_alphanumeric()
            && value.as_bytes()[value.len() - 1].is_ascii_alphanumeric());
    if ok {
        Ok(value.to_owned())
    } else {
        Err(format!(
            "unable to parse requirement: invalid label value {value:?}: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.'"
        ))
    }
}

/// A field selector over the fields the API server indexes for a resource.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// A field selector over pod fields.
    pub(crate) fn parse(text: &str) -> Result<FieldSelector, String> {
        FieldSelector::parse_for(text, &POD_FIELDS)
    }

    /// A field selector that may name only `supported` fields.
    pub(crate) fn parse_for(text: &str, supported: &[&str]) -> Result<FieldSelector, String> {
        let mut terms = Vec::new();
        if text.trim().is_empty() {
            return Ok(FieldSelector(terms));
        }
        for part in text.split(',') {
            let (field, equal, value) = if let Some((f, v)) = part.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, true, v)
            } else {
                return Err(format!(
                    "invalid selector: '{part}'; can't understand '{part}'"
                ));
            };
            let field = field.trim();
            if !supported.contains(&field) {
                return Err(format!("field label not supported: {field}"));
            }
            terms.push((field.to_owned(), equal, value.trim().to_owned()));
        }
        Ok(FieldSelector(terms))
    }

    pub(crate) fn matches(&self, pod: &Value) -> bool {
        self.0.iter().all(|(field, equal, value)| {
            let path: Vec<&str> = field.split('.').collect();
            let actual = match path.iter().try_fold(pod, |v, key| v.get(key)) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Bool(b)) => b.to_string(),
                Some(other) if !other.is_null() => other.to_string(),
                _ if field == "spec.hostNetwork" => "false".into(),
                _ => String::new(),
            };
            (actual == *value) == *equal
        })
    }
}
