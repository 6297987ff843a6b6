//! What a node's own metrics last said of its load (see `signals` for the reading), and tongs'
//! estimate of that load now: the reading, plus what tongs sent the node since, less what ended.
//!
//! A reading is only used while it is younger than `signals.max_age`; older, or none, the node has no
//! signals and the pick goes by tongs' own counts alone. A stale reading can therefore never make a
//! node look idle or saturated.
//!
//! Between readings the estimate moves with tongs' own requests: a reading taken while tongs held `o`
//! requests there, now `n`, counts `n − o` more in the node (negative: fewer). Once the node has been
//! seen full (requests waiting beside a running batch), its batch is known, and the estimate's excess
//! over the batch is what waits; before that, only a queue the reading saw can grow.
//!
//! A wedged engine's page still answers, with the values it had when it stopped. So a reading whose
//! work counters ([`EngineLoad::progress`]) have not moved since the one before, while the node says
//! it runs requests or tongs held requests there at both readings, is *frozen*: not used, shown not
//! fresh, and taken by the stream watch as its node having stopped (see `proxy::stream`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::engine::{Engine, EngineLoad};

/// The last reading and when it was taken, packed for the pick to read without a lock.
#[derive(Debug, Default)]
pub struct EngineSignals {
    /// running (bits 0–23), waiting (24–47), cache use in 1/65534 plus one (48–63; 0: none said).
    packed: AtomicU64,
    /// When it was read, in the endpoint's milliseconds (0: never).
    read_at: AtomicU64,
    /// tongs' requests outstanding on the node when it was read.
    outstanding_then: AtomicU64,
    /// Most requests seen running while others waited: the node's batch (0: not seen full yet).
    batch: AtomicU32,
    /// How the last attempt to read went, for operators.
    status: Mutex<ReadStatus>,
    /// The work counters' sum at the last reading, as f64 bits ([`NO_PROGRESS`]: the page has none).
    progress: AtomicU64,
    /// The last reading's counters had not moved since the one before while requests ran there.
    frozen: AtomicBool,
}

/// No work counters on the page.
const NO_PROGRESS: u64 = u64::MAX;

/// How the last attempt to read a node's metrics went.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ReadStatus {
    /// Not asked yet, or signals are off.
    #[default]
    Unread,
    /// Read, with this engine's names.
    Read(Engine),
    /// The node serves no such metrics (asked again after `signals.absent_retry`).
    Absent(String),
    /// The read failed (a timeout, a connection error); the last reading ages out.
    Failed(String),
}

impl ReadStatus {
    pub fn as_str(&self) -> &'static str {
        match self {
            ReadStatus::Unread => "unread",
            ReadStatus::Read(_) => "read",
            ReadStatus::Absent(_) => "absent",
            ReadStatus::Failed(_) => "failed",
        }
    }
}

/// The node's load as tongs estimates it now, from a reading young enough to use.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineNow {
    /// Requests in the node, running or waiting.
    pub in_node: u64,
    /// Of those, waiting in its own queue.
    pub waiting: u64,
    /// Its batch as learned (0: not seen full yet).
    pub batch: u64,
    /// Share of its KV cache in use, when it says.
    pub cache: Option<f64>,
    /// Age of the reading, milliseconds.
    pub age_ms: u64,
}

const COUNT_MAX: u64 = (1 << 24) - 1;

impl EngineSignals {
    /// Keeps a reading taken at `now_ms`, while tongs held `outstanding` requests on the node.
    pub fn record(&self, engine: Engine, load: EngineLoad, outstanding: u64, now_ms: u64) {
        let running = u64::from(load.running).min(COUNT_MAX);
        let waiting = u64::from(load.waiting).min(COUNT_MAX);
        let cache = load
            .cache
            .map_or(0, |c| (c.clamp(0.0, 1.0) * 65534.0).round() as u64 + 1);
        if waiting > 0 && running > 0 {
            self.batch.fetch_max(
                u32::try_from(running).unwrap_or(u32::MAX),
                Ordering::Relaxed,
            );
        }
        let progress = load.progress.map_or(NO_PROGRESS, f64::to_bits);
        let before = self.progress.swap(progress, Ordering::Relaxed);
        let held_before = self.outstanding_then.load(Ordering::Relaxed);
        let busy = running > 0 || (held_before > 0 && outstanding > 0);
        let frozen = progress != NO_PROGRESS
            && before == progress
            && self.read_at.load(Ordering::Relaxed) != 0
            && busy;
        self.frozen.store(frozen, Ordering::Relaxed);
        self.packed
            .store(running | (waiting << 24) | (cache << 48), Ordering::Relaxed);
        self.outstanding_then.store(outstanding, Ordering::Relaxed);
        self.read_at.store(now_ms.max(1), Ordering::Relaxed);
        self.set_status(ReadStatus::Read(engine));
    }

    /// The reading no longer stands (the node went away, or says it has no metrics now).
    pub fn forget(&self) {
        self.read_at.store(0, Ordering::Relaxed);
        self.frozen.store(false, Ordering::Relaxed);
        self.progress.store(NO_PROGRESS, Ordering::Relaxed);
    }

    /// The last reading is frozen: the engine did no work between two readings while it had
    /// requests. Stands until a reading shows work again (or the reading is forgotten).
    pub fn frozen(&self) -> bool {
        self.frozen.load(Ordering::Relaxed)
    }

    pub fn set_status(&self, status: ReadStatus) {
        let mut current = self
            .status
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if *current != status {
            *current = status;
        }
    }

