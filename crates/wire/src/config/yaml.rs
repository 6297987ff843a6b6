//! Strict YAML loading shared by every file tongs reads (the configuration, the simulated fleet).

use std::path::Path;

use super::{ConfigError, Problem};

/// Parses YAML into `T` strictly, naming the field a failure happened in. An empty document (or one
/// holding only comments) means `T::default()`.
pub fn parse_yaml<T: serde::de::DeserializeOwned + Default>(
    text: &str,
    origin: &str,
) -> Result<T, ConfigError> {
    parse_all(text, origin).map_err(|(problems, _)| ConfigError::Invalid {
        origin: origin.to_owned(),
        problems,
    })
}

/// [`parse_yaml`], and on failure every problem found together with what the rest of the file reads
/// as (see [`every_problem`]), for validation to find the problems the types alone cannot.
fn parse_all<T: serde::de::DeserializeOwned + Default>(
    text: &str,
    origin: &str,
) -> Result<T, (Vec<Problem>, Option<T>)> {
    let only_comments = text.lines().all(|l| {
        let l = l.trim();
        l.is_empty() || l.starts_with('#') || l == "---"
    });
    if only_comments {
        return Ok(T::default());
    }
    // serde_path_to_error tracks which field the parser was in when it failed; the parser's own message
    // adds the line and column.
    let mut failed_at = String::new();
    serde_saphyr::with_deserializer_from_str(text, |deserializer| {
        serde_path_to_error::deserialize(deserializer).map_err(|err| {
            failed_at = err.path().to_string();
            err.into_inner()
        })
    })
    .map_err(|err| {
        let first = Problem {
            field: shown_path(&failed_at),
            // The parser names its input `<input>`: the file's name says more.
            message: err.to_string().replace("<input>", origin),
        };
        every_problem::<T>(text, first)
    })
}

/// Problems reported for one file at most: past this many, the file is not worth reading on.
const MAX_PROBLEMS: usize = 100;

/// Every problem of a file whose first one is `first`, not just that one: serde stops at the first
/// error, so the file is read again as plain data, and each field that fails is noted and taken out
/// (it then takes its default) until the rest reads. Each round takes something out, so it ends. A
/// YAML syntax error cannot be read past: it is the one problem reported.
fn every_problem<T: serde::de::DeserializeOwned>(
    text: &str,
    first: Problem,
) -> (Vec<Problem>, Option<T>) {
    let mut problems = vec![first];
    let Ok(mut value) = serde_saphyr::from_str::<serde_json::Value>(text) else {
        return (problems, None);
    };
    while problems.len() < MAX_PROBLEMS {
        let err = match serde_path_to_error::deserialize::<_, T>(&value) {
            Ok(rest) => return (problems, Some(rest)),
            Err(err) => err,
        };
        let field = shown_path(&err.path().to_string());
        // The first problem, met again: it is already reported, with the parser's line and column.
        if !problems.iter().any(|known| known.field == field) {
            problems.push(Problem {
                field,
                message: err.inner().to_string(),
            });
        }
        if !take_out(&mut value, err.path()) {
            break;
        }
    }
    (problems, None)
}

/// A field path as problems name it: empty for the document itself.
fn shown_path(path: &str) -> String {
    if path == "." {
        String::new()
    } else {
        path.to_owned()
    }
}

/// Takes the value at `path` out of `value` (a map's entry, a list's element); false if there is none.
fn take_out(value: &mut serde_json::Value, path: &serde_path_to_error::Path) -> bool {
    use serde_path_to_error::Segment;
    let segments: Vec<&Segment> = path.iter().collect();
    let Some((last, parents)) = segments.split_last() else {
        return false;
    };
    let mut at = value;
    for segment in parents {
        let next = match segment {
            Segment::Map { key } => at.get_mut(key.as_str()),
            Segment::Seq { index } => at.get_mut(*index),
            Segment::Enum { .. } | Segment::Unknown => return false,
        };
        let Some(next) = next else {
            return false;
        };
        at = next;
    }
    match (last, at) {
        (Segment::Map { key }, serde_json::Value::Object(map)) => {
            map.remove(key.as_str()).is_some()
        }
        (Segment::Seq { index }, serde_json::Value::Array(list)) if *index < list.len() => {
            list.remove(*index);
            true
        }
        _ => false,
    }
}

/// [`parse_yaml`], then `validate`, which returns every problem the types alone cannot catch.
pub fn parse_validated<T: serde::de::DeserializeOwned + Default>(
    text: &str,
    origin: &str,
    validate: impl FnOnce(&T) -> Vec<Problem>,
) -> Result<T, ConfigError> {
    let value: T = match parse_all(text, origin) {
        Ok(value) => value,
        Err((mut problems, rest)) => {
            // What the rest of the file says, checked too: one run names every problem.
            for problem in rest.as_ref().map(validate).unwrap_or_default() {
                if !problems.iter().any(|known| known.field == problem.field) {
                    problems.push(problem);
                }
            }
            return Err(ConfigError::Invalid {
                origin: origin.to_owned(),
                problems,
            });
        }
    };
    let problems = validate(&value);
    if problems.is_empty() {
        Ok(value)
    } else {
        Err(ConfigError::Invalid {
            origin: origin.to_owned(),
            problems,
        })
    }
}

/// Reads a YAML file and [`parse_validated`]s it, naming the file in errors.
pub fn load_validated<T: serde::de::DeserializeOwned + Default>(
    path: &Path,
    validate: impl FnOnce(&T) -> Vec<Problem>,
) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_validated(&text, &path.display().to_string(), validate)
}
