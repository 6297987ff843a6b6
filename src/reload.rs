//! Configuration reload: on a change to the config file, and on SIGHUP.
//!
//! Kubernetes updates a ConfigMap volume by writing a new timestamped directory and swapping the
//! `..data` symlink to it; the file tongs was given (`tongs.yaml` → `..data/tongs.yaml`) never changes
//! itself, so a watch on the file alone misses the update. tongs watches the file's *directory* instead
//! and, on a change there (a file created, written, renamed or removed; debounced), reads the file
//! again through its symlinks and reloads if its content changed. Reads are events too, tongs' own
//! included, and are ignored.
//!
//! A reload validates the whole file first: an invalid (or unreadable) file keeps the configuration in
//! force, logs every problem with its field, and counts as `invalid`, once per version of the file. A valid one applies live what can change
//! live — timeouts of the request path, retries, breakers, balancing, concurrency limits, the queue,
//! heartbeat settings, static endpoints — without dropping a request (requests under way finish with
//! what they started with, endpoints that stay keep their state), and names in the log what needs a
//! restart (listen addresses, workers, connection-level timeouts and limits, upstream TLS and pooling,
//! switching heartbeats on or off, the retry budget's rates, `tracing`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use notify::{EventKind, Watcher};
use tokio_util::sync::CancellationToken;

use crate::balance::config_problems;
use crate::config::{Config, ConfigError};
use crate::metrics::Metrics;

/// Events closer together than this are one change (an editor or a ConfigMap swap makes several).
const DEBOUNCE: Duration = Duration::from_millis(200);

/// What a reload applies a new configuration to: the running app (`app::Parts`, through the same
/// `apply` the start used).
pub trait Apply: Send + Sync {
    /// Applies `next` to everything that can change live.
    fn apply(&self, next: &Config);
    /// Where reloads are counted.
    fn metrics(&self) -> &Metrics;
}

/// How a reload went.
#[derive(Debug)]
pub enum Reloaded {
    /// Applied; the keys listed changed but take effect only after a restart.
    Applied { needs_restart: Vec<&'static str> },
    /// The file's content is what was seen last (applied, or rejected already): nothing to do.
    Unchanged,
    /// Not applied: the file is unreadable or invalid.
    Rejected(ConfigError),
}

/// Keys whose change a running proxy cannot apply.
fn needs_restart(current: &Config, next: &Config) -> Vec<&'static str> {
    fn differs<T: serde::Serialize>(a: &T, b: &T) -> bool {
        serde_json::to_value(a).ok() != serde_json::to_value(b).ok()
    }
    let mut keys = Vec::new();
    let mut check = |key: &'static str, changed: bool| {
        if changed {
            keys.push(key);
        }
    };
    check("listen", current.listen != next.listen);
    check("admin.listen", current.admin.listen != next.admin.listen);
    check(
        "admin.max_connections",
        current.admin.max_connections != next.admin.max_connections,
    );
    check("workers", current.workers != next.workers);
    check(
        "timeouts.connect",
        differs(&current.timeouts.connect, &next.timeouts.connect),
    );
    check(
        "timeouts.idle",
        differs(&current.timeouts.idle, &next.timeouts.idle),
    );
    check(
        "timeouts.header_read",
        differs(&current.timeouts.header_read, &next.timeouts.header_read),
    );
    check(
        "limits.max_header_bytes",
        current.limits.max_header_bytes != next.limits.max_header_bytes,
    );
    check("upstream", differs(&current.upstream, &next.upstream));
    check("salad.api", differs(&current.salad.api, &next.salad.api));
    check(
        "health.enabled",
        current.health.enabled != next.health.enabled,
    );
    check(
        "retry.budget_percent",
        current.retry.budget_percent != next.retry.budget_percent,
    );
    check(
        "retry.budget_min_per_second",
        current.retry.budget_min_per_second != next.retry.budget_min_per_second,
    );
    // The OTLP exporter is made once, at start.
    check("tracing", current.tracing != next.tracing);
    keys
}

