//! Strict YAML loading shared by every file tongs reads (the configuration, the simulated fleet).

use std::path::Path;

use super::{ConfigError, Problem};

/// Parses YAML into `T` strictly, naming the field a failure happened in. An empty document (or one
/// holding only comments) means `T::default()`.
pub fn parse_yaml<T: serde::de::DeserializeOwned + Default>(
    text: &str,
    origin: &str,
) -> Result<T, ConfigError> {
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
    .map_err(|err| ConfigError::Invalid {
        origin: origin.to_owned(),
        problems: vec![Problem {
            field: if failed_at == "." {
                String::new()
            } else {
                failed_at
            },
            // The parser names its input `<input>`: the file's name says more.
            message: err.to_string().replace("<input>", origin),
        }],
    })
}

/// [`parse_yaml`], then `validate`, which returns every problem the types alone cannot catch.
pub fn parse_validated<T: serde::de::DeserializeOwned + Default>(
    text: &str,
    origin: &str,
    validate: impl FnOnce(&T) -> Vec<Problem>,
) -> Result<T, ConfigError> {
    let value: T = parse_yaml(text, origin)?;
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
