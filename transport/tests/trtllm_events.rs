//! TensorRT-LLM's `/kv_cache_events` pages: the decoder ([`decode_page`]) and the per-rank
//! converter ([`RankConverter`]) against the hand-written pages in `tests/data/trtllm` (see
//! its README), malformed bodies, and a model-based property test of the converter.
//!
//! Expected tokens hashes are computed from DESIGN.md's definition, from the token ids read
//! out of the fixtures with a generic JSON reader, never copied from the converter.

use engine::event::{KvEvent, StoredBlock};
use engine::hash::{BASE_SEED, lora_seed, tokens_hash, tokens_hash_with_extras};
use engine::{EngineHash, TokensHash};
use proptest::prelude::*;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use transport::trtllm::{
    Diff, MAX_PAGE_BYTES, Outcome, PageEntry, RankConverter, TrtBlock, TrtData, TrtEvent, TrtToken,
    WireHash, decode_page,
};
use transport::{DropReason, TransportError};

/// TensorRT-LLM's default `tokens_per_block`, which the fixtures use.
const BS: u32 = 32;

fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/trtllm")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The fixture as generic JSON: the independent reading expectations are computed from.
fn json(name: &str) -> Vec<Value> {
    let v: Value = serde_json::from_slice(&fixture(name)).unwrap();
    v.as_array().unwrap().clone()
}

/// Decodes a fixture; every element must be a well-formed event.
fn events(name: &str) -> Vec<TrtEvent> {
    decode_page(&fixture(name))
        .unwrap()
        .into_iter()
        .map(|e| match e {
            PageEntry::Event { event, .. } => event,
            PageEntry::Unreadable { event_id, error } => {
                panic!("{name}: element {event_id:?} unreadable: {error}")
            }
        })
        .collect()
}

/// What one rank's converter made of a page.
#[derive(Debug, Default)]
struct Rank {
    converter: RankConverter,
    events: Vec<KvEvent>,
    outcomes: Vec<Outcome>,
    ids: Vec<u64>,
}

/// Converts a page with one converter per `attention_dp_rank` (absent: rank 0).
fn convert(page: Vec<TrtEvent>, block_size: u32) -> BTreeMap<u32, Rank> {
    let mut ranks: BTreeMap<u32, Rank> = BTreeMap::new();
    for e in page {
        let rank = ranks.entry(e.attention_dp_rank.unwrap_or(0)).or_default();
        rank.ids.push(e.event_id);
        let outcome = rank.converter.convert(e.data, block_size, &mut rank.events);
        rank.outcomes.push(outcome);
    }
    ranks
}

/// The only rank of a page without attention DP.
fn rank0(name: &str) -> Rank {
    let mut ranks = convert(events(name), BS);
    assert_eq!(ranks.keys().copied().collect::<Vec<_>>(), vec![0]);
    ranks.remove(&0).unwrap()
}

/// Token ids and extra ids of one block, read generically.
fn tokens(v: &[Value], event: usize, block: usize) -> (Vec<u32>, Vec<u64>) {
    let b = &v[event]["data"]["blocks"][block];
    let tokens = b["tokens"].as_array().unwrap();
    let ids = tokens
        .iter()
        .map(|t| u32::try_from(t["token_id"].as_u64().unwrap()).unwrap())
        .collect();
    let extras = tokens
        .iter()
        .map(|t| t["token_extra_id"].as_u64().unwrap())
        .collect();
    (ids, extras)
}

/// A text block of the base model: DESIGN.md's tokens_hash with seed 1337.
fn text(v: &[Value], event: usize, block: usize, hash: u64) -> StoredBlock {
    let (ids, extras) = tokens(v, event, block);
    assert!(extras.iter().all(|&e| e == 0));
    assert_eq!(ids.len(), BS as usize);
    StoredBlock {
        engine_hash: EngineHash(hash),
        tokens_hash: tokens_hash(&ids, BASE_SEED),
    }
}

fn stored(parent: Option<u64>, blocks: Vec<StoredBlock>) -> KvEvent {
    KvEvent::Stored {
        parent: parent.map(EngineHash),
        blocks,
    }
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::Removed {
        blocks: hashes.iter().copied().map(EngineHash).collect(),
    }
}

