//! A hash table that grows a page at a time (extendible hashing over hashbrown tables), so
//! no insert ever moves more than one page's entries.
//!
//! A plain hashbrown table doubles by rehashing every entry at once: a worker key's
//! directory of 7,168 entries took ~280 µs to grow on the 2-CPU machine, and a query that
//! reached the core meanwhile waited for all of it (issue 32: that growth was half of the
//! slow rounds behind W1's read stall while ingest runs). Here the entries are split among
//! pages of at most [`PAGE`] entries; a full page splits in two, moving about half of its
//! entries, so the worst insert costs one page's work whatever the table's size.
//!
//! Which page holds an entry is told by bits 32 and up of its hash, through a directory of
//! `2^depth` page numbers (`dir[k & (2^depth - 1)]`, `k = hash >> 32`); a page of local depth
//! `d` owns every directory slot that agrees with it on the low `d` bits. hashbrown uses the
//! low bits (bucket) and the top 7 bits (tag) of the same hash inside a page, so page
//! selection takes neither.
//!
//! # Invariants
//! 1. Every entry lives in the page the directory names for its hash's bits, and only there.
//! 2. A page's local depth is at most the table's depth; the directory slots of a page of
//!    local depth `d` are exactly those congruent to the page's pattern modulo `2^d`.
//! 3. An insert rehashes at most one page: it splits the page (its entries go into two
//!    fresh tables by bit `d` of their page bits) or lets a page still below [`PAGE`]
//!    entries grow, and doubling the directory copies page numbers, not entries. A page
//!    whose entries all agree on the bit that would split them (only a hostile hash does
//!    that), or that sits at the deepest directory (2^24 slots), grows like a plain table
//!    instead, so a hostile hash cannot deepen the directory.
//! 4. `len` is the number of entries over all pages.
//!
//! # Concurrency
//! None: one owner, like the hashbrown table it wraps.

use hashbrown::HashTable;

/// Entries a page holds before it splits: hashbrown's capacity for 128 buckets. A split
/// moves about half of them; measured on W1's directories, a 448-entry page took 21-115 µs
/// to split (the page is usually cold), 112 entries a quarter of that.
pub const PAGE: usize = 112;

/// Deepest directory (2^24 slots): beyond it a page grows instead of splitting.
const MAX_DEPTH: u32 = 24;

/// The bits of `hash` that choose a page.
#[inline]
fn page_key(hash: u64) -> usize {
    (hash >> 32) as usize
}

struct Page<T> {
    table: HashTable<T>,
    /// Local depth: the page owns the directory slots equal to `pattern` modulo `2^depth`.
    depth: u32,
    pattern: usize,
    /// A split could not separate its entries (all agreed on the next bit: only a hostile
    /// hash does that): it grows like a plain table from then on.
    overflow: bool,
}

impl<T> Page<T> {
    fn root() -> Self {
        Self {
            table: HashTable::new(),
            depth: 0,
            pattern: 0,
            overflow: false,
        }
    }
}

/// See the module docs.
pub struct PagedTable<T> {
    pages: Vec<Page<T>>,
    /// Page number of each directory slot.
    dir: Vec<u32>,
    depth: u32,
    len: usize,
}

impl<T> std::fmt::Debug for PagedTable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedTable")
            .field("len", &self.len)
            .field("pages", &self.pages.len())
            .field("depth", &self.depth)
            .finish()
    }
}

impl<T> Default for PagedTable<T> {
    fn default() -> Self {
        Self {
            pages: Vec::new(),
            dir: Vec::new(),
            depth: 0,
            len: 0,
        }
    }
}

impl<T> PagedTable<T> {
    /// An empty table (allocates nothing).
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries held.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Nothing held.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first page, for the first entry.
    #[inline]
    fn ensure_root(&mut self) {
        if self.pages.is_empty() {
            self.pages.push(Page::root());
            self.dir.push(0);
        }
    }

    #[inline]
    fn page_of(&self, hash: u64) -> Option<usize> {
        let mask = (1usize << self.depth) - 1;
        self.dir.get(page_key(hash) & mask).map(|&p| p as usize)
    }

