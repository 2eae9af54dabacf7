//! The physical KV blocks of one simulated worker: reference counts, the prefix-cache map and
//! the queue of evictable blocks.
//!
//! # Algorithm
//! vLLM v1's block pool (`vllm/v1/core/block_pool.py` with `FreeKVCacheBlockQueue` in
//! `kv_cache_utils.py`): a fixed array of blocks, each with a reference count and, once it
//! holds a full computed block, the block's hash. Every unreferenced block (never used, or
//! cached but idle) sits in one doubly linked queue, least recently released first. Allocation
//! pops the head; if that block still caches something, its hash leaves the map: that is an
//! eviction. Touching a cached block takes it out of the queue; releasing its last reference
//! appends it at the tail. The links are `u32` indices into the block array, so the queue
//! costs no allocation and every operation is O(1).
//!
//! # Invariants
//! 1. A block is in the free queue iff its reference count is 0; the queue holds `free_len`
//!    blocks, linked consistently in both directions.
//! 2. `map[h] == b` iff block `b`'s content is `Some(h)`: the map and the contents agree,
//!    and each hash names at most one block.
//! 3. Blocks that were never used come before every released block in the queue, so they are
//!    allocated before anything cached is evicted.

use engine::EngineHash;
use hashbrown::HashMap;

/// Index of one physical block of a worker's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct BlockId(u32);

impl BlockId {
    /// Position in the pool's block array.
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

/// End of a queue link.
const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Block {
    /// Requests holding the block.
    refs: u32,
    /// The hash of the full block it caches, if any.
    content: Option<EngineHash>,
    /// Free-queue links (meaningful only while `refs == 0`).
    prev: u32,
    next: u32,
}

/// A fixed pool of KV blocks with prefix caching. Owned by its worker.
#[derive(Debug)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    map: HashMap<EngineHash, BlockId>,
    head: u32,
    tail: u32,
    free_len: u32,
}

impl BlockPool {
    /// A pool of `capacity` empty blocks, all free. `capacity` must be below `u32::MAX`.
    pub(crate) fn new(capacity: u32) -> Self {
        let capacity = capacity.min(NIL - 1);
        let blocks = (0..capacity)
            .map(|i| Block {
                refs: 0,
                content: None,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == capacity { NIL } else { i + 1 },
            })
            .collect();
        let (head, tail) = if capacity == 0 {
            (NIL, NIL)
        } else {
            (0, capacity - 1)
        };
        Self {
            blocks,
            map: HashMap::new(),
            head,
            tail,
            free_len: capacity,
        }
    }

    /// Total blocks.
    pub(crate) fn capacity(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks not referenced by any request (allocatable, possibly by evicting).
    pub(crate) fn free_len(&self) -> u32 {
        self.free_len
    }

    /// Blocks holding a cached full block (referenced or not).
    pub(crate) fn cached_len(&self) -> usize {
        self.map.len()
    }

    /// The block caching `hash`, if any.
    pub(crate) fn lookup(&self, hash: EngineHash) -> Option<BlockId> {
        self.map.get(&hash).copied()
    }

    /// Whether `id` is unreferenced (in the free queue).
    pub(crate) fn is_idle(&self, id: BlockId) -> bool {
        self.blocks.get(id.0 as usize).is_some_and(|b| b.refs == 0)
    }

    /// Adds a reference to `id`, taking it out of the free queue if it was idle.
    pub(crate) fn touch(&mut self, id: BlockId) {
        let Some(refs) = self.blocks.get(id.0 as usize).map(|b| b.refs) else {
            return;
        };
        if refs == 0 {
            self.unlink(id.0);
        }
        if let Some(b) = self.blocks.get_mut(id.0 as usize) {
            b.refs = refs.saturating_add(1);
        }
    }

    /// Takes the least recently released free block, referenced once and emptied. Returns
    /// it and the hash it cached until now (an eviction), or `None` if every block is
    /// referenced.
    pub(crate) fn allocate(&mut self) -> Option<(BlockId, Option<EngineHash>)> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        let b = self.blocks.get_mut(id as usize)?;
        b.refs = 1;
        let evicted = b.content.take();
        if let Some(h) = evicted {
            self.map.remove(&h);
        }
        Some((BlockId(id), evicted))
    }

    /// Records that `id` (referenced, empty) now caches the full block `hash`.
    ///
    /// Caller guarantees no block caches `hash` yet (see [`BlockPool::lookup`]).
    pub(crate) fn cache(&mut self, id: BlockId, hash: EngineHash) {
        if let Some(b) = self.blocks.get_mut(id.0 as usize) {
            debug_assert!(b.content.is_none() && b.refs > 0);
            b.content = Some(hash);
            let prior = self.map.insert(hash, id);
            debug_assert!(prior.is_none(), "a hash names two blocks");
        }
    }

