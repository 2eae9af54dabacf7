//! The engine's paged KV cache: [`crate::worker::pool::BlockPool`] (reference counts, prefix
//! cache map, LRU of idle cached pages) plus the vLLM-format KV events its changes publish.
//!
//! # Algorithm
//! vLLM v1's `KVCacheManager` over its `BlockPool`: a request references the cached pages of
//! its longest cached prefix, takes fresh pages from the head of the free queue (evicting
//! what they cached: a `BlockRemoved`), and each page that becomes a full block is cached
//! under its engine hash (a `BlockStored`, chained onto the previous block's hash). Pages
//! are released in reverse order so a sequence's tail is evicted before its head.
//!
//! One deliberate difference: when a page fills with a block some other page already
//! caches (two requests computed the same prefix concurrently), vLLM keeps both copies and
//! publishes the store twice; here the request switches to the cached copy and frees its
//! own page, so each engine hash names one page and is stored once while cached.
//!
//! # Invariants
//! 1. The cached set is prefix-closed: a request references every cached block of its
//!    chain, and releases a child before its parent, so a parent is never evicted before
//!    its cached children.
//! 2. The events, in order, describe exactly the changes of the cached set: replayed into a
//!    [`engine::kv_index::KvIndex`] they are never refused and rebuild this cache.
//! 3. A refused allocation changes nothing and publishes nothing.

use engine::EngineHash;
use wire::kv_events::WireEvent;

use crate::worker::hashing::engine_hash;
use crate::worker::pool::{BlockId, BlockPool};

/// The medium of every event: the simulated cache is GPU memory.
const GPU: &str = "GPU";

/// The pages of one engine and its pending KV events.
#[derive(Debug)]
pub(super) struct KvCache {
    pool: BlockPool,
    block_size: u32,
    events: Vec<WireEvent>,
    /// Blocks stored and evicted so far.
    pub(super) stored: u64,
    pub(super) evicted: u64,
}

impl KvCache {
    /// An empty cache of `kv_blocks` pages of `block_size` tokens.
    pub(super) fn new(kv_blocks: u32, block_size: u32) -> Self {
        Self {
            pool: BlockPool::new(kv_blocks),
            block_size,
            events: Vec::new(),
            stored: 0,
            evicted: 0,
        }
    }

    /// Pages in the cache.
    pub(super) fn capacity(&self) -> u32 {
        self.pool.capacity()
    }

    /// Pages no request references (allocatable, possibly by evicting).
    pub(super) fn free_len(&self) -> u32 {
        self.pool.free_len()
    }

    /// Pages referenced by requests.
    pub(super) fn referenced(&self) -> u32 {
        self.pool.capacity() - self.pool.free_len()
    }

    /// Pages caching a full block.
    pub(super) fn cached_len(&self) -> usize {
        self.pool.cached_len()
    }

    /// The pages caching the longest cached prefix of the chain `hashes`.
    pub(super) fn prefix_hits(&self, hashes: &[EngineHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|&h| self.pool.lookup(h)).collect()
    }

    /// How many leading full blocks of `tokens` in the namespace `seed` are cached.
    pub(super) fn cached_prefix(&self, tokens: &[u32], seed: u64) -> u32 {
        self.cached_prefix_pages(tokens, seed).len() as u32
    }

    /// The pages caching the leading cached full blocks of `tokens` in the namespace `seed`.
    pub(super) fn cached_prefix_pages(&self, tokens: &[u32], seed: u64) -> Vec<BlockId> {
        let mut buf = Vec::new();
        let mut parent = None;
        let mut pages = Vec::new();
        for block in tokens.chunks_exact(self.block_size as usize) {
            let h = engine_hash(&mut buf, parent, seed, block);
            let Some(page) = self.pool.lookup(h) else {
                break;
            };
            pages.push(page);
            parent = Some(h);
        }
        pages
    }

    /// Free pages left once `hits` are referenced (idle hits leave the free queue).
    pub(super) fn free_after_touch(&self, hits: &[BlockId]) -> u32 {
        let idle = hits.iter().filter(|&&b| self.pool.is_idle(b)).count() as u32;
        self.pool.free_len().saturating_sub(idle)
    }

    /// References each of `hits` once more.
    pub(super) fn touch(&mut self, hits: &[BlockId]) {
        for &b in hits {
            self.pool.touch(b);
        }
    }

    /// Takes `n` fresh pages, least recently used first, publishing what they evict; or
    /// `None`, changing nothing, if fewer than `n` are free.
    pub(super) fn allocate(&mut self, n: u32) -> Option<Vec<BlockId>> {
        if self.pool.free_len() < n {
            return None;
        }
        let mut pages = Vec::with_capacity(n as usize);
        let mut removed = Vec::new();
        for _ in 0..n {
            let (b, evicted) = self.pool.allocate()?;
            pages.push(b);
            removed.extend(evicted.map(|h| h.0));
        }
        self.evicted += removed.len() as u64;
        if !removed.is_empty() {
            match self.events.last_mut() {
                Some(WireEvent::Removed { block_hashes, .. }) => block_hashes.extend(removed),
                _ => self.events.push(WireEvent::Removed {
                    block_hashes: removed,
                    medium: Some(GPU.to_owned()),
                }),
            }
        }
        Some(pages)
    }