    pub fn status(&self) -> ReadStatus {
        self.status
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// The load now, when a reading younger than `max_age_ms` stands; tongs holds `outstanding`
    /// requests on the node now.
    /// A frozen reading is none.
    #[inline]
    pub fn now(&self, now_ms: u64, max_age_ms: u64, outstanding: u64) -> Option<EngineNow> {
        if self.frozen() {
            return None;
        }
        self.reading(now_ms, max_age_ms, outstanding)
    }

    /// [`EngineSignals::now`], frozen or not (for operators).
    #[inline]
    pub fn reading(&self, now_ms: u64, max_age_ms: u64, outstanding: u64) -> Option<EngineNow> {
        let read_at = self.read_at.load(Ordering::Relaxed);
        let age_ms = now_ms.saturating_sub(read_at);
        if read_at == 0 || max_age_ms == 0 || age_ms > max_age_ms {
            return None;
        }
        let packed = self.packed.load(Ordering::Relaxed);
        let running = packed & COUNT_MAX;
        let waiting_then = (packed >> 24) & COUNT_MAX;
        let cache = match packed >> 48 {
            0 => None,
            c => Some((c - 1) as f64 / 65534.0),
        };
        let then = self.outstanding_then.load(Ordering::Relaxed);
        let in_node = (running + waiting_then + outstanding).saturating_sub(then);
        let batch = u64::from(self.batch.load(Ordering::Relaxed));
        let waiting = if batch > 0 {
            in_node.saturating_sub(batch)
        } else if waiting_then > 0 {
            (waiting_then + outstanding).saturating_sub(then)
        } else {
            0
        };
        Some(EngineNow {
            in_node,
            waiting,
            batch,
            cache,
            age_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_whose_work_counters_stand_still_while_requests_run_is_frozen() {
        let signals = EngineSignals::default();
        let read = |running, progress: Option<f64>, held, at| {
            let load = EngineLoad {
                running,
                waiting: 0,
                cache: None,
                progress,
            };
            signals.record(Engine::Vllm, load, held, at);
        };
        read(4, Some(100.0), 4, 1000);
        assert!(!signals.frozen(), "one reading says nothing of progress");
        read(4, Some(180.0), 4, 2000);
        assert!(!signals.frozen());
        read(4, Some(180.0), 4, 3000);
        assert!(
            signals.frozen(),
            "running, and no work since the last reading"
        );
        assert_eq!(signals.now(3000, 5000, 4), None, "not used");
        assert!(signals.reading(3000, 5000, 4).is_some(), "still shown");
        read(4, Some(181.0), 4, 4000);
        assert!(!signals.frozen(), "working again");
        // Idle: nothing runs, nothing moves, nothing is wrong.
        read(0, Some(181.0), 0, 5000);
        read(0, Some(181.0), 0, 6000);
        assert!(!signals.frozen());
        // tongs held a request at both readings the node does not even show: stopped before it.
        read(0, Some(181.0), 1, 7000);
        read(0, Some(181.0), 1, 8000);
        assert!(signals.frozen());
        // A page without work counters is never judged.
        read(4, None, 4, 9000);
        read(4, None, 4, 10_000);
        assert!(!signals.frozen());
    }

    fn load(running: u32, waiting: u32, cache: Option<f64>) -> EngineLoad {
        EngineLoad {
            running,
            waiting,
            cache,
            progress: None,
        }
    }

    #[test]
    fn a_reading_stands_until_it_is_too_old() {
        let signals = EngineSignals::default();
        assert_eq!(signals.now(1000, 3000, 0), None);
        signals.record(Engine::Vllm, load(3, 0, Some(0.25)), 0, 1000);
        let now = signals.now(2000, 3000, 0).unwrap();
        assert_eq!((now.in_node, now.waiting, now.age_ms), (3, 0, 1000));
        assert!((now.cache.unwrap() - 0.25).abs() < 1e-4);
        assert!(signals.now(4000, 3000, 0).is_some());
        assert_eq!(
            signals.now(4001, 3000, 0),
            None,
            "stale: tongs' own counts only"
        );
        assert_eq!(signals.now(2000, 0, 0), None, "signals off");
        signals.forget();
        assert_eq!(signals.now(2000, 3000, 0), None);
    }

    #[test]
    fn the_estimate_follows_what_tongs_sent_and_what_ended_since() {
        let signals = EngineSignals::default();
        // Running 8 with 2 waiting: the batch is 8. tongs held 3 of those 10.
        signals.record(Engine::Vllm, load(8, 2, None), 3, 10);
        let now = signals.now(20, 1000, 3).unwrap();
        assert_eq!((now.in_node, now.waiting, now.batch), (10, 2, 8));
        // tongs sent 4 more: they wait.
        let now = signals.now(20, 1000, 7).unwrap();
        assert_eq!((now.in_node, now.waiting), (14, 6));
        // All of tongs' ended: what others sent is still there.
        let now = signals.now(20, 1000, 0).unwrap();
        assert_eq!((now.in_node, now.waiting), (7, 0));
        // A later reading below the batch does not forget the batch.
        signals.record(Engine::Vllm, load(5, 0, None), 0, 30);
        let now = signals.now(40, 1000, 6).unwrap();
        assert_eq!((now.in_node, now.waiting, now.batch), (11, 3, 8));
    }

    #[test]
    fn before_the_batch_is_known_only_a_queue_seen_grows() {
        let signals = EngineSignals::default();
        signals.record(Engine::Tgi, load(2, 0, None), 0, 10);
        assert_eq!(signals.now(20, 1000, 5).unwrap().waiting, 0);
        signals.record(Engine::Tgi, load(0, 3, None), 1, 30);
        assert_eq!(signals.now(40, 1000, 3).unwrap().waiting, 5);
        assert_eq!(signals.status(), ReadStatus::Read(Engine::Tgi));
    }
}
