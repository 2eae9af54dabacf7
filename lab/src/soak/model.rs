//! One simulated worker's cache rebuilt from the KV events it published: engine hash ->
//! (parent, the block's tokens, copies), so that a checkpoint can enumerate every cached
//! chain (its leaves) as token ids and ask the router about each.
//!
//! The model is only the enumeration: the truth a checkpoint compares the router with is
//! the simulated engine's own cache (`SimEngine::cached_prefix_blocks`); the checkpoint
//! checks that the two agree (a harness self-check, `model_mismatches` in the report).
//!
//! Each block also records the number (seq) of the batch that stored it and its seq_hash
//! (the router's name for it), so a block the router misses can be traced to the batches
//! its chain came from ([`CacheModel::chain_received`]).
//!
//! # Invariants
//! 1. After applying every batch a [`sim::engine::SimEngine`] produced, in order, the model
//!    holds exactly the engine's cached blocks (the engine's events describe its cache:
//!    `sim::engine` invariant 5), each with its parent, tokens, seq_hash and storing batch.
//! 2. A held block's parent is held (the engine's cache is prefix-closed and evicts a
//!    child before its parent), so [`CacheModel::path`] of a held block is its whole chain.
//! 3. A sample of at most `cap` chains of removed blocks is kept until taken
//!    ([`CacheModel::take_removed`]); reservoir sampling keeps it uniform over the removals.
//!
//! # Concurrency
//! None: shared by one worker's driver (which applies its batches) and the harness, under
//! a mutex ([`super::worker`]).

use engine::SeqHash;
use engine::hash::{BASE_SEED, seq_hash, tokens_hash};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use wire::kv_events::{WireBatch, WireEvent};

#[derive(Clone, Debug)]
struct Block {
    parent: Option<u64>,
    tokens: Box<[u32]>,
    /// Held blocks whose parent this is.
    children: u32,
    /// The router's name for it (base model).
    seq_hash: u64,
    /// The publisher's number of the batch that stored it.
    seq: u64,
    /// Stores not yet removed (the simulated engine stores each hash once while cached).
    copies: u32,
}

/// See the module docs.
#[derive(Debug)]
pub struct CacheModel {
    block_size: usize,
    blocks: HashMap<u64, Block>,
    /// seq_hash -> engine hash.
    by_seq_hash: HashMap<u64, u64>,
    removed: Vec<Vec<u32>>,
    removed_seen: u64,
    cap: usize,
    rng: SmallRng,
    /// Events that did not fit the model (a store under an unknown parent, a removal of an
    /// unknown block): a harness inconsistency when not zero.
    pub inconsistencies: u64,
}

