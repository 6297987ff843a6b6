//! `salad`: the SaladCloud API key, which endpoints it is sent to, and the API tongs asks for gateway
//! hosts.
//!
//! One key serves both: the SaladCloud public API authenticates with `Salad-Api-Key`, and so does a
//! Container Gateway with `networking.auth: true`. The key is read from a mounted Secret file or an
//! environment variable (a Secret through `valueFrom.secretKeyRef`), never from the config file itself.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{AllowRule, Problem};

/// The SaladCloud side.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SaladConfig {
    /// A file holding the API key (a mounted Secret); re-read on every reload.
    pub api_key_file: Option<PathBuf>,
    /// Or the name of an environment variable holding it.
    pub api_key_env: Option<String>,
    /// Endpoints whose requests and heartbeats carry the key as `Salad-Api-Key`: URL patterns like
    /// `discovery.kubernetes.allow`'s. Keep this as narrow as the gateways you run.
    pub gateways: Vec<String>,
    pub api: SaladApiConfig,
}

impl Default for SaladConfig {
    fn default() -> Self {
        Self {
            api_key_file: None,
            api_key_env: None,
            gateways: vec!["https://*.salad.cloud".into()],
            api: SaladApiConfig::default(),
        }
    }
}

/// The SaladCloud public API, asked for a container group's gateway host (the `salad-api` rule).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SaladApiConfig {
    pub url: String,
    /// Organization and project the Virtual Kubelet creates container groups in (its
    /// `--organization-name` and `--project-name`); lookups are off until both are set.
    pub organization: String,
    pub project: String,
}

impl Default for SaladApiConfig {
    fn default() -> Self {
        Self {
            url: "https://api.salad.com/api/public".into(),
            organization: String::new(),
            project: String::new(),
        }
    }
}

/// Why the key could not be read.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("salad.api_key_file {path}: {detail}")]
    File { path: String, detail: String },
    #[error("salad.api_key_env: {detail}")]
    Env { detail: String },
}

impl SaladConfig {
    /// The API key, if one is configured.
    pub fn api_key(&self) -> Result<Option<String>, KeyError> {
        if let Some(path) = &self.api_key_file {
            let failed = |detail: String| KeyError::File {
                path: path.display().to_string(),
                detail,
            };
            let text = std::fs::read_to_string(path).map_err(|err| failed(err.to_string()))?;
            let key = text.trim();
            return match key {
                "" => Err(failed("is empty".into())),
                key if http::HeaderValue::from_str(key).is_err() => {
                    Err(failed("holds characters a header cannot carry".into()))
                }
                key => Ok(Some(key.to_owned())),
            };
        }
        if let Some(name) = &self.api_key_env {
            let key = std::env::var(name).map_err(|err| KeyError::Env {
                detail: format!("${name}: {err}"),
            })?;
            let key = key.trim();
            if key.is_empty() || http::HeaderValue::from_str(key).is_err() {
                return Err(KeyError::Env {
                    detail: format!("${name} is empty or not a header value"),
                });
            }
            return Ok(Some(key.to_owned()));
        }
        Ok(None)
    }

    /// The gateway patterns, parsed; entries that do not parse are left out (validation reports them).
    pub fn gateway_rules(&self) -> Vec<AllowRule> {
        self.gateways
            .iter()
            .filter_map(|entry| AllowRule::parse(entry).ok())
            .collect()
    }

