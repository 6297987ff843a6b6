//! Where a request would rather go: the nodes that hold its prompt's prefix in cache, and the home of
//! its conversation and of its session.
//!
//! **The prefix index** ([`PrefixIndex`], one per pool) remembers, for each prompt block hash tongs has
//! routed (see `openai::prefix`), the last few nodes it went to, with the node's cache epoch then (the
//! count of its unhealthy verdicts: a node declared down is taken to have lost its GPU's cache, so a node
//! that restarts starts with none). It is an LRU bounded by `balancer.affinity.index_blocks`. A request's
//! match on a node is the share of its blocks, from the first, that the node was sent.
//!
//! **Homes** are computed, not remembered, so every tongs replica finds the same one without sharing
//! anything: among the nodes that may take the request (eligible, admitted by the pipeline's filters,
//! saturation among them), the one ranked first by weighted rendezvous hashing (highest random weight:
//! each node's score is `−weight ÷ ln(u)`, `u` a uniform draw from the hash of the key and the node's
//! URL). A node that leaves moves only the keys it was home to, each to its next-ranked node, so a
//! conversation whose node is interrupted moves as a whole to one node (its next turns; a broken
//! stream's continuation is placed without its home, by load: see `proxy::continuation`); a node
//! that joins becomes home to its share of keys. The conversation key comes from the prompt; the
//! session key from `balancer.affinity.session_header` or the OpenAI `user` field.

use std::sync::Mutex;

use lru::LruCache;

use crate::endpoint::{Endpoint, EndpointId};
use crate::openai::prefix::PromptKeys;

/// Nodes remembered per block.
const HOLDERS: usize = 4;

/// What a request carries into the pick to be placed by affinity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestKeys {
    /// The prompt's block hashes and conversation key (empty when the body is no prompt).
    pub prompt: PromptKeys,
    /// The session key, from the session header or the `user` field.
    pub session: Option<u64>,
}

impl RequestKeys {
    pub fn is_empty(&self) -> bool {
        self.prompt.blocks.is_empty()
            && self.prompt.conversation.is_none()
            && self.session.is_none()
    }
}

/// The nodes a block was last sent to, with their cache epochs then.
#[derive(Clone, Copy, Debug, Default)]
struct Holders {
    ids: [(EndpointId, u64); HOLDERS],
    len: u8,
}

impl Holders {
    fn holds(&self, id: EndpointId, epoch: u64) -> bool {
        self.ids[..usize::from(self.len)]
            .iter()
            .any(|&(held, at)| held == id && at == epoch)
    }

    /// Adds the node, first; the one sent to least recently drops out when full.
    fn add(&mut self, id: EndpointId, epoch: u64) {
        let len = usize::from(self.len);
        let at = self.ids[..len]
            .iter()
            .position(|&(held, _)| held == id)
            .unwrap_or(len.min(HOLDERS - 1));
        self.ids.copy_within(0..at, 1);
        self.ids[0] = (id, epoch);
        self.len = self.len.max(u8::try_from(at + 1).unwrap_or(u8::MAX));
    }
}

/// A pool's record of which prompt blocks went to which nodes.
#[derive(Debug)]
pub struct PrefixIndex {
    blocks: Mutex<Bounded>,
}

/// The blocks by recency, and how many may be kept. Bounded here rather than by `LruCache::new`, which
/// reserves its whole capacity at once: an index grows only as prompts come.
#[derive(Debug)]
struct Bounded {
    blocks: LruCache<u64, Holders>,
    capacity: usize,
}

impl Bounded {
    fn trim(&mut self) {
        while self.blocks.len() > self.capacity {
            self.blocks.pop_lru();
        }
    }
}

/// A node's match for a request: the share of the request's blocks it was sent, from the first, in
/// the cache epoch it was sent them in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Match {
    pub endpoint: EndpointId,
    pub epoch: u64,
    pub share: f64,
}

impl PrefixIndex {
    /// An index of at most `capacity` blocks (at least one).
    pub fn new(capacity: usize) -> PrefixIndex {
        PrefixIndex {
            blocks: Mutex::new(Bounded {
                blocks: LruCache::unbounded(),
                capacity: capacity.max(1),
            }),
        }
    }