fn no_drops(r: &Rank) {
    for o in &r.outcomes {
        assert!(o.drops.is_empty(), "{o:?}");
        assert_eq!(o.block_size_mismatch, None);
    }
}

// --- The fixtures ------------------------------------------------------------------------

const A: u64 = 12297829382473034410;
const B: u64 = 6148914691236517205;
const C: u64 = 14757395258967641292;

#[test]
fn created_then_stored() {
    let page = events("created_stored.json");
    assert_eq!(
        page.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    assert!(
        page.iter()
            .all(|e| e.window_size == Some(4096) && e.attention_dp_rank.is_none())
    );
    let TrtData::Stored { blocks, .. } = &page[1].data else {
        panic!("{:?}", page[1])
    };
    assert_eq!(blocks[0].kind.as_deref(), Some("stored_block"));
    assert_eq!(
        (blocks[0].cache_level, blocks[0].priority, blocks[0].lora_id),
        (0, Some(35), None)
    );

    let v = json("created_stored.json");
    let r = rank0("created_stored.json");
    assert_eq!(r.outcomes[0].created, Some(vec![8192, 0]));
    assert_eq!(r.converter.capacity(), Some(8192));
    no_drops(&r);
    assert_eq!(
        r.events,
        vec![
            stored(None, vec![text(&v, 1, 0, A), text(&v, 1, 1, B)]),
            stored(Some(B), vec![text(&v, 2, 0, C)]),
        ]
    );
}

#[test]
fn removed_blocks() {
    const D: u64 = 17361641481138401520;
    const E: u64 = 1229782938247303441;
    const F: u64 = 9838263505978427528;
    let v = json("removed.json");
    let r = rank0("removed.json");
    assert_eq!(r.ids, [40, 41, 42, 43]);
    no_drops(&r);
    assert_eq!(
        r.events,
        vec![
            stored(None, vec![text(&v, 0, 0, D), text(&v, 0, 1, E)]),
            stored(Some(E), vec![text(&v, 1, 0, F)]),
            removed(&[F]),
            removed(&[E, D]),
        ]
    );
}

#[test]
fn offload_and_onboard() {
    const G: u64 = 11068046444225730969;
    const H: u64 = 3074457345618258602;
    let page = events("updated_offload.json");
    assert_eq!(
        page[2].data,
        TrtData::Updated {
            block_hash: WireHash(H),
            cache_level: Some(Diff {
                new_value: 1,
                old_value: 0
            }),
            priority: None,
        }
    );
    let v = json("updated_offload.json");
    let r = rank0("updated_offload.json");
    assert_eq!(r.outcomes[0].created, Some(vec![8192, 16384]));
    no_drops(&r);
    assert_eq!(
        r.events,
        vec![
            stored(None, vec![text(&v, 1, 0, G), text(&v, 1, 1, H)]),
            // Offloaded to host memory: out of the index.
            removed(&[H]),
            // Brought back: stored again under its parent, with its tokens hash.
            stored(Some(G), vec![text(&v, 1, 1, H)]),
            // Priority-only updates (4, 5): nothing. Offloaded again (6):
            removed(&[H]),
            // ...and then removed from host memory (7): not in the index, nothing.
        ]
    );
}

#[test]
fn multimodal_extra_ids_are_hashed() {
    const M1: u64 = 16045690984833335022;
    const M2: u64 = 4611686018427387904;
    const M3: u64 = 13835058055282163712;
    const M4: u64 = 7378697629483820646;
    let v = json("multimodal.json");
    let r = rank0("multimodal.json");
    no_drops(&r);
    // The definition, spelled out: u32 LE token ids, then u64 LE extra ids, XXH3 seed 1337.
    let image = |event, block, hash| {
        let (ids, extras) = tokens(&v, event, block);
        assert!(extras.iter().any(|&e| e != 0));
        let mut bytes = Vec::new();
        ids.iter().for_each(|t| bytes.extend(t.to_le_bytes()));
        extras.iter().for_each(|e| bytes.extend(e.to_le_bytes()));
        let h = TokensHash(xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, BASE_SEED));
        assert_eq!(h, tokens_hash_with_extras(&ids, &extras, BASE_SEED));
        assert_ne!(h, tokens_hash(&ids, BASE_SEED));
        StoredBlock {
            engine_hash: EngineHash(hash),
            tokens_hash: h,
        }
    };
    let (m2, m4) = (image(1, 1, M2), image(2, 0, M4));
    assert_eq!(
        r.events,
        vec![
            stored(None, vec![text(&v, 1, 0, M1), m2, image(1, 2, M3)]),
            stored(Some(M1), vec![m4]),
        ]
    );
    // The same placeholder token ids for two images: two different blocks.
    assert_eq!(tokens(&v, 1, 1).0, tokens(&v, 2, 0).0);
    assert_ne!(m2.tokens_hash, m4.tokens_hash);
}

