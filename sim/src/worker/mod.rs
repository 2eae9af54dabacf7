//! A simulated GPU worker: one engine (one data-parallel rank) with a vLLM-like paged KV
//! cache, prefix caching, LRU eviction, and the KV events a real worker publishes.
//!
//! Serving a request:
//! 1. hash its full blocks with the worker's own engine hashes ([`hashing`]) and find the
//!    longest prefix whose blocks are all cached: the real prefix hit;
//! 2. reference those blocks, so nothing this request uses can be evicted under it;
//! 3. allocate one block per missing full block, in order, evicting the least recently used
//!    idle cached blocks; when fewer blocks are free than missing (a request larger than the
//!    cache, or a cache full of active requests) cache what fits from the start;
//! 4. queue the events a real worker would publish: one [`KvEvent::Removed`] listing every
//!    eviction, then one [`KvEvent::Stored`] chaining the new blocks onto the last hit block.
//!
//! The request holds its blocks until [`SimWorker::finish`], which releases them in reverse
//! order, as vLLM does, so a sequence's tail is evicted before its head.
//!
//! Only full prompt blocks are modelled: the trailing partial block and decode tokens take no
//! cache space here (the timing model of a later issue may add them).
//!
//! # Invariants
//! 1. The cached set is prefix-closed: a cached block's parent is cached. (A parent is
//!    referenced whenever its child is and released after it, so the free queue always puts
//!    the child first.) [`SimWorker::serve`] relies on it to stop at the first miss.
//! 2. Replaying every event from [`SimWorker::poll_events`] into an
//!    [`engine::kv_index::KvIndex`] under [`SimWorker::key`] makes the index's overlap for
//!    that key equal [`SimWorker::cached_prefix`] for every query, and is never refused.
//! 3. A block referenced by an active request is never evicted.
//! 4. A refused call (a request id used twice, an unknown one) changes nothing and queues no
//!    event.
//!
//! # Concurrency
//! None: a worker is owned by one thread and driven by calls.

pub mod hashing;
pub(crate) mod pool;

use engine::event::{KvEvent, StoredBlock};
use engine::hash::{lora_seed, tokens_hashes};
use engine::{EngineHash, RequestId, WorkerKey};
use hashbrown::HashMap;

use crate::error::{Result, SimError};
use hashing::engine_hash;
use pool::{BlockId, BlockPool};

/// The shape of one worker's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Blocks in the KV cache: `1..u32::MAX`.
    pub kv_blocks: u32,
    /// Tokens per block (the engine's page size): at least 1.
    pub block_size: u32,
}

impl WorkerConfig {
    /// Rejects a size outside its documented range.
    pub fn validate(&self) -> Result<()> {
        if self.kv_blocks == 0 || self.kv_blocks == u32::MAX {
            return Err(SimError::InvalidConfig {
                name: "kv_blocks",
                reason: "must be within 1..4294967295",
            });
        }
        if self.block_size == 0 {
            return Err(SimError::InvalidConfig {
                name: "block_size",
                reason: "must be positive",
            });
        }
        Ok(())
    }
}

/// What serving one request did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    /// Prompt tokens, the trailing partial block included.
    pub prompt_tokens: u64,
    /// Full blocks of the prompt.
    pub prompt_blocks: u32,
    /// Leading blocks served from the cache (the real prefix hit).
    pub hit_blocks: u32,
    /// Blocks computed and newly cached.
    pub stored_blocks: u32,
    /// Full blocks computed but not cached: no block was free for them.
    pub uncached_blocks: u32,
    /// Cached blocks evicted to make room.
    pub evicted_blocks: u32,
}

/// Counters and sizes of one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Requests served so far.
    pub requests: u64,
    /// Prompt tokens over those requests.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the cache.
    pub hit_tokens: u64,
    /// Blocks stored so far.
    pub stored_blocks: u64,
    /// Blocks evicted so far.
    pub evicted_blocks: u64,
    /// Requests holding blocks now.
    pub active_requests: usize,
    /// Blocks caching a full block now.
    pub cached_blocks: usize,
    /// Blocks referenced by active requests now.
    pub referenced_blocks: u32,
    /// Blocks in the cache.
    pub kv_blocks: u32,
}

/// One simulated engine. See the module docs.
#[derive(Debug)]
pub struct SimWorker {
    key: WorkerKey,
    config: WorkerConfig,
    pool: BlockPool,
    requests: HashMap<RequestId, Box<[BlockId]>>,
    outbox: Vec<KvEvent>,
    buf: Vec<u8>,
    stats: WorkerStats,
}