/// Reads and validates `path`, and applies it to `target` if its content differs from `last` (or
/// `forced`); `current` is the configuration in force, replaced by the one applied.
///
/// `last` is the content seen last, good or bad: a version that is not UTF-8 or not a valid
/// configuration is rejected (logged and counted) once, and again only when the file changes.
pub fn reload(
    target: &dyn Apply,
    current: &Mutex<Config>,
    path: &Path,
    last: &mut Option<Vec<u8>>,
    forced: bool,
) -> Reloaded {
    let content = match std::fs::read(path) {
        Ok(content) => content,
        Err(source) => {
            return Reloaded::Rejected(ConfigError::Read {
                path: path.to_owned(),
                source,
            });
        }
    };
    if !forced && last.as_deref() == Some(content.as_slice()) {
        return Reloaded::Unchanged;
    }
    let content = last.insert(content);
    let text = match std::str::from_utf8(content) {
        Ok(text) => text,
        Err(err) => {
            return Reloaded::Rejected(ConfigError::Read {
                path: path.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, err),
            });
        }
    };
    let config = match Config::parse_with(text, &path.display().to_string(), config_problems) {
        Ok(config) => config,
        Err(err) => return Reloaded::Rejected(err),
    };
    let mut current = current.lock().unwrap_or_else(|p| p.into_inner());
    let needs_restart = needs_restart(&current, &config);
    target.apply(&config);
    *current = config;
    Reloaded::Applied { needs_restart }
}

/// `path`'s content if it says what `current` is (the configuration in force), `None` if it does not or
/// cannot be read.
fn in_force(current: &Mutex<Config>, path: &Path) -> Option<Vec<u8>> {
    let content = std::fs::read(path).ok()?;
    let text = std::str::from_utf8(&content).ok()?;
    let config = Config::parse_with(text, &path.display().to_string(), config_problems).ok()?;
    let current = current.lock().unwrap_or_else(|p| p.into_inner());
    let same = serde_json::to_value(&config).ok()? == serde_json::to_value(&*current).ok()?;
    same.then_some(content)
}

/// Whether a watcher event can mean the file changed. Opening, reading and closing a file without
/// writing are events too, and tongs' own reads of it cause them: reacting to those would re-read the
/// file after every read, for ever.
fn is_change(event: &notify::Event) -> bool {
    use notify::event::{AccessKind, AccessMode, MetadataKind, ModifyKind};
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        EventKind::Modify(ModifyKind::Metadata(MetadataKind::AccessTime)) => false,
        EventKind::Create(_) | EventKind::Modify(_) | EventKind::Remove(_) | EventKind::Any => true,
        // The watcher lost events (its queue overflowed): anything may have changed.
        EventKind::Other => event.need_rescan(),
    }
}

/// Logs and counts a reload's outcome.
fn report(metrics: &Metrics, outcome: &Reloaded, trigger: &str) {
    match outcome {
        Reloaded::Applied { needs_restart } => {
            metrics.reload(true);
            tracing::info!(trigger, "configuration reloaded");
            if !needs_restart.is_empty() {
                tracing::warn!(
                    trigger,
                    keys = needs_restart.join(", "),
                    "these changed keys take effect only after a restart"
                );
            }
        }
        Reloaded::Unchanged => {
            tracing::debug!(trigger, "configuration file unchanged");
        }
        Reloaded::Rejected(err) => {
            metrics.reload(false);
            match err {
                ConfigError::Invalid { problems, .. } => {
                    for problem in problems {
                        tracing::error!(
                            trigger,
                            field = %problem.field,
                            problem = %problem.message,
                            "configuration reload rejected; the configuration in force stays"
                        );
                    }
                }
                ConfigError::Read { .. } => {
                    tracing::error!(trigger, error = %err, "configuration reload rejected; the configuration in force stays");
                }
            }
        }
    }
}

