//! The Kubernetes API client discovery watches through: in-cluster, or from a kubeconfig.

use std::time::Duration;

use std::path::{Path, PathBuf};

/// A kube client, retried with backoff until one can be made (a missing service account is an
/// operator's error: say so, stay unready, keep trying).
/// `field` names the configuration key of `kubeconfig` in errors.
pub(super) async fn connect(kubeconfig: Option<&Path>, field: &'static str) -> kube::Client {
    let mut delay = Duration::from_secs(1);
    loop {
        match try_connect(kubeconfig, field).await {
            Ok(client) => return client,
            Err(err) => {
                tracing::error!(error = %err, "cannot make a Kubernetes client; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// Why no Kubernetes client could be made.
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("{field} {}: {source}", path.display())]
    Kubeconfig {
        field: &'static str,
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error(
        "{field} {}: the cluster's proxy-url {proxy} is not supported; tongs reaches the API server \
         directly",
        path.display()
    )]
    ProxyUnsupported {
        field: &'static str,
        path: PathBuf,
        proxy: String,
    },
    #[error("no in-cluster service account and no kubeconfig: {0}")]
    NoCluster(kube::config::InferConfigError),
    #[error(transparent)]
    Client(#[from] kube::Error),
}

async fn try_connect(
    kubeconfig: Option<&Path>,
    field: &'static str,
) -> Result<kube::Client, ConnectError> {
    let kube_config = match kubeconfig {
        Some(path) => {
            let failed = |source| ConnectError::Kubeconfig {
                field,
                path: path.to_owned(),
                source,
            };
            let file = kube::config::Kubeconfig::read_from(path).map_err(failed)?;
            let mut kube_config = kube::Config::from_custom_kubeconfig(
                file,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(failed)?;
            // kube takes HTTPS_PROXY from the environment when the kubeconfig names no proxy, and
            // then fails to build a client at all (tongs has no proxy support for the API server).
            // A proxy meant for other traffic must not stop discovery; one the kubeconfig asks for is
            // refused in words.
            if let Some(proxy) = kube_config.proxy_url.take() {
                let proxy = proxy.to_string();
                let from_env = ["HTTPS_PROXY", "https_proxy"].iter().any(|name| {
                    std::env::var(name).is_ok_and(|value| {
                        value.trim_end_matches('/') == proxy.trim_end_matches('/')
                    })
                });
                if !from_env {
                    return Err(ConnectError::ProxyUnsupported {
                        field,
                        path: path.to_owned(),
                        proxy,
                    });
                }
                tracing::warn!(proxy = %proxy, "HTTPS_PROXY is ignored for the Kubernetes API server");
            }
            kube_config
        }
        None => kube::Config::infer()
            .await
            .map_err(ConnectError::NoCluster)?,
    };
    Ok(kube::Client::try_from(kube_config)?)
}