    /// Caches the full block `hash` (whose tokens are `tokens`, whose parent block is
    /// `parent`) held in the request's page `*page`. If another page already caches it, the
    /// request switches to that page and frees its own (see the module docs).
    pub(super) fn commit(
        &mut self,
        page: &mut BlockId,
        hash: EngineHash,
        parent: Option<EngineHash>,
        tokens: &[u32],
        lora_name: Option<&str>,
    ) {
        match self.pool.lookup(hash) {
            Some(cached) if cached == *page => {}
            Some(cached) => {
                self.pool.touch(cached);
                self.pool.release(*page);
                *page = cached;
            }
            None => {
                self.pool.cache(*page, hash);
                self.stored += 1;
                self.publish_stored(hash, parent, tokens, lora_name);
            }
        }
    }

    /// Appends a store, extending the previous one when it ends with `parent` (one event
    /// per chain, as vLLM publishes).
    fn publish_stored(
        &mut self,
        hash: EngineHash,
        parent: Option<EngineHash>,
        tokens: &[u32],
        lora: Option<&str>,
    ) {
        if let Some(WireEvent::Stored {
            block_hashes,
            token_ids,
            lora_name,
            ..
        }) = self.events.last_mut()
            && parent.is_some()
            && block_hashes.last().copied() == parent.map(|p| p.0)
            && lora_name.as_deref() == lora
        {
            block_hashes.push(hash.0);
            token_ids.extend_from_slice(tokens);
            return;
        }
        self.events.push(WireEvent::Stored {
            block_hashes: vec![hash.0],
            parent: parent.map(|p| p.0),
            token_ids: tokens.to_vec(),
            block_size: Some(self.block_size),
            lora_id: None,
            lora_name: lora.map(str::to_owned),
            medium: Some(GPU.to_owned()),
            extra_keys: None,
        });
    }

    /// Drops the references of `pages`, last page first (their cached blocks stay cached).
    pub(super) fn release(&mut self, pages: &[BlockId]) {
        for &b in pages.iter().rev() {
            self.pool.release(b);
        }
    }

    /// Forgets every cached block, publishing `Cleared`, if no page is referenced (vLLM's
    /// `reset_prefix_cache`). Returns whether it did.
    pub(super) fn reset(&mut self) -> bool {
        if self.referenced() != 0 {
            return false;
        }
        self.pool = BlockPool::new(self.pool.capacity());
        self.events.push(WireEvent::Cleared);
        true
    }

    /// Takes the events published since the last call, oldest first.
    pub(super) fn take_events(&mut self) -> Vec<WireEvent> {
        std::mem::take(&mut self.events)
    }

    /// Checks the pool's invariants (tests only).
    #[cfg(test)]
    pub(super) fn check_invariants(&self) {
        self.pool.check_invariants();
    }

    /// Every page's reference count (tests only).
    #[cfg(test)]
    pub(super) fn refs(&self) -> Vec<u32> {
        self.pool.refs()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::hash::lora_seed;

    fn chain(tokens: &[u32], bs: usize) -> Vec<EngineHash> {
        let mut buf = Vec::new();
        let mut parent = None;
        tokens
            .chunks_exact(bs)
            .map(|b| {
                let h = engine_hash(&mut buf, parent, lora_seed(None), b);
                parent = Some(h);
                h
            })
            .collect()
    }

    #[test]
    fn stores_chain_into_one_event_and_evictions_into_one() {
        let mut c = KvCache::new(3, 2);
        let tokens = [1, 2, 3, 4, 5, 6];
        let hs = chain(&tokens, 2);
        let mut pages = c.allocate(3).unwrap();
        for (i, page) in pages.iter_mut().enumerate() {
            let parent = i.checked_sub(1).map(|p| hs[p]);
            c.commit(page, hs[i], parent, &tokens[i * 2..i * 2 + 2], None);
        }
        let ev = c.take_events();
        assert_eq!(
            ev,
            vec![WireEvent::Stored {
                block_hashes: hs.iter().map(|h| h.0).collect(),
                parent: None,
                token_ids: tokens.to_vec(),
                block_size: Some(2),
                lora_id: None,
                lora_name: None,
                medium: Some("GPU".into()),
                extra_keys: None,
            }]
        );
        assert_eq!(c.cached_prefix(&tokens, lora_seed(None)), 3);
        assert!(c.allocate(1).is_none(), "all referenced");
        assert!(
            c.take_events().is_empty(),
            "a refused allocation publishes nothing"
        );
        c.release(&pages);
        // The tail is evicted first.
        c.allocate(2).unwrap();
        assert_eq!(
            c.take_events(),
            vec![WireEvent::Removed {
                block_hashes: vec![hs[2].0, hs[1].0],
                medium: Some("GPU".into()),
            }]
        );
        assert_eq!(c.cached_prefix(&tokens, lora_seed(None)), 1);
        c.check_invariants();
    }

    #[test]
    fn a_duplicate_block_switches_to_the_cached_page() {
        let mut c = KvCache::new(4, 2);
        let tokens = [7, 8];
        let h = chain(&tokens, 2)[0];
        let mut a = c.allocate(1).unwrap();
        c.commit(&mut a[0], h, None, &tokens, None);
        let mut b = c.allocate(1).unwrap();
        let own = b[0];
        c.commit(&mut b[0], h, None, &tokens, None);
        assert_eq!(b[0], a[0]);
        assert_ne!(own, a[0]);
        assert_eq!(c.referenced(), 1, "the duplicate page was freed");
        assert_eq!(c.take_events().len(), 1, "stored once");
        assert_eq!(c.refs()[a[0].index()], 2);
        assert_eq!(c.free_after_touch(&a), 3);
        c.release(&a);
        c.release(&b);
        assert_eq!(
            c.free_after_touch(&a),
            3,
            "an idle hit leaves the free queue"
        );
        assert!(c.reset());
        assert_eq!(c.take_events(), vec![WireEvent::Cleared]);
        assert_eq!(c.cached_len(), 0);
        c.check_invariants();
    }
}