    /// The entry with this hash that `eq` accepts.
    #[inline]
    pub fn find(&self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<&T> {
        let p = self.page_of(hash)?;
        self.pages.get(p)?.table.find(hash, eq)
    }

    /// The entry with this hash that `eq` accepts, mutably.
    #[inline]
    pub fn find_mut(&mut self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<&mut T> {
        let p = self.page_of(hash)?;
        self.pages.get_mut(p)?.table.find_mut(hash, eq)
    }

    /// Removes and returns the entry with this hash that `eq` accepts.
    #[inline]
    pub fn remove(&mut self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<T> {
        let p = self.page_of(hash)?;
        let page = self.pages.get_mut(p)?;
        let (value, _) = page.table.find_entry(hash, eq).ok()?.remove();
        self.len -= 1;
        if self.len == 0 {
            *self = Self::new();
        } else if page.table.is_empty() {
            // An empty page gives its buckets back. A page that still holds entries keeps
            // them (at most one page's worth): shrinking pages as they drain cost W1's
            // removals ~40% of their rate in allocations and rehashes.
            page.table = HashTable::new();
        }
        Some(value)
    }

    /// The entry with this hash that `eq` accepts, or `make()` inserted as a new one; says
    /// which (`true`: inserted). One probe of one page when the page has room, as
    /// hashbrown's `entry`; a full page is split first (invariant 3).
    #[inline]
    pub fn find_or_insert(
        &mut self,
        hash: u64,
        mut eq: impl FnMut(&T) -> bool,
        make: impl FnOnce() -> T,
        hasher: impl Fn(&T) -> u64,
    ) -> (bool, Option<&T>) {
        self.ensure_root();
        loop {
            let Some(p) = self.page_of(hash) else {
                return (false, None);
            };
            let full = match self.pages.get(p) {
                Some(page) => page.table.len() >= PAGE && page.depth < MAX_DEPTH && !page.overflow,
                None => return (false, None),
            };
            if full {
                if self
                    .pages
                    .get(p)
                    .and_then(|pg| pg.table.find(hash, &mut eq))
                    .is_some()
                {
                    return (
                        false,
                        self.pages.get(p).and_then(|pg| pg.table.find(hash, eq)),
                    );
                }
                self.split(p, &hasher);
                continue;
            }
            let Some(page) = self.pages.get_mut(p) else {
                return (false, None);
            };
            return match page.table.entry(hash, eq, &hasher) {
                hashbrown::hash_table::Entry::Occupied(o) => (false, Some(o.into_mut())),
                hashbrown::hash_table::Entry::Vacant(v) => {
                    let e = v.insert(make()).into_mut();
                    self.len += 1;
                    (true, Some(e))
                }
            };
        }
    }

    /// Inserts `value`, whose hash is `hash`; the caller knows no entry equal to it is
    /// present. Moves at most one page's entries (invariant 3).
    pub fn insert_unique(&mut self, hash: u64, value: T, hasher: impl Fn(&T) -> u64) {
        self.ensure_root();
        loop {
            let Some(p) = self.page_of(hash) else {
                return;
            };
            let Some(page) = self.pages.get(p) else {
                return;
            };
            if page.table.len() < PAGE || page.depth >= MAX_DEPTH || page.overflow {
                break;
            }
            self.split(p, &hasher);
        }
        let Some(page) = self.page_of(hash).and_then(|p| self.pages.get_mut(p)) else {
            return;
        };
        page.table.insert_unique(hash, value, &hasher);
        self.len += 1;
    }

    /// Splits page `p`: its entries whose bit `d` (its local depth) is set move to a new
    /// page, which takes the directory slots with that bit set. If they all agree on that
    /// bit the page is marked to grow instead (invariant 3).
    #[cold]
    fn split(&mut self, p: usize, hasher: &impl Fn(&T) -> u64) {
        let Some(page) = self.pages.get_mut(p) else {
            return;
        };
        let (d, pattern) = (page.depth, page.pattern);
        let bit = 1usize << d;
        // Both halves go into fresh tables: taking half out in place would leave a
        // tombstone per entry moved, and hashbrown grows a table whose tombstones ate its
        // room to twice the buckets (measured: half the pages at 256 buckets, 12 bytes an
        // entry more than a plain table).
        let (mut keep, mut moved) = (
            HashTable::with_capacity(PAGE),
            HashTable::with_capacity(PAGE),
        );
        for e in std::mem::take(&mut page.table) {
            let h = hasher(&e);
            if page_key(h) & bit != 0 {
                moved.insert_unique(h, e, hasher);
            } else {
                keep.insert_unique(h, e, hasher);
            }
        }
        if moved.is_empty() || keep.is_empty() {
            // Nothing told apart: keep the entries together, and grow from now on.
            page.table = if keep.is_empty() { moved } else { keep };
            page.overflow = true;
            return;
        }
        page.table = keep;
        page.depth = d + 1;
        if d == self.depth {
            // Double the directory: slot `i + 2^depth` starts as slot `i`.
            self.dir.extend_from_within(..);
            self.depth += 1;
        }
        let new = self.pages.len();
        self.pages.push(Page {
            table: moved,
            depth: d + 1,
            pattern: pattern | bit,
            overflow: false,
        });
        // The old page's slots with bit `d` set: pattern | bit, stepping 2^(d+1).
        let mut i = pattern | bit;
        while let Some(slot) = self.dir.get_mut(i) {
            *slot = new as u32;
            i += bit << 1;
        }
    }

    /// Room for `n` more entries without a page growing, where one page can take them (a
    /// restore into an empty table); otherwise pages split as entries arrive.
    pub fn reserve(&mut self, n: usize, hasher: impl Fn(&T) -> u64) {
        if self.pages.len() <= 1 && self.len + n <= PAGE {
            self.ensure_root();
            if let Some(page) = self.pages.first_mut() {
                page.table.reserve(n, hasher);
            }
        }
    }

    /// Every entry.
    pub fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.pages.iter().flat_map(|p| p.table.iter())
    }

    /// Takes every entry out, leaving the table empty.
    pub fn into_entries(self) -> impl Iterator<Item = T> {
        self.pages.into_iter().flat_map(|p| p.table.into_iter())
    }

    /// Heap bytes owned.
    pub fn allocation_size(&self) -> usize {
        self.pages
            .iter()
            .map(|p| p.table.allocation_size())
            .sum::<usize>()
            + self.pages.capacity() * size_of::<Page<T>>()
            + self.dir.capacity() * size_of::<u32>()
    }

    /// Checks invariants 1, 2 and 4; describes the first breach (tests).
    #[cfg(test)]
    fn validate(&self, hasher: impl Fn(&T) -> u64) -> Result<(), String> {
        if self.dir.len() != (1usize << self.depth) && !self.pages.is_empty() {
            return Err(format!(
                "dir {} slots at depth {}",
                self.dir.len(),
                self.depth
            ));
        }
        let mut total = 0;
        for (n, page) in self.pages.iter().enumerate() {
            if page.depth > self.depth {
                return Err(format!("page {n} deeper than the table"));
            }
            total += page.table.len();
            for e in page.table.iter() {
                let k = page_key(hasher(e)) & ((1usize << self.depth) - 1);
                if self.dir.get(k).copied() != Some(n as u32) {
                    return Err(format!("an entry of page {n} is reached through another"));
                }
            }
            let owned = self.dir.iter().filter(|&&q| q as usize == n).count();
            if self.dir.get(page.pattern).copied() != Some(n as u32) {
                return Err(format!("page {n}'s pattern slot names another page"));
            }
            if owned != 1usize << (self.depth - page.depth) {
                return Err(format!(
                    "page {n} owns {owned} slots at local depth {}",
                    page.depth
                ));
            }
        }
        if total != self.len {
            return Err(format!("len {} but {total} entries", self.len));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn mix(k: u64) -> u64 {
        let x = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^ (x >> 29)
    }

    /// Random inserts and removals against std's map: same contents, invariants kept, and
    /// no page ever past [`PAGE`] (so no insert moved more than a page).
    #[test]
    fn matches_a_map_and_keeps_pages_bounded() {
        let mut t: PagedTable<(u64, u32)> = PagedTable::new();
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let h = |e: &(u64, u32)| mix(e.0);
        for round in 0..60_000u32 {
            let r = next();
            // Keys from a range that fills and then drains: growth, then shrinking.
            let span = if round < 40_000 { 20_000 } else { 2_000 };
            let k = r % span;
            if r >> 62 == 0 || round >= 40_000 && r >> 63 == 1 {
                let got = t.remove(mix(k), |e| e.0 == k).map(|e| e.1);
                assert_eq!(got, model.remove(&k));
            } else if r & 1 == 0 {
                // find_or_insert: inserts when absent, else finds the model's value.
                let (inserted, got) = t.find_or_insert(mix(k), |e| e.0 == k, || (k, round), h);
                let got = got.map(|e| e.1);
                match model.get(&k) {
                    Some(&v) => assert_eq!((inserted, got), (false, Some(v))),
                    None => {
                        assert_eq!((inserted, got), (true, Some(round)));
                        model.insert(k, round);
                    }
                }
            } else if t.find(mix(k), |e| e.0 == k).is_none() {
                t.insert_unique(mix(k), (k, round), h);
                model.insert(k, round);
            } else {
                assert_eq!(
                    t.find(mix(k), |e| e.0 == k).map(|e| e.1),
                    model.get(&k).copied()
                );
            }
            if round % 5_000 == 0 {
                t.validate(h).unwrap();
            }
            assert!(t.pages.iter().all(|p| p.table.len() <= PAGE));
        }
        t.validate(h).unwrap();
        assert_eq!(t.len(), model.len());
        let mut all: Vec<_> = t.iter().copied().collect();
        all.sort_unstable();
        let mut want: Vec<_> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(all, want);
    }

    #[test]
    fn empties_to_nothing() {
        let mut t: PagedTable<u64> = PagedTable::new();
        for k in 0..5_000u64 {
            t.insert_unique(mix(k), k, |&e| mix(e));
        }
        assert!(t.pages.len() > 8);
        for k in 0..5_000u64 {
            assert_eq!(t.remove(mix(k), |&e| e == k), Some(k));
        }
        assert_eq!(t.allocation_size(), 0);
        assert!(t.is_empty());
    }

    /// Keys whose page bits all agree (a hostile hash) cannot split past the deepest
    /// directory: that page grows like a plain table, and everything is still found.
    #[test]
    fn colliding_page_bits_grow_one_page() {
        let mut t: PagedTable<u64> = PagedTable::new();
        let h = |&e: &u64| e & 0xFFFF_FFFF; // bits 32.. all zero
        for k in 1..3_000u64 {
            t.insert_unique(h(&k), k, h);
        }
        t.validate(h).unwrap();
        for k in 1..3_000u64 {
            assert_eq!(t.find(h(&k), |&e| e == k), Some(&k));
        }
    }
}
#[cfg(test)]
mod memory_tests {
    use super::*;

    /// Pages split into fresh tables (no tombstones): the table's bytes stay near a plain
    /// hashbrown table's with the same entries, at sizes just below and just past a
    /// plain table's doubling and far beyond.
    #[test]
    fn memory_stays_near_a_plain_tables() {
        let mix = |k: u64| {
            let x = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            x ^ (x >> 29)
        };
        let h = |e: &[u32; 5]| mix(u64::from(e[0]));
        for n in [1_000usize, 6_272, 7_840, 50_000] {
            let mut paged: PagedTable<[u32; 5]> = PagedTable::new();
            let mut plain = HashTable::<[u32; 5]>::new();
            for k in 0..n as u32 {
                paged.insert_unique(h(&[k; 5]), [k; 5], h);
                plain.insert_unique(h(&[k; 5]), [k; 5], h);
            }
            let (a, b) = (paged.allocation_size(), plain.allocation_size());
            eprintln!("{n} entries: paged {a} B, plain {b} B");
            assert!(
                a * 4 <= b * 5,
                "{n} entries: paged {a} B against plain {b} B"
            );
        }
    }
}