impl CacheModel {
    /// An empty cache of blocks of `block_size` tokens, sampling up to `cap` removed chains.
    pub fn new(block_size: u32, cap: usize, seed: u64) -> Self {
        Self {
            block_size: block_size.max(1) as usize,
            blocks: HashMap::new(),
            by_seq_hash: HashMap::new(),
            removed: Vec::new(),
            removed_seen: 0,
            cap,
            rng: SmallRng::seed_from_u64(seed),
            inconsistencies: 0,
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Forgets everything (a restarted worker's cache is empty).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.by_seq_hash.clear();
    }

    /// Applies batch number `seq`.
    pub fn apply(&mut self, batch: &WireBatch, seq: u64) {
        for event in &batch.events {
            match event {
                WireEvent::Stored {
                    block_hashes,
                    parent,
                    token_ids,
                    ..
                } => self.store(*parent, block_hashes, token_ids, seq),
                WireEvent::Removed { block_hashes, .. } => {
                    for &h in block_hashes {
                        self.remove(h);
                    }
                }
                WireEvent::Cleared => self.clear(),
            }
        }
    }

    fn store(&mut self, parent: Option<u64>, hashes: &[u64], tokens: &[u32], seq: u64) {
        if parent.is_some_and(|p| !self.blocks.contains_key(&p))
            || tokens.len() != hashes.len() * self.block_size
        {
            self.inconsistencies += 1;
            return;
        }
        if parent.is_none() && self.holds_root_chain(hashes, tokens) {
            // A report of held blocks (vLLM's `kv_cache_report_mode: "full"`): no copy, as
            // the router's index does (docs/architecture.md, "The index").
            return;
        }
        let mut prev = parent;
        for (&h, chunk) in hashes.iter().zip(tokens.chunks_exact(self.block_size)) {
            let parent_seq = prev
                .and_then(|p| self.blocks.get(&p))
                .map(|b| SeqHash(b.seq_hash));
            let name = seq_hash(parent_seq, tokens_hash(chunk, BASE_SEED)).0;
            match self.blocks.get_mut(&h) {
                Some(b) => b.copies += 1,
                None => {
                    if let Some(p) = prev.and_then(|p| self.blocks.get_mut(&p)) {
                        p.children += 1;
                    }
                    self.by_seq_hash.insert(name, h);
                    self.blocks.insert(
                        h,
                        Block {
                            parent: prev,
                            tokens: chunk.into(),
                            children: 0,
                            seq_hash: name,
                            seq,
                            copies: 1,
                        },
                    );
                }
            }
            prev = Some(h);
        }
    }

    /// Every block of a chain from the root is held already, each under its hash at its
    /// place.
    fn holds_root_chain(&self, hashes: &[u64], tokens: &[u32]) -> bool {
        let mut prev = None;
        hashes
            .iter()
            .zip(tokens.chunks_exact(self.block_size))
            .all(|(h, chunk)| {
                let name = seq_hash(prev, tokens_hash(chunk, BASE_SEED));
                prev = Some(name);
                self.blocks.get(h).is_some_and(|b| b.seq_hash == name.0)
            })
    }

    fn remove(&mut self, h: u64) {
        let Some(b) = self.blocks.get_mut(&h) else {
            self.inconsistencies += 1;
            return;
        };
        b.copies -= 1;
        if b.copies > 0 {
            return;
        }
        self.sample_removed(h);
        if let Some(b) = self.blocks.remove(&h) {
            self.by_seq_hash.remove(&b.seq_hash);
            if let Some(p) = b.parent.and_then(|p| self.blocks.get_mut(&p)) {
                p.children = p.children.saturating_sub(1);
            }
        }
    }

    /// Reservoir sampling (Algorithm R) over the removed blocks since the last take.
    fn sample_removed(&mut self, h: u64) {
        self.removed_seen += 1;
        let slot = if self.removed.len() < self.cap {
            None
        } else {
            let j = self.rng.random_range(0..self.removed_seen);
            match usize::try_from(j) {
                Ok(j) if j < self.cap => Some(j),
                _ => return,
            }
        };
        let Some(path) = self.path(h) else {
            return;
        };
        match slot {
            None => self.removed.push(path),
            Some(j) => {
                if let Some(s) = self.removed.get_mut(j) {
                    *s = path;
                }
            }
        }
    }

    /// The token ids of `h`'s whole chain (root first), if it and its ancestors are held.
    pub fn path(&self, h: u64) -> Option<Vec<u32>> {
        let mut chain = Vec::new();
        let mut at = Some(h);
        while let Some(x) = at {
            let b = self.blocks.get(&x)?;
            chain.push(&b.tokens);
            at = b.parent;
            if chain.len() > self.blocks.len() {
                return None; // a cycle: cannot happen with engine hashes, but never loop.
            }
        }
        Some(chain.iter().rev().flat_map(|t| t.iter().copied()).collect())
    }

    /// The chains of every held block no held block continues: together they cover every
    /// held block.
    pub fn leaf_paths(&self) -> Vec<Vec<u32>> {
        self.blocks
            .iter()
            .filter(|(_, b)| b.children == 0)
            .filter_map(|(&h, _)| self.path(h))
            .collect()
    }

    /// For the held block named `seq_hash`: whether every block of its chain (it and its
    /// ancestors) was stored by a batch numbered `first_received` or later; `None` if no
    /// held block has that name.
    pub fn chain_received(&self, seq_hash: u64, first_received: u64) -> Option<bool> {
        let mut at = Some(*self.by_seq_hash.get(&seq_hash)?);
        let mut steps = 0;
        while let Some(h) = at {
            let b = self.blocks.get(&h)?;
            if b.seq < first_received {
                return Some(false);
            }
            at = b.parent;
            steps += 1;
            if steps > self.blocks.len() {
                break;
            }
        }
        Some(true)
    }

    /// The sampled chains of blocks removed since the last call.
    pub fn take_removed(&mut self) -> Vec<Vec<u32>> {
        self.removed_seen = 0;
        std::mem::take(&mut self.removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(parent: Option<u64>, hashes: &[u64], first_token: u32) -> WireEvent {
        WireEvent::Stored {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: (0..hashes.len() as u32 * 2)
                .map(|t| first_token + t)
                .collect(),
            block_size: Some(2),
            lora_id: None,
            lora_name: None,
            medium: None,
            extra_keys: None,
        }
    }

    fn batch(events: Vec<WireEvent>) -> WireBatch {
        WireBatch {
            ts: None,
            dp_rank: Some(0),
            events,
            unknown_events: 0,
        }
    }

    #[test]
    fn leaves_cover_the_chains_and_removals_are_sampled() {
        let mut m = CacheModel::new(2, 8, 1);
        m.apply(&batch(vec![stored(None, &[1, 2], 10)]), 0);
        m.apply(&batch(vec![stored(Some(1), &[3], 20)]), 1);
        assert_eq!(m.len(), 3);
        let mut leaves = m.leaf_paths();
        leaves.sort();
        assert_eq!(leaves, vec![vec![10, 11, 12, 13], vec![10, 11, 20, 21]]);
        let name = |tokens: &[u32]| {
            engine::hash::seq_hashes(tokens, 2, BASE_SEED)
                .last()
                .map(|s| s.0)
                .unwrap()
        };
        assert_eq!(m.chain_received(name(&[10, 11, 20, 21]), 1), Some(false));
        assert_eq!(m.chain_received(name(&[10, 11, 20, 21]), 0), Some(true));
        assert_eq!(m.chain_received(name(&[10, 11, 20, 22]), 0), None);
        m.apply(
            &batch(vec![WireEvent::Removed {
                block_hashes: vec![2],
                medium: None,
            }]),
            2,
        );
        assert_eq!(m.leaf_paths().len(), 1);
        assert_eq!(m.take_removed(), vec![vec![10, 11, 12, 13]]);
        assert!(m.take_removed().is_empty());
        m.apply(&batch(vec![stored(Some(99), &[4], 0)]), 3);
        assert_eq!(m.inconsistencies, 1);
        m.apply(&batch(vec![WireEvent::Cleared]), 4);
        assert!(m.is_empty());
    }
}