    /// Keeps at most `capacity` blocks from now on (the least recently used go first).
    pub fn resize(&self, capacity: usize) {
        let mut index = self.lock();
        index.capacity = capacity.max(1);
        index.trim();
    }

    pub fn capacity(&self) -> usize {
        self.lock().capacity
    }

    pub fn len(&self) -> usize {
        self.lock().blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Bounded> {
        self.blocks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records that `blocks` were sent to `endpoint` (each block becomes the most recently used).
    pub fn record(&self, blocks: &[u64], endpoint: &Endpoint) {
        if blocks.is_empty() {
            return;
        }
        let epoch = endpoint.cache_epoch();
        let mut index = self.lock();
        for &block in blocks {
            match index.blocks.get_mut(&block) {
                Some(holders) => holders.add(endpoint.id(), epoch),
                None => {
                    let mut holders = Holders::default();
                    holders.add(endpoint.id(), epoch);
                    index.blocks.push(block, holders);
                }
            }
        }
        index.trim();
    }

    /// The nodes that were sent a prefix of `blocks`, each with its share (at most [`HOLDERS`] nodes:
    /// those that hold the first block). A match counts only for a node still in the cache epoch it
    /// was sent in ([`Matches::share`]).
    pub fn matches(&self, blocks: &[u64]) -> Matches {
        let mut found = Matches::default();
        let Some(&first) = blocks.first() else {
            return found;
        };
        let index = self.lock();
        let Some(holders) = index.blocks.peek(&first) else {
            return found;
        };
        // Each holder of the first block, followed down the blocks.
        for &(id, epoch) in &holders.ids[..usize::from(holders.len)] {
            let held = blocks
                .iter()
                .take_while(|block| index.blocks.peek(block).is_some_and(|h| h.holds(id, epoch)))
                .count();
            found.push(Match {
                endpoint: id,
                epoch,
                share: held as f64 / blocks.len() as f64,
            });
        }
        found
    }
}

/// A request's matches, without allocating.
#[derive(Clone, Copy, Debug, Default)]
pub struct Matches {
    found: [Option<Match>; HOLDERS],
}

impl Matches {
    fn push(&mut self, found: Match) {
        if let Some(free) = self.found.iter_mut().find(|slot| slot.is_none()) {
            *free = Some(found);
        }
    }

    /// The share of the request's blocks `endpoint` was sent and still holds (0 when none, or when
    /// it was declared down since: its cache went with it).
    #[inline]
    pub fn share(&self, endpoint: &Endpoint) -> f64 {
        self.found
            .iter()
            .flatten()
            .find(|m| m.endpoint == endpoint.id() && m.epoch == endpoint.cache_epoch())
            .map_or(0.0, |m| m.share)
    }

    pub fn best(&self) -> Option<Match> {
        self.found
            .iter()
            .flatten()
            .copied()
            .max_by(|a, b| a.share.total_cmp(&b.share))
    }
}

/// Where one pick would rather place its request.
#[derive(Clone, Copy, Debug, Default)]
pub struct Affinity {
    pub matches: Matches,
    /// The share of the prompt its opening is (what other conversations may share).
    pub opening_share: f64,
    /// The conversation's home among the nodes that may take it.
    pub conversation_home: Option<EndpointId>,
    /// The session's home among the nodes that may take it.
    pub session_home: Option<EndpointId>,
}

/// A node's rendezvous score for `key`: higher ranks first. Weighted (the logarithmic method of
/// Schindelhauer and Schomaker, `−weight ÷ ln(u)`, compared here as the equivalent `u^(1/weight)`, which
/// needs no logarithm at weight 1), so a node of weight 2 is first for twice the keys of a node of
/// weight 1; `u` is a uniform draw in (0, 1) from the key and the node's URL.
#[inline]
pub fn rendezvous(key: u64, endpoint: &Endpoint) -> f64 {
    let mixed = mix(key ^ endpoint.address().identity());
    let unit = ((mixed >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    match endpoint.weight() {
        1 => unit,
        weight => unit.powf(1.0 / f64::from(weight)),
    }
}

/// SplitMix64's finaliser: every bit of the input moves every bit of the output.
#[inline]
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::tests::endpoint;

    use std::sync::Arc;

    fn fleet(n: u64) -> Vec<Arc<Endpoint>> {
        (0..n).map(|id| Arc::new(endpoint(id))).collect()
    }

    #[test]
    fn a_match_is_the_share_of_leading_blocks_a_node_was_sent() {
        let endpoints = fleet(3);
        let index = PrefixIndex::new(100);
        index.record(&[1, 2, 3, 4], &endpoints[0]);
        index.record(&[1, 2, 9], &endpoints[1]);
        let found = index.matches(&[1, 2, 3, 4]);
        assert_eq!(found.share(&endpoints[0]), 1.0);
        assert_eq!(found.share(&endpoints[1]), 0.5);
        assert_eq!(found.share(&endpoints[2]), 0.0);
        assert_eq!(found.best().unwrap().endpoint, 0);
        // A prompt that starts elsewhere matches nothing.
        assert!(index.matches(&[7, 2, 3]).best().is_none());
    }

    #[test]
    fn a_node_declared_down_forgets_what_it_held() {
        let endpoints = fleet(2);
        let index = PrefixIndex::new(100);
        index.record(&[1, 2], &endpoints[0]);
        let now = tokio::time::Instant::now();
        endpoints[0].set_healthy(false, now);
        endpoints[0].set_healthy(true, now);
        assert_eq!(index.matches(&[1, 2]).share(&endpoints[0]), 0.0);
        // Sent again after it came back: it holds the prompt again.
        index.record(&[1, 2], &endpoints[0]);
        assert_eq!(index.matches(&[1, 2]).share(&endpoints[0]), 1.0);
        assert_eq!(index.matches(&[1, 2]).share(&endpoints[1]), 0.0);
    }

    #[test]
    fn the_index_keeps_to_its_budget_and_the_most_recent_nodes() {
        let endpoints = fleet(6);
        let index = PrefixIndex::new(3);
        index.record(&[1, 2, 3, 4, 5], &endpoints[0]);
        assert_eq!(index.len(), 3);
        // The oldest blocks went first: the prompt's start is no longer known.
        assert_eq!(index.matches(&[1, 2, 3, 4, 5]).share(&endpoints[0]), 0.0);
        let index = PrefixIndex::new(10);
        for endpoint in &endpoints {
            index.record(&[1], endpoint);
        }
        let found = index.matches(&[1]);
        assert_eq!(
            found.share(&endpoints[0]),
            0.0,
            "the least recent of five dropped out"
        );
        assert_eq!(found.share(&endpoints[1]), 0.0);
        assert_eq!(found.share(&endpoints[5]), 1.0);
    }

    #[test]
    fn rendezvous_homes_are_spread_by_weight_and_move_only_with_their_node() {
        let endpoints = fleet(5);
        let home = |key: u64, among: &[Arc<Endpoint>]| {
            among
                .iter()
                .max_by(|a, b| rendezvous(key, a).total_cmp(&rendezvous(key, b)))
                .unwrap()
                .id()
        };
        let mut counts = [0u32; 5];
        let keys: Vec<u64> = (0..5000u64).map(|k| mix(k + 1)).collect();
        for &key in &keys {
            counts[home(key, &endpoints) as usize] += 1;
        }
        for count in counts {
            assert!((800..1200).contains(&count), "{counts:?}");
        }
        // Node 2 leaves: only its keys move.
        let without: Vec<_> = endpoints.iter().filter(|e| e.id() != 2).cloned().collect();
        for &key in &keys {
            let before = home(key, &endpoints);
            if before != 2 {
                assert_eq!(home(key, &without), before);
            }
        }
    }

    #[test]
    fn holders_keep_the_most_recent_first() {
        let mut holders = Holders::default();
        for id in [1, 2, 3, 4, 5, 3] {
            holders.add(id, 0);
        }
        let ids: Vec<_> = holders.ids[..usize::from(holders.len)]
            .iter()
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(ids, [3, 5, 4, 2]);
    }
}