#[test]
fn lora_id_selects_the_seed() {
    const L1: u64 = 10376293541461622784;
    const L2: u64 = 15987178197214944733;
    const L3: u64 = 2305843009213693952;
    let v = json("lora.json");
    let page = events("lora.json");
    let TrtData::Stored { blocks, .. } = &page[1].data else {
        panic!()
    };
    assert_eq!(blocks[0].lora_id, Some(3));
    let r = rank0("lora.json");
    no_drops(&r);
    let adapter = |event, block, hash| StoredBlock {
        engine_hash: EngineHash(hash),
        tokens_hash: tokens_hash(&tokens(&v, event, block).0, lora_seed(Some("3"))),
    };
    assert_eq!(
        r.events,
        vec![
            stored(None, vec![adapter(1, 0, L1), adapter(1, 1, L2)]),
            stored(None, vec![text(&v, 2, 0, L3)]),
        ]
    );
    // The same tokens under LoRA 3 and on the base model: two different blocks.
    assert_eq!(tokens(&v, 1, 0), tokens(&v, 2, 0));
    assert_ne!(
        adapter(1, 0, L1).tokens_hash,
        text(&v, 2, 0, L3).tokens_hash
    );
}

#[test]
fn attention_dp_ranks_convert_apart() {
    const R0A: u64 = 9223372036854775808;
    const R0B: u64 = 18446744073709551615;
    const R1A: u64 = 12345678901234567890;
    const R1B: u64 = 5764607523034234880;
    let v = json("attention_dp.json");
    let ranks = convert(events("attention_dp.json"), BS);
    assert_eq!(ranks.keys().copied().collect::<Vec<_>>(), vec![0, 1]);
    let (r0, r1) = (&ranks[&0], &ranks[&1]);
    // Each rank numbers its own events.
    assert_eq!(
        (r0.ids.as_slice(), r1.ids.as_slice()),
        (&[0, 1, 2][..], &[0, 1, 2][..])
    );
    no_drops(r0);
    no_drops(r1);
    assert_eq!(r0.converter.capacity(), Some(4096));
    assert_eq!(
        r0.events,
        vec![
            stored(None, vec![text(&v, 2, 0, R0A)]),
            stored(Some(R0A), vec![text(&v, 4, 0, R0B)]),
        ]
    );
    assert_eq!(
        r1.events,
        vec![
            stored(None, vec![text(&v, 3, 0, R1A), text(&v, 3, 1, R1B)]),
            removed(&[R1B]),
        ]
    );
}

#[test]
fn unknown_types_and_keys_are_skipped() {
    const U1: u64 = 13510798882111488000;
    const U2: u64 = 8070450532247928832;
    let page = events("unknown_type.json");
    assert_eq!(
        page.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        [5, 6, 7, 8]
    );
    assert_eq!(page[1].data, TrtData::Unknown);
    let v = json("unknown_type.json");
    let r = rank0("unknown_type.json");
    let drops: Vec<_> = r.outcomes.iter().map(|o| o.drops.clone()).collect();
    assert_eq!(
        drops,
        vec![vec![], vec![(DropReason::Other, 1)], vec![], vec![]]
    );
    assert_eq!(
        r.events,
        vec![
            stored(None, vec![text(&v, 0, 0, U1)]),
            stored(Some(U1), vec![text(&v, 2, 0, U2)]),
            removed(&[U2]),
        ]
    );
}

