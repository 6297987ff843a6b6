//! A simulated node's condition over time: set now, followed from its schedule of interruptions, and
//! announced ahead where an interruption gives notice (the node's heartbeat answers then carry
//! `x-tongs-drain` until it goes).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::node::{NodeShared, lock};
use super::schedule::{Condition, Interruption};

/// Puts the node into `condition`, counting an interruption when it is one.
pub(super) fn set_condition(shared: &NodeShared, condition: Condition) {
    let previous = shared.condition.send_replace(condition);
    if previous == condition {
        return;
    }
    if condition != Condition::Up {
        shared.interruptions.fetch_add(1, Ordering::Relaxed);
    }
    tracing::debug!(node = %shared.spec.name, from = previous.label(), to = condition.label(), "sim node condition");
}

/// Drives the node through `planned`, times counted from `started`, until `stop`.
pub(super) async fn follow_schedule(
    planned: Vec<Interruption>,
    started: Instant,
    shared: Arc<NodeShared>,
    stop: CancellationToken,
) {
    for interruption in planned {
        let begin = started + interruption.at.get();
        let end = begin + interruption.duration.get();
        let condition = Condition::Interrupted {
            kind: interruption.kind,
            factor: interruption.factor,
        };
        if let Some(notice) = interruption.notice {
            if !until(&stop, begin.checked_sub(notice.get()).unwrap_or(begin)).await {
                return;
            }
            *lock(&shared.leaving_at) = Some(begin);
        }
        if !until(&stop, begin).await {
            return;
        }
        goes(&shared, condition);
        if !until(&stop, end).await {
            return;
        }
        set_condition(&shared, Condition::Up);
    }
}

/// Sleeps until `at`; false when the node stops first.
pub(super) async fn until(stop: &CancellationToken, at: Instant) -> bool {
    tokio::select! {
        () = stop.cancelled() => false,
        () = tokio::time::sleep_until(at) => true,
    }
}

/// The node goes into `condition`, and no longer says it is going: it went.
pub(super) fn goes(shared: &NodeShared, condition: Condition) {
    *lock(&shared.leaving_at) = None;
    set_condition(shared, condition);
}
