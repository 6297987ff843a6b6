//! tongs in the benchmark's own process (the library's `App` rather than the binary), for the benchmarks
//! that read its registry while it runs or start it once per contender cheaply.

use std::fmt::Display;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tongs::App;
use tongs::admission::Queue;
use tongs::config::Config;
use tongs::registry::Registry;

/// tongs serving on a free loopback port in this process until [`InProcessTongs::stop`].
pub struct InProcessTongs {
    /// `http://127.0.0.1:PORT`, the proxy port.
    pub url: String,
    pub registry: Arc<Registry>,
    /// Its queue (the requests waiting for an endpoint).
    pub queue: Arc<Queue>,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl InProcessTongs {
    /// Starts tongs with `yaml` (settings without `listen`, `admin` or `discovery`, which this adds: free
    /// loopback ports, and `urls` as static endpoints).
    pub async fn start(
        yaml: &str,
        urls: impl IntoIterator<Item = impl Display>,
    ) -> Result<InProcessTongs> {
        let text = format!(
            "listen: 127.0.0.1:0\nadmin: {{ listen: 127.0.0.1:0 }}\n{yaml}{}",
            super::static_discovery(urls)
        );
        let config = Config::parse(&text, "the bench's tongs configuration")
            .map_err(|err| anyhow!("the bench's tongs configuration is invalid: {err}\n{text}"))?;
        let app = App::bind(&config).await.context("starting tongs")?;
        let url = format!("http://{}", app.proxy_addr());
        let registry = app.registry();
        let queue = app.queue();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(app.run(shutdown.clone()));
        Ok(InProcessTongs {
            url,
            registry,
            queue,
            shutdown,
            task,
        })
    }

    /// Shuts tongs down and waits (at most 30 s) for it to drain; `bench` names the benchmark in the
    /// note printed when it did not.
    pub async fn stop(self, bench: &str) {
        self.shutdown.cancel();
        if tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .is_err()
        {
            eprintln!("{bench}: tongs did not finish draining within 30 s");
        }
    }
}