#[test]
fn a_partial_last_block_stays_out_of_the_index() {
    const P1: u64 = 14142135623730950488;
    const P2: u64 = 17320508075688772935;
    let v = json("partial_block.json");
    assert_eq!(tokens(&v, 1, 2).0.len(), 17);
    let r = rank0("partial_block.json");
    // Not a block-size mismatch: TensorRT-LLM stores a sequence's partial last block too.
    no_drops(&r);
    assert_eq!(
        r.events,
        vec![
            stored(None, vec![text(&v, 1, 0, P1), text(&v, 1, 1, P2)]),
            removed(&[P2]),
        ]
    );
}

#[test]
fn a_router_with_another_block_size_sees_a_mismatch() {
    // 32-token blocks at 16: too long. At 64: short blocks before the last.
    for (block_size, got) in [(16, 32), (64, 32)] {
        let ranks = convert(events("created_stored.json"), block_size);
        let r = &ranks[&0];
        assert!(r.events.is_empty());
        assert_eq!(
            r.outcomes[1].drops,
            vec![(DropReason::BlockSizeMismatch, 1)]
        );
        assert_eq!(r.outcomes[1].block_size_mismatch, Some(got));
    }
}

#[test]
fn every_fixture_round_trips_through_serde() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/trtllm");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 8, "{names:?}");
    for name in &names {
        let page = events(name);
        let again = events_of(&serde_json::to_vec(&page).unwrap());
        assert_eq!(again, page, "{name}");
    }
}

// --- Malformed and edge-case bodies --------------------------------------------------------

fn events_of(body: &[u8]) -> Vec<TrtEvent> {
    decode_page(body)
        .unwrap()
        .into_iter()
        .map(|e| match e {
            PageEntry::Event { event, .. } => event,
            PageEntry::Unreadable { error, .. } => panic!("{error}"),
        })
        .collect()
}

/// Each element of the array `body`, decoded as a page of its own: its unreadable id.
/// (In one page, consecutive unreadable elements are one entry: see
/// `a_run_of_unreadable_elements_is_one_entry`.)
fn unreadable_ids(body: &str) -> Vec<Option<u64>> {
    let elements: Vec<Box<serde_json::value::RawValue>> = serde_json::from_str(body).unwrap();
    elements
        .iter()
        .map(|e| {
            let page = decode_page(format!("[{}]", e.get()).as_bytes()).unwrap();
            match <[PageEntry; 1]>::try_from(page) {
                Ok([PageEntry::Unreadable { event_id, error }]) => {
                    assert!(!error.is_empty());
                    event_id
                }
                other => panic!("{}: {other:?}", e.get()),
            }
        })
        .collect()
}

#[test]
fn a_run_of_unreadable_elements_is_one_entry() {
    let page = decode_page(
        br#"[{"event_id": 4, "data": 0}, 1, 2, {"event_id": 6},
             {"event_id": 7, "data": {"type": "removed", "block_hashes": [1]}},
             3, {"event_id": 9, "data": {"type": "removed", "block_hashes": [1]}}]"#,
    )
    .unwrap();
    let shape: Vec<(bool, Option<u64>)> = page
        .iter()
        .map(|e| match e {
            PageEntry::Event { event, .. } => (true, Some(event.event_id)),
            PageEntry::Unreadable { event_id, .. } => (false, *event_id),
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            (false, Some(4)),
            (true, Some(7)),
            (false, None),
            (true, Some(9))
        ]
    );
    // A large page of junk is one entry.
    let junk = format!("[{}0]", "0,".repeat(100_000));
    assert_eq!(decode_page(junk.as_bytes()).unwrap().len(), 1);
}