    /// Drops one reference to `id`; the last one appends it to the tail of the free queue
    /// (most recently used). A block without references is left alone.
    pub(crate) fn release(&mut self, id: BlockId) {
        let Some(b) = self.blocks.get_mut(id.0 as usize) else {
            return;
        };
        match b.refs {
            0 => {}
            1 => {
                b.refs = 0;
                self.push_tail(id.0);
            }
            _ => b.refs -= 1,
        }
    }

    fn unlink(&mut self, i: u32) {
        let Some(&Block { prev, next, .. }) = self.blocks.get(i as usize) else {
            return;
        };
        match self.blocks.get_mut(prev as usize) {
            Some(p) => p.next = next,
            None => self.head = next,
        }
        match self.blocks.get_mut(next as usize) {
            Some(n) => n.prev = prev,
            None => self.tail = prev,
        }
        if let Some(b) = self.blocks.get_mut(i as usize) {
            b.prev = NIL;
            b.next = NIL;
        }
        self.free_len = self.free_len.saturating_sub(1);
    }

    fn push_tail(&mut self, i: u32) {
        let tail = self.tail;
        if let Some(b) = self.blocks.get_mut(i as usize) {
            b.prev = tail;
            b.next = NIL;
        }
        match self.blocks.get_mut(tail as usize) {
            Some(t) => t.next = i,
            None => self.head = i,
        }
        self.tail = i;
        self.free_len += 1;
    }

    /// The free queue from head (next to evict) to tail (tests only).
    #[cfg(test)]
    pub(crate) fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::new();
        let mut i = self.head;
        while i != NIL {
            out.push(BlockId(i));
            i = self.blocks[i as usize].next;
        }
        out
    }

    /// Every block's reference count, by block index (tests only).
    #[cfg(test)]
    pub(crate) fn refs(&self) -> Vec<u32> {
        self.blocks.iter().map(|b| b.refs).collect()
    }

    /// The hash `id` caches (tests only).
    #[cfg(test)]
    pub(crate) fn content(&self, id: BlockId) -> Option<EngineHash> {
        self.blocks[id.0 as usize].content
    }

    /// Checks invariants 1 and 2 (tests only).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        let queue = self.free_queue();
        assert_eq!(queue.len(), self.free_len as usize);
        let mut prev = NIL;
        for &BlockId(i) in &queue {
            let b = &self.blocks[i as usize];
            assert_eq!(b.refs, 0, "referenced block {i} in the free queue");
            assert_eq!(b.prev, prev);
            prev = i;
        }
        assert_eq!(self.tail, prev);
        let idle = self.blocks.iter().filter(|b| b.refs == 0).count();
        assert_eq!(idle, queue.len(), "an idle block is missing from the queue");
        let cached = self.blocks.iter().filter(|b| b.content.is_some()).count();
        assert_eq!(cached, self.map.len());
        for (h, id) in &self.map {
            assert_eq!(self.blocks[id.0 as usize].content, Some(*h));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_takes_unused_blocks_first_then_least_recently_released() {
        let mut p = BlockPool::new(3);
        let (a, ev) = p.allocate().unwrap();
        assert_eq!(ev, None);
        p.cache(a, EngineHash(10));
        let (b, _) = p.allocate().unwrap();
        p.cache(b, EngineHash(11));
        p.release(b);
        p.release(a);
        // Queue: the never-used block, then b, then a.
        assert_eq!(p.free_queue(), vec![BlockId(2), b, a]);
        assert_eq!(p.allocate().unwrap(), (BlockId(2), None));
        assert_eq!(p.allocate().unwrap(), (b, Some(EngineHash(11))));
        assert_eq!(p.lookup(EngineHash(11)), None);
        assert_eq!(p.lookup(EngineHash(10)), Some(a));
        p.check_invariants();
    }

    #[test]
    fn touch_removes_from_queue_and_release_appends_at_tail() {
        let mut p = BlockPool::new(2);
        let (a, _) = p.allocate().unwrap();
        p.cache(a, EngineHash(1));
        p.release(a);
        let (b, _) = p.allocate().unwrap();
        p.cache(b, EngineHash(2));
        p.release(b);
        assert_eq!(p.free_queue(), vec![a, b]);
        p.touch(a);
        p.touch(a);
        assert_eq!(p.free_queue(), vec![b]);
        p.release(a);
        assert_eq!(p.free_queue(), vec![b], "still referenced once");
        p.release(a);
        assert_eq!(p.free_queue(), vec![b, a]);
        assert_eq!(p.content(a), Some(EngineHash(1)));
        p.check_invariants();
    }

    #[test]
    fn exhausted_pool_allocates_nothing() {
        let mut p = BlockPool::new(1);
        assert!(p.allocate().is_some());
        assert!(p.allocate().is_none());
        assert_eq!(p.free_len(), 0);
        let mut empty = BlockPool::new(0);
        assert!(empty.allocate().is_none());
        empty.check_invariants();
    }
}
