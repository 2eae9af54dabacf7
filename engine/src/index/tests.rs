//! The tree on its own against a plain model, with the structural validator after every
//! operation: chains stored under any live block (including mid-node ones), copies,
//! removals of any held copies in any order, queries (chains, extended and mutated ones).

use super::{Pos, ShardIndex};
use crate::hash::seq_hash;
use crate::ids::{SeqHash, TokensHash, WorkerKey};
use crate::matches::Matches;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone)]
enum Op {
    /// `parent`: None = start a sequence, Some(i) = the i-th (mod n) live position.
    Store {
        key: u64,
        parent: Option<usize>,
        tokens: Vec<u64>,
    },
    /// Drop the picked (mod n) copies this key holds.
    Remove { key: u64, picks: Vec<usize> },
    Query {
        pick: usize,
        extra: Vec<u64>,
        mutate: Option<usize>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..4u64;
    prop_oneof![
        5 => (key.clone(), proptest::option::weighted(0.7, 0..512usize), proptest::collection::vec(0..3u64, 1..8))
            .prop_map(|(key, parent, tokens)| Op::Store { key, parent, tokens }),
        4 => (key, proptest::collection::vec(0..512usize, 1..8))
            .prop_map(|(key, picks)| Op::Remove { key, picks }),
        3 => (0..512usize, proptest::collection::vec(0..3u64, 0..3), proptest::option::weighted(0.2, 0..8usize))
            .prop_map(|(pick, extra, mutate)| Op::Query { pick, extra, mutate }),
    ]
}

#[derive(Default)]
struct Model {
    /// Per key: every copy it holds, as (position, seq).
    held: BTreeMap<WorkerKey, Vec<(Pos, SeqHash)>>,
    /// seq -> parent seq, for every block ever stored.
    parents: HashMap<SeqHash, Option<SeqHash>>,
}

impl Model {
    fn holds(&self, key: WorkerKey, s: SeqHash) -> bool {
        self.held
            .get(&key)
            .is_some_and(|v| v.iter().any(|x| x.1 == s))
    }

    fn matches(&self, q: &[SeqHash]) -> Matches {
        Matches::from_overlaps(self.held.keys().map(|&k| {
            (
                k,
                q.iter().take_while(|&&s| self.holds(k, s)).count() as u32,
            )
        }))
    }

    fn live_positions(&self) -> Vec<(Pos, SeqHash)> {
        let mut v: Vec<_> = self.held.values().flatten().copied().collect();
        v.sort();
        v.dedup();
        v
    }
}

fn run(ops: Vec<Op>) {
    let mut tree = ShardIndex::new();
    let mut m = Model::default();
    let mut out = Vec::new();
    for op in ops {
        match op {
            Op::Store {
                key,
                parent,
                tokens,
            } => {
                let key = WorkerKey::new(key, 0);
                let live = m.live_positions();
                let parent = parent.and_then(|i| live.get(i % live.len().max(1)).copied());
                let mut prev = parent.map(|p| p.1);
                let seqs: Vec<SeqHash> = tokens
                    .iter()
                    .map(|&t| {
                        let s = seq_hash(prev, TokensHash(t));
                        m.parents.entry(s).or_insert(prev);
                        prev = Some(s);
                        s
                    })
                    .collect();
                out.clear();
                tree.store(key, parent.map(|p| p.0), &seqs, &mut out)
                    .unwrap();
                assert_eq!(out.len(), seqs.len());
                for (&p, &s) in out.iter().zip(&seqs) {
                    assert_eq!(tree.seq(p), Some(s));
                    m.held.entry(key).or_default().push((p, s));
                }
            }
            Op::Remove { key, picks } => {
                let key = WorkerKey::new(key, 0);
                let Some(held) = m.held.get_mut(&key) else {
                    assert_eq!(tree.remove(key, &[]).missing, 0);
                    continue;
                };
                let mut gone = Vec::new();
                for i in picks {
                    if held.is_empty() {
                        break;
                    }
                    gone.push(held.swap_remove(i % held.len()).0);
                }
                if held.is_empty() {
                    m.held.remove(&key);
                }
                let r = tree.remove(key, &gone);
                assert_eq!((r.removed, r.missing), (gone.len(), 0));
            }
            Op::Query {
                pick,
                extra,
                mutate,
            } => {
                let mut known: Vec<SeqHash> = m.parents.keys().copied().collect();
                known.sort();
                let mut q = Vec::new();
                if !known.is_empty() {
                    let mut s = Some(known[pick % known.len()]);
                    while let Some(x) = s {
                        q.push(x);
                        s = m.parents[&x];
                    }
                    q.reverse();
                }
                for t in extra {
                    q.push(seq_hash(q.last().copied(), TokensHash(t)));
                }
                if let Some(i) = mutate
                    && !q.is_empty()
                {
                    let i = i % q.len();
                    q[i] = SeqHash(q[i].0 ^ 1);
                }
                assert_eq!(tree.find_matches(&q), m.matches(&q), "query {q:?}");
            }
        }
        tree.validate().unwrap();
        let st = tree.stats();
        let entries: usize = m
            .held
            .values()
            .map(|v| {
                let mut s: Vec<_> = v.iter().map(|x| x.1).collect();
                s.sort();
                s.dedup();
                s.len()
            })
            .sum();
        assert_eq!(st.entries, entries as u64);
        assert_eq!(st.worker_keys, m.held.len());
    }
    for (&key, held) in &m.held {
        let all: Vec<Pos> = held.iter().map(|x| x.0).collect();
        assert_eq!(tree.remove(key, &all).missing, 0);
        tree.validate().unwrap();
    }
    assert_eq!(tree.stats(), ShardIndex::new().stats());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn tree_equals_model_and_keeps_its_shape(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops);
    }
}