#[test]
fn bodies_that_are_not_an_array_are_refused() {
    let whole = fixture("created_stored.json");
    let truncated = &whole[..whole.len() / 2];
    for body in [
        &b"not json"[..],
        b"",
        b"{}",
        br#"{"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [1]}}"#,
        b"42",
        b"\"[]\"",
        b"null",
        b"[1, 2",
        b"[] []",
        truncated,
    ] {
        match decode_page(body) {
            Err(TransportError::MalformedJson(m)) => assert!(m.contains("/kv_cache_events")),
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(body)),
        }
    }
    assert_eq!(decode_page(b" [ ] ").unwrap(), vec![]);
}

#[test]
fn bad_elements_are_unreadable_on_their_own() {
    // No event_id (or not a number): no id.
    assert_eq!(
        unreadable_ids(
            r#"[{"data": {"type": "removed", "block_hashes": [1]}, "window_size": 4096},
                {"event_id": "7", "data": {"type": "removed", "block_hashes": [1]}},
                {"event_id": -1, "data": {"type": "removed", "block_hashes": [1]}},
                1, "x", null, [], {}]"#
        ),
        vec![None; 8]
    );
    // An id, but bad data: the id is kept, so the fence still sees it.
    assert_eq!(
        unreadable_ids(
            r#"[{"event_id": 9, "data": {"type": "removed", "block_hashes": "oops"}},
                {"event_id": 10, "data": {"block_hashes": [1]}},
                {"event_id": 11},
                {"event_id": 12, "data": {"type": "stored", "parent_hash": null,
                 "blocks": [{"block_hash": 1.5, "tokens": []}]}},
                {"event_id": 13, "data": {"type": "removed",
                 "block_hashes": [18446744073709551616]}},
                {"event_id": 14, "data": {"type": "stored", "parent_hash": null,
                 "blocks": [{"block_hash": 1, "tokens": [{"token_id": 4294967296}]}]}},
                {"event_id": 15, "data": {"type": "created"}}]"#
        ),
        (9..=15).map(Some).collect::<Vec<_>>()
    );
    // Good elements around a bad one decode.
    let page = decode_page(
        br#"[{"event_id": 1, "data": {"type": "removed", "block_hashes": [1]}},
             {"event_id": 2, "data": {"type": "removed"}},
             {"event_id": 3, "data": {"type": "removed", "block_hashes": [3]}}]"#,
    )
    .unwrap();
    assert!(matches!(&page[0], PageEntry::Event { event, .. } if event.event_id == 1));
    assert!(matches!(
        &page[1],
        PageEntry::Unreadable {
            event_id: Some(2),
            ..
        }
    ));
    assert!(matches!(&page[2], PageEntry::Event { event, .. } if event.event_id == 3));
}

#[test]
fn oversized_bodies_are_refused_before_parsing() {
    let mut body = vec![b' '; MAX_PAGE_BYTES + 1];
    body[0] = b'[';
    body[MAX_PAGE_BYTES] = b']';
    match decode_page(&body) {
        Err(TransportError::Oversized { got, limit, .. }) => {
            assert_eq!((got, limit), (MAX_PAGE_BYTES + 1, MAX_PAGE_BYTES));
        }
        other => panic!("{other:?}"),
    }
    // At the limit exactly: accepted.
    body.truncate(MAX_PAGE_BYTES);
    body[MAX_PAGE_BYTES - 1] = b']';
    assert_eq!(decode_page(&body).unwrap(), vec![]);
}

#[test]
fn negative_hashes_bit_cast_to_the_same_block() {
    let signed = events_of(
        br#"[{"event_id": 0, "data": {"type": "stored", "parent_hash": -6148914691236517206,
              "blocks": [{"type": "stored_block", "block_hash": -1, "tokens": [],
                          "cache_level": 0, "priority": 35}]}},
             {"event_id": 1, "data": {"type": "removed",
              "block_hashes": [-1, -9223372036854775808, 0]}},
             {"event_id": 2, "data": {"type": "updated", "block_hash": -2,
              "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}}}]"#,
    );
    let unsigned = events_of(
        br#"[{"event_id": 0, "data": {"type": "stored", "parent_hash": 12297829382473034410,
              "blocks": [{"type": "stored_block", "block_hash": 18446744073709551615,
                          "tokens": [], "cache_level": 0, "priority": 35}]}},
             {"event_id": 1, "data": {"type": "removed",
              "block_hashes": [18446744073709551615, 9223372036854775808, 0]}},
             {"event_id": 2, "data": {"type": "updated", "block_hash": 18446744073709551614,
              "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}}}]"#,
    );
    assert_eq!(signed, unsigned);
    let TrtData::Removed { block_hashes } = &signed[1].data else {
        panic!()
    };
    assert_eq!(
        block_hashes,
        &[WireHash(u64::MAX), WireHash(1 << 63), WireHash(0)]
    );
    let TrtData::Stored { parent_hash, .. } = &signed[0].data else {
        panic!()
    };
    assert_eq!(*parent_hash, Some(WireHash(A)));
}