/// SIGHUP, listened for from now on. Taken before tongs says it serves: until a handler is installed,
/// a SIGHUP keeps its default action and ends the process, so an operator's reload sent right after
/// the start would kill it.
pub fn hangups() -> Option<tokio::signal::unix::Signal> {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(signal) => Some(signal),
        Err(err) => {
            tracing::error!(error = %err, "cannot listen for SIGHUP");
            None
        }
    }
}

/// Watches `path`'s directory and `hangups` (see [`hangups`]), reloading until `stop`.
pub async fn watch(
    path: PathBuf,
    current: Mutex<Config>,
    target: Arc<dyn Apply>,
    mut hangups: Option<tokio::signal::unix::Signal>,
    stop: CancellationToken,
) {
    let directory = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
        _ => PathBuf::from("."),
    };
    let (events, mut changed) = tokio::sync::mpsc::unbounded_channel::<()>();
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok_and(|event| is_change(&event)) {
            let _ = events.send(());
        }
    });
    let watcher = match watcher {
        Ok(mut watcher) => match watcher.watch(&directory, notify::RecursiveMode::NonRecursive) {
            Ok(()) => Some(watcher),
            Err(err) => {
                tracing::error!(directory = %directory.display(), error = %err, "cannot watch the configuration's directory; reload with SIGHUP");
                None
            }
        },
        Err(err) => {
            tracing::error!(error = %err, "cannot watch files; reload with SIGHUP");
            None
        }
    };
    // Without a watcher its channel's sender is gone and would report "closed" at once, forever.
    let mut watching = watcher.is_some();
    // The content in force, so an event reloads only a real change. A change made after the start read
    // the file and before the watch began raised no event: it is loaded now.
    let mut last = in_force(&current, &path);
    if last.is_none() {
        let outcome = reload(target.as_ref(), &current, &path, &mut last, false);
        report(target.metrics(), &outcome, "file");
    }
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            event = changed.recv(), if watching => {
                if event.is_none() {
                    // The watcher is gone; SIGHUP still works.
                    watching = false;
                    continue;
                }
                tokio::time::sleep(DEBOUNCE).await;
                while changed.try_recv().is_ok() {}
                let outcome = reload(target.as_ref(), &current, &path, &mut last, false);
                report(target.metrics(), &outcome, "file");
            }
            Some(()) = async {
                match hangups.as_mut() {
                    Some(signal) => signal.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                let outcome = reload(target.as_ref(), &current, &path, &mut last, true);
                report(target.metrics(), &outcome, "SIGHUP");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use notify::event::{
        AccessKind, AccessMode, CreateKind, DataChange, Flag, MetadataKind, ModifyKind, RemoveKind,
        RenameMode,
    };
    use notify::{Event, EventKind};

    use super::{is_change, needs_restart};
    use crate::config::Config;

    #[test]
    fn a_change_of_tracing_needs_a_restart() {
        let current = Config::default();
        let mut next = current.clone();
        assert!(needs_restart(&current, &next).is_empty());
        next.tracing.otlp.endpoint = "http://otel-collector:4318".into();
        assert_eq!(needs_restart(&current, &next), vec!["tracing"]);
    }

    #[test]
    fn reads_are_not_changes() {
        let reads = [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Read),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
            EventKind::Modify(ModifyKind::Metadata(MetadataKind::AccessTime)),
            EventKind::Other,
        ];
        for kind in reads {
            assert!(!is_change(&Event::new(kind)), "{kind:?}");
        }
        let changes = [
            EventKind::Create(CreateKind::File),
            EventKind::Modify(ModifyKind::Data(DataChange::Any)),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            EventKind::Remove(RemoveKind::File),
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
        ];
        for kind in changes {
            assert!(is_change(&Event::new(kind)), "{kind:?}");
        }
        assert!(is_change(
            &Event::new(EventKind::Other).set_flag(Flag::Rescan)
        ));
    }
}