#[test]
fn a_tail_is_one_node_and_a_partial_holder_splits_it() {
    let mut t = ShardIndex::new();
    let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
    let chain: Vec<SeqHash> = (0..96u64)
        .scan(None, |p, i| {
            let s = seq_hash(*p, TokensHash(i));
            *p = Some(s);
            Some(s)
        })
        .collect();
    let mut pa = Vec::new();
    t.store(a, None, &chain, &mut pa).unwrap();
    assert_eq!(t.stats().nodes, 1, "96 blocks stored together are one node");
    let mut pb = Vec::new();
    t.store(b, None, &chain[..40], &mut pb).unwrap();
    assert_eq!(pa[..40], pb[..], "shared blocks keep their positions");
    assert_eq!(t.stats().nodes, 2);
    t.validate().unwrap();
    // b drops them again: the two nodes merge back into one.
    assert_eq!(t.remove(b, &pb).removed, 40);
    assert_eq!(t.stats().nodes, 1);
    // Removing a's tail in reverse order drops the node at once.
    let rev: Vec<Pos> = pa.iter().rev().copied().collect();
    assert_eq!(t.remove(a, &rev).removed, 96);
    assert_eq!(t.stats(), ShardIndex::new().stats());
}

#[test]
fn a_sequence_growing_block_by_block_stays_one_node() {
    let mut t = ShardIndex::new();
    let k = WorkerKey::new(1, 0);
    let mut parent = None;
    let mut prev = None;
    let mut out = Vec::new();
    for i in 0..300u64 {
        let s = seq_hash(prev, TokensHash(i));
        out.clear();
        t.store(k, parent, &[s], &mut out).unwrap();
        parent = out.first().copied();
        prev = Some(s);
    }
    // Runs hold at most 256 blocks: two nodes, not 300.
    assert_eq!(t.stats().nodes, 2);
    assert_eq!(t.cached_blocks(k), 300);
    t.validate().unwrap();
}

fn chain_from(parent: Option<SeqHash>, tokens: impl IntoIterator<Item = u64>) -> Vec<SeqHash> {
    let mut prev = parent;
    tokens
        .into_iter()
        .map(|t| {
            let s = seq_hash(prev, TokensHash(t));
            prev = Some(s);
            s
        })
        .collect()
}

#[test]
fn path_to_reports_pieces_holders_and_side_branches() {
    let mut t = ShardIndex::new();
    let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
    let prompt = chain_from(None, 0..4);
    let tail_a = chain_from(prompt.last().copied(), 10..13);
    let tail_b = chain_from(prompt.last().copied(), 20..22);
    let (mut pa, mut pb) = (Vec::new(), Vec::new());
    t.store(a, None, &[prompt.clone(), tail_a.clone()].concat(), &mut pa)
        .unwrap();
    t.store(b, None, &prompt, &mut pb).unwrap();
    let mut pt = Vec::new();
    t.store(b, pb.last().copied(), &tail_b, &mut pt).unwrap();
    // Path to the prompt's last block: one piece held by both, branching to both tails.
    let path = t.path_to(pa[3]).unwrap();
    assert_eq!(path.len(), 1);
    assert_eq!(path[0].seqs, prompt);
    assert_eq!(path[0].holders, vec![(a, 1), (b, 1)]);
    let mut side = path[0].side.clone();
    side.sort();
    let mut want = vec![tail_a[0], tail_b[0]];
    want.sort();
    assert_eq!(side, want);
    // Path to the middle of a's tail: the prompt piece (side: b's tail) and a's stretch.
    let path = t.path_to(pa[5]).unwrap();
    assert_eq!(path.len(), 2);
    assert_eq!(path[0].side, vec![tail_b[0]]);
    assert_eq!(path[1].seqs, tail_a[..2]);
    assert_eq!(path[1].holders, vec![(a, 1)]);
    assert_eq!(path[1].side, vec![tail_a[2]]);
}