#[test]
fn digests_tell_events_apart() {
    let page = decode_page(
        br#"[{"event_id": 1, "data": {"type": "removed", "block_hashes": [1]}},
             {"event_id": 1, "data": {"type": "removed", "block_hashes": [1]}},
             {"event_id": 1, "data": {"type": "removed", "block_hashes": [2]}}]"#,
    )
    .unwrap();
    let d: Vec<u64> = page
        .iter()
        .map(|e| match e {
            PageEntry::Event { digest, .. } => *digest,
            PageEntry::Unreadable { .. } => panic!(),
        })
        .collect();
    assert_eq!(d[0], d[1]);
    assert_ne!(d[1], d[2]);
}

#[test]
fn written_events_decode_back_equal() {
    let tokens: Vec<TrtToken> = (0..BS).map(|t| TrtToken::text(t * 7919)).collect();
    let mut image = tokens.clone();
    image[3].token_extra_id = u64::MAX;
    let block = |h: u64, tokens: Vec<TrtToken>, lora_id, cache_level| TrtBlock {
        kind: Some("stored_block".into()),
        block_hash: WireHash(h),
        tokens,
        lora_id,
        cache_level,
        priority: Some(35),
    };
    let page = vec![
        TrtEvent {
            event_id: 0,
            data: TrtData::Created {
                num_blocks_per_cache_level: vec![8192, 16384],
            },
            window_size: Some(4096),
            attention_dp_rank: Some(1),
            layer_group_id: None,
        },
        TrtEvent {
            event_id: 1,
            data: TrtData::Stored {
                parent_hash: Some(WireHash(u64::MAX)),
                blocks: vec![
                    block(A, tokens.clone(), None, 0),
                    block(B, image, Some(3), 1),
                ],
            },
            window_size: None,
            attention_dp_rank: None,
            layer_group_id: None,
        },
        TrtEvent {
            event_id: 2,
            data: TrtData::Updated {
                block_hash: WireHash(B),
                cache_level: Some(Diff {
                    new_value: 0,
                    old_value: 1,
                }),
                priority: Some(Diff {
                    new_value: 80,
                    old_value: 35,
                }),
            },
            window_size: Some(4096),
            attention_dp_rank: Some(1),
            layer_group_id: None,
        },
        TrtEvent {
            event_id: 3,
            data: TrtData::Updated {
                block_hash: WireHash(0),
                cache_level: None,
                priority: None,
            },
            window_size: Some(128),
            attention_dp_rank: None,
            layer_group_id: None,
        },
        TrtEvent {
            event_id: 4,
            data: TrtData::Removed {
                block_hashes: vec![WireHash(A), WireHash(B), WireHash(C)],
            },
            window_size: Some(4096),
            attention_dp_rank: Some(0),
            layer_group_id: None,
        },
    ];
    let body = serde_json::to_vec(&page).unwrap();
    assert_eq!(events_of(&body), page);
    // The tags are written as trtllm-serve writes them.
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v[1]["data"]["type"], "stored");
    assert_eq!(v[1]["data"]["blocks"][0]["type"], "stored_block");
    assert_eq!(
        v[1]["data"]["blocks"][0]["tokens"][0]["type"],
        "unique_token"
    );
    assert_eq!(v[2]["data"]["type"], "updated");
    assert_eq!(
        v[2]["data"]["cache_level"],
        serde_json::json!({"type": "event_diff", "new_value": 0, "old_value": 1})
    );
}

