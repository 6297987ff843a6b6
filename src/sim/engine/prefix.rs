//! The prefix cache of a simulated engine: a context cut into blocks of words, each block named by a
//! hash that chains the hash of the block before it (so a block names its whole prefix, as vLLM's
//! block hashes do), and an LRU of block hashes. Pure: no clock, no I/O.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// The hashes of the full blocks of `block_words` whitespace-separated words of `context`, in order;
/// the words after the last full block have none. Each hash covers its block's words and the hash of
/// the block before it, so two contexts share a block's hash only if they share every word up to its
/// end. Deterministic: the same context always gives the same hashes.
pub fn block_hashes(context: &str, block_words: usize) -> Vec<u64> {
    let block_words = block_words.max(1);
    let words: Vec<&str> = context.split_whitespace().collect();
    let mut previous = 0u64;
    words
        .chunks_exact(block_words)
        .map(|block| {
            let mut hasher = DefaultHasher::new();
            previous.hash(&mut hasher);
            for word in block {
                word.hash(&mut hasher);
            }
            previous = hasher.finish();
            previous
        })
        .collect()
}

/// An LRU of block hashes holding at most `capacity` blocks (none when it is 0).
#[derive(Clone, Debug, Default)]
pub struct PrefixCache {
    capacity: usize,
    /// Counts uses: a block's last use is its place in this count.
    clock: u64,
    /// Each block held and its last use.
    last_use: HashMap<u64, u64>,
    /// The blocks held by last use, oldest first.
    by_age: BTreeMap<u64, u64>,
}

impl PrefixCache {
    pub fn new(capacity: usize) -> PrefixCache {
        PrefixCache {
            capacity,
            ..PrefixCache::default()
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.last_use.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last_use.is_empty()
    }

    /// How many of the leading `blocks` the cache holds, up to the first it does not.
    pub fn matched(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|block| self.last_use.contains_key(block))
            .count()
    }

    /// Holds every one of `blocks` as just used, evicting the least recently used beyond the
    /// capacity. The blocks are used last to first, so the first is the most recent: a context
    /// longer than the cache keeps its beginning, and eviction takes a context's tail before its
    /// head, as vLLM frees a request's blocks.
    pub fn touch(&mut self, blocks: &[u64]) {
        if self.capacity == 0 {
            return;
        }
        for &block in blocks.iter().rev() {
            self.clock += 1;
            if let Some(before) = self.last_use.insert(block, self.clock) {
                self.by_age.remove(&before);
            }
            self.by_age.insert(self.clock, block);
            if self.last_use.len() > self.capacity
                && let Some((_, oldest)) = self.by_age.pop_first()
            {
                self.last_use.remove(&oldest);
            }
        }
    }

    /// A request's lookup when it gets its place in the batch: its leading blocks already held
    /// ([`PrefixCache::matched`]), then all its blocks held as just used ([`PrefixCache::touch`]).
    pub fn admit(&mut self, blocks: &[u64]) -> usize {
        let matched = self.matched(blocks);
        self.touch(blocks);
        matched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(words: std::ops::Range<u32>) -> String {
        words.map(|i| format!("w{i} ")).collect()
    }

    #[test]
    fn only_full_blocks_have_hashes_and_each_chains_the_one_before() {
        assert_eq!(block_hashes(&text(0..7), 4).len(), 1);
        assert_eq!(block_hashes(&text(0..8), 4).len(), 2);
        assert!(block_hashes("", 4).is_empty());
        assert!(block_hashes("a b c", 4).is_empty());
        // Whitespace does not matter, words do; the same text gives the same hashes.
        assert_eq!(
            block_hashes("a b  c\td\ne f g h", 4),
            block_hashes("a b c d e f g h", 4)
        );
        // The second block's words alone do not make its hash: it names everything before it.
        let ab = block_hashes("a b c d e f g h", 4);
        let xb = block_hashes("x b c d e f g h", 4);
        assert_ne!(ab[0], xb[0]);
        assert_ne!(ab[1], xb[1]);
        assert_ne!(ab[1], block_hashes("e f g h", 4)[0]);
        // A longer context shares the blocks of its prefix.
        let long = block_hashes(&text(0..20), 4);
        assert_eq!(&long[..2], &block_hashes(&text(0..9), 4)[..]);
        // Word boundaries count: "ab c" is not "a bc".
        assert_ne!(block_hashes("ab c", 2), block_hashes("a bc", 2));
    }

    #[test]
    fn a_lookup_counts_leading_blocks_up_to_the_first_miss() {
        let mut cache = PrefixCache::new(100);
        let first = block_hashes(&text(0..40), 4); // 10 blocks
        assert_eq!(cache.admit(&first), 0);
        assert_eq!(cache.len(), 10);
        assert_eq!(cache.admit(&first), 10);
        // The same 6 blocks, then new words: 6 matched, and the new blocks now held.
        let longer = block_hashes(&(text(0..24) + &text(100..116)), 4);
        assert_eq!(cache.admit(&longer), 6);
        assert_eq!(cache.matched(&longer), 10);
        assert_eq!(cache.len(), 14);
        // A different first word: nothing matches, though later words are the same.
        let other = block_hashes(&("z ".to_owned() + &text(1..40)), 4);
        assert_eq!(cache.matched(&other), 0);
        // A gap stops the count: block 0 held, block 1 not, block 2 held.
        let mut gap = PrefixCache::new(100);
        gap.touch(&[first[0], first[2]]);
        assert_eq!(gap.matched(&first), 1);
    }

    #[test]
    fn the_least_recently_used_blocks_go_first_tails_before_heads() {
        let mut cache = PrefixCache::new(4);
        let a = block_hashes(&text(0..12), 4); // 3 blocks
        let b = block_hashes(&text(50..62), 4); // 3 blocks
        cache.touch(&a);
        cache.touch(&b);
        assert_eq!(cache.len(), 4);
        // All of b, and a's head: a's tail went first.
        assert_eq!(cache.matched(&b), 3);
        assert_eq!(cache.matched(&a), 1);
        // Using a's head makes it the most recent: b's tail goes next.
        cache.touch(&a[..1]);
        cache.touch(&block_hashes(&text(90..94), 4));
        assert_eq!(cache.matched(&a), 1);
        assert_eq!(cache.matched(&b), 2);
        // A context longer than the cache keeps its beginning.
        let long = block_hashes(&text(200..240), 4); // 10 blocks
        cache.touch(&long);
        assert_eq!(cache.len(), 4);
        assert_eq!(cache.matched(&long), 4);
        // No capacity, no cache.
        let mut none = PrefixCache::new(0);
        assert_eq!(none.admit(&long), 0);
        assert_eq!(none.admit(&long), 0);
        assert!(none.is_empty());
    }
}