    /// Whether SaladCloud API lookups are configured.
    pub fn api_enabled(&self) -> bool {
        !self.api.organization.is_empty() && !self.api.project.is_empty()
    }

    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem = |field: &str, message: String| {
            problems.push(Problem {
                field: format!("salad.{field}"),
                message,
            })
        };
        if self.api_key_file.is_some() && self.api_key_env.is_some() {
            problem(
                "api_key_env",
                "set salad.api_key_file or salad.api_key_env, not both".into(),
            );
        }
        // The key itself is read when tongs starts and on every reload, not here: `check-config` runs
        // where the Secret is not mounted, and a missing key then stops tongs with the same message.
        if let Some(name) = &self.api_key_env
            && (name.is_empty() || name.contains('=') || name.contains('\0'))
        {
            problem(
                "api_key_env",
                format!("{name:?} is not an environment variable name"),
            );
        }
        if self
            .api_key_file
            .as_ref()
            .is_some_and(|path| path.as_os_str().is_empty())
        {
            problem("api_key_file", "is empty; leave it out for no key".into());
        }
        for (index, entry) in self.gateways.iter().enumerate() {
            if let Err(message) = AllowRule::parse(entry) {
                problem(&format!("gateways[{index}]"), message);
            }
        }
        let api = &self.api;
        if api.organization.is_empty() != api.project.is_empty() {
            problem(
                "api",
                "set both organization and project (the Virtual Kubelet's), or neither".into(),
            );
        }
        for (field, value) in [
            ("api.organization", &api.organization),
            ("api.project", &api.project),
        ] {
            // SaladCloud names: lowercase letters, digits and dashes.
            if !value
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                problem(
                    field,
                    format!("{value:?} is not a SaladCloud name (a-z, 0-9, -)"),
                );
            }
        }
        if self.api_enabled() {
            match api.url.parse::<http::Uri>() {
                Ok(uri) if matches!(uri.scheme_str(), Some("http" | "https")) => {}
                _ => problem("api.url", format!("{:?} is not an http(s) URL", api.url)),
            }
            if self.api_key_file.is_none() && self.api_key_env.is_none() {
                problem(
                    "api",
                    "lookups need the API key: set salad.api_key_file or salad.api_key_env".into(),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(config: &SaladConfig) -> Vec<String> {
        let mut problems = Vec::new();
        config.validate(&mut problems);
        problems.into_iter().map(|p| p.field).collect()
    }

    #[test]
    fn defaults_are_valid_and_send_no_key() {
        let config = SaladConfig::default();
        assert!(fields(&config).is_empty());
        assert_eq!(config.api_key().unwrap(), None);
        assert!(!config.api_enabled());
    }

    #[test]
    fn the_key_comes_from_a_file_or_the_environment() {
        let dir = std::env::temp_dir().join(format!("tongs-salad-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "sk-123\n").unwrap();
        let from_file = SaladConfig {
            api_key_file: Some(file.clone()),
            ..SaladConfig::default()
        };
        assert_eq!(from_file.api_key().unwrap().as_deref(), Some("sk-123"));
        std::fs::write(&file, "  \n").unwrap();
        // Valid as configuration (the Secret may be mounted only where tongs runs), refused when read.
        assert!(fields(&from_file).is_empty());
        assert!(matches!(from_file.api_key(), Err(KeyError::File { .. })));
        let missing_env = SaladConfig {
            api_key_env: Some("TONGS_TEST_NO_SUCH_VARIABLE".into()),
            ..SaladConfig::default()
        };
        assert!(matches!(missing_env.api_key(), Err(KeyError::Env { .. })));
        let bad_name = SaladConfig {
            api_key_env: Some("A=B".into()),
            ..SaladConfig::default()
        };
        assert_eq!(fields(&bad_name), ["salad.api_key_env"]);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn lookups_need_organization_project_and_key() {
        let half = SaladConfig {
            api: SaladApiConfig {
                organization: "acme".into(),
                ..SaladApiConfig::default()
            },
            ..SaladConfig::default()
        };
        assert_eq!(fields(&half), ["salad.api"]);
        let keyless = SaladConfig {
            api: SaladApiConfig {
                organization: "acme".into(),
                project: "llm".into(),
                ..SaladApiConfig::default()
            },
            ..SaladConfig::default()
        };
        assert_eq!(fields(&keyless), ["salad.api"]);
        let bad = SaladConfig {
            gateways: vec!["*.salad.cloud".into()],
            api: SaladApiConfig {
                organization: "Acme Inc".into(),
                project: "llm".into(),
                url: "api.salad.com".into(),
            },
            api_key_env: Some("PATH".into()),
            ..SaladConfig::default()
        };
        assert_eq!(
            fields(&bad),
            [
                "salad.gateways[0]",
                "salad.api.organization",
                "salad.api.url"
            ]
        );
    }
}