// --- Model-based property test ---------------------------------------------------------

/// Tokens per block in the property test (small, to keep it fast).
const PBS: u32 = 4;

/// One step of a worker's life, over the blocks it holds (indices wrap around).
#[derive(Clone, Debug)]
enum Op {
    /// A chain of new blocks (`true`: on the GPU, `false`: on the host) under a held block or
    /// none, with a partial last block or not, under LoRA 5 or not.
    Store {
        parent: Option<usize>,
        gpu: Vec<bool>,
        partial: bool,
        lora: bool,
    },
    /// Some held blocks leave the cache, whatever their level.
    Remove(Vec<usize>),
    /// A held block moves between the GPU and the host.
    Move(usize),
    /// A held block's priority changes (with or without an unchanged level).
    Priority(usize, bool),
    /// A `created` saying the worker offloads.
    Created,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            proptest::option::of(any::<usize>()),
            proptest::collection::vec(proptest::bool::weighted(0.75), 1..5),
            proptest::bool::weighted(0.2),
            proptest::bool::weighted(0.2),
        )
            .prop_map(|(parent, gpu, partial, lora)| Op::Store {
                parent,
                gpu,
                partial,
                lora
            }),
        2 => proptest::collection::vec(any::<usize>(), 1..4).prop_map(Op::Remove),
        3 => any::<usize>().prop_map(Op::Move),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(i, l)| Op::Priority(i, l)),
        1 => Just(Op::Created),
    ]
}

/// Where a held block is, in the reference model.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Where {
    Gpu,
    Host,
    /// A partial block at level 0 (`true`) or 1.
    Partial(bool),
}

/// The reference: what the worker holds, and what a full block was stored with.
#[derive(Default)]
struct Reference {
    held: Vec<u64>,
    at: HashMap<u64, Where>,
    /// Full blocks: (parent, tokens hash).
    meta: HashMap<u64, (Option<u64>, TokensHash)>,
    next: u64,
}