#[test]
fn ensure_grafts_unheld_ancestors_and_prunes_what_stays_unheld() {
    let mut t = ShardIndex::new();
    let k = WorkerKey::new(1, 0);
    let trunk = chain_from(None, 0..3);
    let path = chain_from(trunk.last().copied(), 5..8);
    let mut at = Vec::new();
    t.ensure(None, &trunk, &mut at).unwrap();
    assert_eq!(t.stats().blocks, 0, "ensured blocks are unheld");
    let mut out = Vec::new();
    t.store(k, at.last().copied(), &path, &mut out).unwrap();
    t.validate().unwrap();
    assert_eq!(
        t.find_matches(&[trunk.clone(), path.clone()].concat()),
        Matches::default()
    );
    assert_eq!(t.remove(k, &out).removed, 3);
    assert_eq!(
        t.stats(),
        ShardIndex::new().stats(),
        "unheld ancestors go with the last holder"
    );
    // An ensure that nothing is stored below is undone by prune_unheld.
    let mut at = Vec::new();
    t.ensure(None, &trunk, &mut at).unwrap();
    t.prune_unheld(*at.last().unwrap());
    assert_eq!(t.stats(), ShardIndex::new().stats());
}

#[test]
fn a_new_branch_is_reported_with_its_fanout() {
    let mut t = ShardIndex::new();
    let prompt = chain_from(None, 0..2);
    let mut p = Vec::new();
    t.store(WorkerKey::new(0, 0), None, &prompt, &mut p)
        .unwrap();
    assert_eq!(
        t.take_branch(),
        None,
        "a chain from the root branches nothing"
    );
    for w in 1..4u64 {
        let mut out = Vec::new();
        t.store(
            WorkerKey::new(w, 0),
            p.last().copied(),
            &chain_from(prompt.last().copied(), [w]),
            &mut out,
        )
        .unwrap();
        assert_eq!(t.take_branch(), Some((p[1], w as u32)));
    }
    assert_eq!(t.take_branch(), None);
}

/// `add_copies` is `copies` more stores of a chain already stored, in one walk: the trees
/// export the same records, validate, and lose their copies one removal at a time alike.
#[test]
fn copies_added_at_once_equal_repeated_stores() {
    let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 3));
    let chain = chain_from(None, 0..7);
    let tail = chain_from(chain.get(3).copied(), 100..104);
    let build = |at_once: bool| {
        let mut t = ShardIndex::new();
        let mut pa = Vec::new();
        t.store(a, None, &chain, &mut pa).unwrap();
        if at_once {
            t.add_copies(a, None, &chain, 3).unwrap();
        } else {
            for _ in 0..3 {
                t.store(a, None, &chain, &mut Vec::new()).unwrap();
            }
        }
        // A holder of part of the chain splits its nodes.
        t.store(b, None, &chain[..4], &mut Vec::new()).unwrap();
        let mid = pa.get(3).copied();
        let mut pt = Vec::new();
        t.store(b, mid, &tail, &mut pt).unwrap();
        if at_once {
            t.add_copies(b, mid, &tail, 1).unwrap();
            // Nothing to add: no change.
            t.add_copies(b, mid, &tail, 0).unwrap();
        } else {
            t.store(b, mid, &tail, &mut Vec::new()).unwrap();
        }
        t.validate().unwrap();
        (t, pa, pt)
    };
    let (mut once, pa, pt) = build(true);
    let (mut repeated, pa2, pt2) = build(false);
    assert_eq!((&pa, &pt), (&pa2, &pt2));
    let export = |t: &ShardIndex| {
        let (mut n, mut s, mut h) = (Vec::new(), Vec::new(), Vec::new());
        t.export(&mut n, &mut s, &mut h);
        (n, s, h)
    };
    assert_eq!(export(&once), export(&repeated));
    for round in 0..4 {
        let removed = (once.remove(a, &pa).removed, repeated.remove(a, &pa).removed);
        assert_eq!(removed.0, removed.1, "round {round}");
        assert_eq!(
            once.cached_blocks(a),
            repeated.cached_blocks(a),
            "round {round}"
        );
        assert_eq!(export(&once), export(&repeated), "round {round}");
        once.validate().unwrap();
    }
    assert_eq!(once.cached_blocks(a), 0);
    // Copies past u32::MAX saturate; either way it is one walk, not billions of stores.
    let started = std::time::Instant::now();
    once.add_copies(b, pa.get(3).copied(), &tail, u32::MAX)
        .unwrap();
    once.add_copies(b, pa.get(3).copied(), &tail, u32::MAX)
        .unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
    once.validate().unwrap();
    // A chain that is not in the tree is refused.
    let absent = chain_from(None, 500..502);
    assert!(once.add_copies(a, None, &absent, 2).is_err());
}