impl SimWorker {
    /// An idle worker with an empty cache, publishing as `key`.
    pub fn new(key: WorkerKey, config: WorkerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            key,
            config,
            pool: BlockPool::new(config.kv_blocks),
            requests: HashMap::new(),
            outbox: Vec::new(),
            buf: Vec::new(),
            stats: WorkerStats {
                kv_blocks: config.kv_blocks,
                ..WorkerStats::default()
            },
        })
    }

    /// The worker key its events belong to.
    pub fn key(&self) -> WorkerKey {
        self.key
    }

    /// Its cache shape.
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// Serves request `id` with prompt `tokens` under the adapter `lora` (`None`: the base
    /// model) and keeps its blocks referenced until [`SimWorker::finish`]. Queues the
    /// resulting KV events; see the module docs.
    ///
    /// Fails, changing nothing, if `id` is already active here.
    pub fn serve(&mut self, id: RequestId, tokens: &[u32], lora: Option<&str>) -> Result<Served> {
        if self.requests.contains_key(&id) {
            return Err(SimError::DuplicateRequest(id));
        }
        let bs = self.config.block_size as usize;
        let seed = lora_seed(lora);
        let mut blocks = tokens.chunks_exact(bs);
        let mut held: Vec<BlockId> = Vec::with_capacity(tokens.len() / bs);

        // 1. The longest cached prefix (invariant 1: stop at the first miss).
        let mut parent = None;
        let mut missed = None;
        for block in blocks.by_ref() {
            let h = engine_hash(&mut self.buf, parent, seed, block);
            match self.pool.lookup(h) {
                Some(b) => {
                    held.push(b);
                    parent = Some(h);
                }
                None => {
                    missed = Some(h);
                    break;
                }
            }
        }
        let hit = held.len();
        // 2. Reference the hits before allocating, so they cannot be evicted.
        for &b in &held {
            self.pool.touch(b);
        }

        // 3. Allocate the missing blocks, evicting idle ones, while any block is free.
        let mut removed = Vec::new();
        let mut new_hashes = Vec::new();
        while let Some(h) = missed {
            if self.pool.lookup(h).is_some() {
                // Unreachable while invariant 1 holds; stopping keeps events consistent.
                debug_assert!(false, "cached block without a cached parent");
                break;
            }
            let Some((b, evicted)) = self.pool.allocate() else {
                break;
            };
            removed.extend(evicted);
            self.pool.cache(b, h);
            held.push(b);
            new_hashes.push(h);
            missed = blocks
                .next()
                .map(|block| engine_hash(&mut self.buf, Some(h), seed, block));
        }

        // 4. The events, evictions first.
        let stored = new_hashes.len();
        let new_tokens = tokens
            .get(hit * bs..(hit + stored) * bs)
            .unwrap_or_default();
        let new_blocks: Vec<StoredBlock> = new_hashes
            .into_iter()
            .zip(tokens_hashes(new_tokens, bs, seed))
            .map(|(engine_hash, tokens_hash)| StoredBlock {
                engine_hash,
                tokens_hash,
            })
            .collect();
        let served = Served {
            prompt_tokens: tokens.len() as u64,
            prompt_blocks: (tokens.len() / bs) as u32,
            hit_blocks: hit as u32,
            stored_blocks: stored as u32,
            uncached_blocks: (tokens.len() / bs - hit - stored) as u32,
            evicted_blocks: removed.len() as u32,
        };
        if !removed.is_empty() {
            self.outbox.push(KvEvent::Removed { blocks: removed });
        }
        if !new_blocks.is_empty() {
            self.outbox.push(KvEvent::Stored {
                parent,
                blocks: new_blocks,
            });
        }
        self.requests.insert(id, held.into_boxed_slice());

        let s = &mut self.stats;
        s.requests += 1;
        s.prompt_tokens += served.prompt_tokens;
        s.hit_tokens += u64::from(served.hit_blocks) * u64::from(self.config.block_size);
        s.stored_blocks += u64::from(served.stored_blocks);
        s.evicted_blocks += u64::from(served.evicted_blocks);
        Ok(served)
    }

    /// Releases the blocks of request `id` (it completed). Its cached blocks stay cached,
    /// now evictable. Fails, changing nothing, if `id` is not active here.
    pub fn finish(&mut self, id: RequestId) -> Result<()> {
        let blocks = self
            .requests
            .remove(&id)
            .ok_or(SimError::UnknownRequest(id))?;
        for &b in blocks.iter().rev() {
            self.pool.release(b);
        }
        Ok(())
    }

    /// Takes the queued KV events, oldest first.
    pub fn poll_events(&mut self) -> std::vec::Drain<'_, KvEvent> {
        self.outbox.drain(..)
    }

    /// How many leading full blocks of `tokens` (under `lora`) this worker caches now: what
    /// serving them would hit. Changes nothing.
    pub fn cached_prefix(&self, tokens: &[u32], lora: Option<&str>) -> u32 {
        let seed = lora_seed(lora);
        let mut buf = Vec::new();
        let mut parent: Option<EngineHash> = None;
        let mut n = 0;
        for block in tokens.chunks_exact(self.config.block_size as usize) {
            let h = engine_hash(&mut buf, parent, seed, block);
            if self.pool.lookup(h).is_none() {
                break;
            }
            parent = Some(h);
            n += 1;
        }
        n
    }

    /// Whether `id` is active here.
    pub fn is_active(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    /// Fraction of the cache referenced by active requests, `0.0..=1.0` (a worker's
    /// `kv_usage`).
    pub fn usage(&self) -> f64 {
        let cap = self.pool.capacity();
        f64::from(cap - self.pool.free_len()) / f64::from(cap.max(1))
    }

    /// Counters and sizes.
    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            active_requests: self.requests.len(),
            cached_blocks: self.pool.cached_len(),
            referenced_blocks: self.pool.capacity() - self.pool.free_len(),
            ..self.stats
        }
    }

    /// Checks the pool's invariants, and that every reference is an active request's
    /// (invariant 3's bookkeeping) (tests only).
    #[cfg(test)]
    fn check_invariants(&self) {
        self.pool.check_invariants();
        let mut want = vec![0u32; self.pool.capacity() as usize];
        for blocks in self.requests.values() {
            for b in blocks.iter() {
                want[b.index()] += 1;
            }
        }
        assert_eq!(
            self.pool.refs(),
            want,
            "references and active requests disagree"
        );
    }
}

#[cfg(test)]
mod tests;