impl Reference {
    fn fresh(&mut self) -> u64 {
        self.next += 1;
        // Spread over the whole u64 range (top bit included), still distinct.
        self.next.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    fn pick(&self, i: usize) -> Option<u64> {
        (!self.held.is_empty()).then(|| self.held[i % self.held.len()])
    }

    fn forget(&mut self, h: u64) {
        self.held.retain(|&x| x != h);
        self.at.remove(&h);
        self.meta.remove(&h);
    }

    /// The TensorRT-LLM event for `op`, applied to the reference (`None`: nothing to do).
    fn step(&mut self, op: &Op) -> Option<TrtData> {
        match op {
            Op::Store {
                parent,
                gpu,
                partial,
                lora,
            } => {
                let parent = parent.and_then(|i| self.pick(i));
                let lora_id = lora.then_some(5u64);
                let seed = lora_seed(lora_id.map(|l| l.to_string()).as_deref());
                let mut prev = parent;
                let mut blocks = Vec::new();
                for &g in gpu {
                    let h = self.fresh();
                    let ids: Vec<u32> = (0..PBS).map(|i| (h as u32).wrapping_add(i)).collect();
                    blocks.push(TrtBlock {
                        kind: None,
                        block_hash: WireHash(h),
                        tokens: ids.iter().copied().map(TrtToken::text).collect(),
                        lora_id,
                        cache_level: u32::from(!g),
                        priority: Some(35),
                    });
                    self.held.push(h);
                    self.at.insert(h, if g { Where::Gpu } else { Where::Host });
                    self.meta.insert(h, (prev, tokens_hash(&ids, seed)));
                    prev = Some(h);
                }
                if *partial {
                    let h = self.fresh();
                    blocks.push(TrtBlock {
                        kind: None,
                        block_hash: WireHash(h),
                        tokens: vec![TrtToken::text(1); (h % u64::from(PBS - 1)) as usize + 1],
                        lora_id,
                        cache_level: 0,
                        priority: Some(35),
                    });
                    self.held.push(h);
                    self.at.insert(h, Where::Partial(true));
                }
                Some(TrtData::Stored {
                    parent_hash: parent.map(WireHash),
                    blocks,
                })
            }
            Op::Remove(picks) => {
                let mut hashes: Vec<u64> = picks.iter().filter_map(|&i| self.pick(i)).collect();
                hashes.sort_unstable();
                hashes.dedup();
                if hashes.is_empty() {
                    return None;
                }
                for &h in &hashes {
                    self.forget(h);
                }
                Some(TrtData::Removed {
                    block_hashes: hashes.into_iter().map(WireHash).collect(),
                })
            }
            Op::Move(i) => {
                let h = self.pick(*i)?;
                let at = self.at.get_mut(&h).unwrap();
                let (old, new) = match *at {
                    Where::Gpu => (0, 1),
                    Where::Host => (1, 0),
                    Where::Partial(g) => (i64::from(!g), i64::from(g)),
                };
                *at = match *at {
                    Where::Gpu => Where::Host,
                    Where::Host => Where::Gpu,
                    Where::Partial(g) => Where::Partial(!g),
                };
                Some(TrtData::Updated {
                    block_hash: WireHash(h),
                    cache_level: Some(Diff {
                        new_value: new,
                        old_value: old,
                    }),
                    priority: None,
                })
            }
            Op::Priority(i, with_level) => {
                let h = self.pick(*i)?;
                let level = i64::from(!matches!(self.at[&h], Where::Gpu | Where::Partial(true)));
                Some(TrtData::Updated {
                    block_hash: WireHash(h),
                    cache_level: with_level.then_some(Diff {
                        new_value: level,
                        old_value: level,
                    }),
                    priority: Some(Diff {
                        new_value: 90,
                        old_value: 35,
                    }),
                })
            }
            Op::Created => Some(TrtData::Created {
                num_blocks_per_cache_level: vec![1 << 16, 1 << 17],
            }),
        }
    }

    /// The full blocks on the GPU: what the index should hold.
    fn gpu(&self) -> BTreeSet<u64> {
        self.at
            .iter()
            .filter(|&(_, &w)| w == Where::Gpu)
            .map(|(&h, _)| h)
            .collect()
    }
}

/// The index, simplified: GPU blocks held, by engine hash, with how many copies.
#[derive(Default)]
struct Held(HashMap<u64, u32>);

impl Held {
    /// Applies engine events, checking each store against the reference.
    fn apply(&mut self, events: &[KvEvent], reference: &Reference) -> Result<(), TestCaseError> {
        for e in events {
            match e {
                KvEvent::Stored { parent, blocks } => {
                    let mut prev = parent.map(|p| p.0);
                    for b in blocks {
                        let h = b.engine_hash.0;
                        let want = reference.meta.get(&h).copied();
                        prop_assert_eq!(want, Some((prev, b.tokens_hash)), "block {}", h);
                        let n = self.0.entry(h).or_default();
                        *n += 1;
                        prop_assert_eq!(*n, 1, "a second copy of {}", h);
                        prev = Some(h);
                    }
                }
                KvEvent::Removed { blocks } => {
                    for b in blocks {
                        prop_assert!(self.0.remove(&b.0).is_some(), "{} is not held", b.0);
                    }
                }
                KvEvent::Cleared => prop_assert!(false, "the converter never clears"),
            }
        }
        Ok(())
    }
}

proptest! {
    #[test]
    fn converter_tracks_the_gpu_blocks(ops in proptest::collection::vec(op(), 1..60)) {
        let mut reference = Reference::default();
        let mut converter = RankConverter::new();
        let mut held = Held::default();
        let mut out = Vec::new();
        for op in &ops {
            let Some(data) = reference.step(op) else { continue };
            out.clear();
            let outcome = converter.convert(data, PBS, &mut out);
            prop_assert!(outcome.drops.is_empty(), "{:?}: {:?}", op, outcome);
            prop_assert_eq!(outcome.block_size_mismatch, None);
            held.apply(&out, &reference)?;
            let now: BTreeSet<u64> = held.0.keys().copied().collect();
            prop_assert_eq!(now, reference.gpu(), "after {:?}", op);
        }
    }
}
