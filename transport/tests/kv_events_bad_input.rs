//! The msgpack KV-event decoder on hostile, truncated, odd and policy-violating input.
//!
//! Nothing here may panic, and nothing may allocate out of proportion to the input (checked
//! with a per-thread counting allocator).

mod common;

use common::{V, bytes};

use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use transport::kv_events::{
    ConvertConfig, MAX_BATCH_BYTES, WireBatch, WireEvent, WireExtraItem, WireExtraKeys, convert,
    decode_batch,
};
use transport::{DropReason, TransportError};

// ---------------------------------------------------------------------------------------
// Per-thread allocation counter (tests run on parallel threads).

struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards every call to `System` unchanged; the counter is a thread-local `Cell`
// with const initialisation, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|c| c.set(c.get().saturating_add(layout.size())));
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATED.try_with(|c| c.set(c.get().saturating_add(new_size)));
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Bytes allocated on this thread while running `f`.
fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = ALLOCATED.with(Cell::get);
    let out = f();
    (out, ALLOCATED.with(Cell::get) - before)
}

// ---------------------------------------------------------------------------------------
fn toks(n: u64) -> V {
    V::A((0..n).map(|t| V::U(t * 1013)).collect())
}

/// `[ts, events, dp_rank]`.
fn batch(events: Vec<V>) -> V {
    V::A(vec![V::F(1.0), V::A(events), V::U(0)])
}

/// A positional store with exactly `len` elements (6..): the vLLM fields, then filler.
fn stored_positional(len: usize) -> V {
    let mut e = vec![
        V::S("BlockStored"),
        V::A(vec![V::U(1), V::U(2)]),
        V::Nil,
        toks(32),
        V::U(16),
        V::Nil,
        V::S("GPU"),
        V::Nil,
        // vLLM 0.32's extra keys: block 1 with a multimodal item, a salt and a digest.
        V::A(vec![
            V::Nil,
            V::A(vec![
                V::A(vec![V::S("img"), V::U(3)]),
                V::S("k"),
                V::B(vec![1]),
            ]),
        ]),
        V::U(0),
        V::S("full_attention"),
        V::Nil,
    ];
    e.truncate(len);
    while e.len() < len {
        e.push(V::M(vec![(V::S("future"), V::A(vec![V::F(0.5), V::Nil]))]));
    }
    V::A(e)
}

fn stored_map(extra: Vec<(V, V)>) -> V {
    let mut m = vec![
        (V::S("type"), V::S("BlockStored")),
        (V::S("block_hashes"), V::A(vec![V::U(1), V::U(2)])),
        (V::S("parent_block_hash"), V::Nil),
        (V::S("token_ids"), toks(32)),
        (V::S("block_size"), V::U(16)),
    ];
    m.extend(extra);
    V::M(m)
}

const BS: ConvertConfig = ConvertConfig { block_size: 16 };

fn malformed(b: &[u8]) -> String {
    match decode_batch(b) {
        Err(TransportError::MalformedMsgpack(r)) => r,
        other => panic!("expected MalformedMsgpack, got {other:?}"),
    }
}

/// Hand-built batches covering every shape.
fn corpus() -> Vec<Vec<u8>> {
    let mut out = vec![
        bytes(&batch(vec![
            stored_positional(6),
            stored_positional(12),
            V::A(vec![
                V::S("BlockRemoved"),
                V::A(vec![V::I(-3)]),
                V::S("GPU"),
            ]),
            V::A(vec![V::S("AllBlocksCleared")]),
        ])),
        bytes(&batch(vec![
            stored_map(vec![(V::S("lora_name"), V::S("a"))]),
            V::M(vec![
                (V::S("block_hashes"), V::A(vec![V::B(vec![7; 32])])),
                (V::S("type"), V::S("BlockRemoved")),
            ]),
            V::M(vec![(V::S("type"), V::S("Mystery")), (V::S("x"), V::U(1))]),
        ])),
        bytes(&V::M(vec![
            (V::S("ts"), V::U(5)),
            (V::S("events"), V::A(vec![stored_positional(14)])),
            (V::S("dp_rank"), V::U(1)),
        ])),
    ];
    if let Some(dir) = data_dir() {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "msgpack") {
                out.push(std::fs::read(p).unwrap());
            }
        }
    }
    out
}

fn data_dir() -> Option<&'static Path> {
    let dir = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/data/kv_events"
    ));
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!(
            "note: {} is absent; using hand-built batches only",
            dir.display()
        );
        None
    }
}

// ---------------------------------------------------------------------------------------

#[test]
fn corpus_decodes() {
    for b in corpus() {
        let batch = decode_batch(&b).unwrap();
        assert!(!batch.events.is_empty());
    }
}

#[test]
fn every_truncation_is_an_error_without_panic() {
    for b in corpus() {
        for len in 0..b.len() {
            // A strict prefix of one msgpack value is never a whole value.
            assert!(decode_batch(&b[..len]).is_err(), "prefix {len} of {b:02x?}");
        }
    }
}

#[test]
fn every_single_byte_mutation_is_handled() {
    for b in corpus() {
        for i in 0..b.len() {
            for x in [
                0x00u8, 0x7f, 0x80, 0x90, 0xc0, 0xc1, 0xc4, 0xcf, 0xd3, 0xdc, 0xdd, 0xdf, 0xff,
            ] {
                let mut m = b.clone();
                m[i] = x;
                if let Ok(batch) = decode_batch(&m) {
                    let _ = convert(batch, &BS);
                }
            }
        }
    }
}

#[test]
fn trailing_bytes_are_an_error() {
    let mut b = bytes(&batch(vec![V::A(vec![V::S("AllBlocksCleared")])]));
    b.push(0xc0);
    assert!(malformed(&b).contains("trailing"));
}

#[test]
fn oversized_is_refused_before_decoding() {
    let b = vec![0u8; MAX_BATCH_BYTES + 1];
    match decode_batch(&b) {
        Err(TransportError::Oversized { got, limit, .. }) => {
            assert_eq!(got, MAX_BATCH_BYTES + 1);
            assert_eq!(limit, MAX_BATCH_BYTES);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        decode_batch(&b).unwrap_err().reason(),
        DropReason::Oversized
    );
}

#[test]
fn huge_declared_lengths_do_not_allocate() {
    let u32max = [0xff, 0xff, 0xff, 0xff];
    let arr32 = |rest: &[u8]| [&[0xdd][..], &u32max, rest].concat();
    let map32 = |rest: &[u8]| [&[0xdf][..], &u32max, rest].concat();
    let stored_head = || {
        let mut h = vec![0x94];
        rmp::encode::write_str(&mut h, "BlockStored").unwrap();
        h
    };
    let cases: Vec<Vec<u8>> = vec![
        // Outer array, outer map.
        arr32(&[]),
        map32(&[]),
        // Events array.
        [&[0x92, 0x00][..], &arr32(&[0xc0])].concat(),
        // Event array, event map.
        [&[0x92, 0x00, 0x91][..], &arr32(&[])].concat(),
        [&[0x92, 0x00, 0x91][..], &map32(&[])].concat(),
        // block_hashes, token_ids.
        [&[0x92, 0x00, 0x91][..], &stored_head(), &arr32(&[1, 2])].concat(),
        [
            &[0x92, 0x00, 0x91][..],
            &stored_head(),
            &[0x90, 0xc0],
            &arr32(&[1, 2]),
        ]
        .concat(),
        // A 4 GiB string tag, a 4 GiB bin hash.
        [&[0x92, 0x00, 0x91, 0x91, 0xdb][..], &u32max].concat(),
        [
            &[0x92, 0x00, 0x91][..],
            &stored_head(),
            &[0x91, 0xc6],
            &u32max,
        ]
        .concat(),
        // A 4 GiB ext in a skipped trailing element; a huge skipped nested array.
        [&[0x94, 0x00, 0x90, 0xc0, 0xc9][..], &u32max, &[1]].concat(),
        [&[0x94, 0x00, 0x90, 0xc0][..], &arr32(&[0x91, 0x91])].concat(),
        [&[0x94, 0x00, 0x90, 0xc0][..], &map32(&[])].concat(),
    ];
    for c in cases {
        let (r, bytes) = allocated_by(|| decode_batch(&c));
        assert!(
            matches!(r, Err(TransportError::MalformedMsgpack(_))),
            "{c:02x?}: {r:?}"
        );
        assert!(bytes < 4096, "{c:02x?} allocated {bytes} bytes");
    }
}

#[test]
fn allocation_is_proportional_to_input() {
    let b = bytes(&batch((0..64).map(|_| stored_positional(12)).collect()));
    let (r, n) = allocated_by(|| decode_batch(&b));
    r.unwrap();
    // Tokens widen to 4 bytes, hashes to 8, plus per-event structs.
    assert!(n < b.len() * 8, "{n} bytes for a {} byte batch", b.len());
}

#[test]
fn negative_and_oversized_token_ids_are_malformed() {
    for bad in [
        V::I(-1),
        V::U(u64::from(u32::MAX) + 1),
        V::F(1.0),
        V::S("1"),
    ] {
        let b = bytes(&batch(vec![V::A(vec![
            V::S("BlockStored"),
            V::A(vec![V::U(1)]),
            V::Nil,
            V::A(vec![V::U(5), bad.clone()]),
        ])]));
        assert!(malformed(&b).contains("token id"), "{bad:?}");
    }
    // u32::MAX itself is fine, as is a signed marker with a non-negative value.
    let b = bytes(&batch(vec![V::A(vec![
        V::S("BlockStored"),
        V::A(vec![V::U(1)]),
        V::Nil,
        V::A(vec![V::U(u64::from(u32::MAX)), V::Raw(vec![0xd0, 0x05])]),
    ])]));
    let WireEvent::Stored { token_ids, .. } = &decode_batch(&b).unwrap().events[0] else {
        panic!()
    };
    assert_eq!(token_ids, &[u32::MAX, 5]);
}

#[test]
fn wrong_types_are_malformed() {
    let ev = |e: Vec<V>| bytes(&batch(vec![V::A(e)]));
    let cases = vec![
        // Not a batch.
        bytes(&V::U(1)),
        bytes(&V::S("x")),
        bytes(&V::A(vec![V::F(1.0)])),
        // ts / events / dp_rank types.
        bytes(&V::A(vec![V::S("now"), V::A(vec![])])),
        bytes(&V::A(vec![V::F(1.0), V::M(vec![])])),
        bytes(&V::A(vec![V::F(1.0), V::A(vec![]), V::S("0")])),
        bytes(&V::A(vec![V::F(1.0), V::A(vec![]), V::I(-1)])),
        bytes(&V::A(vec![V::F(1.0), V::A(vec![]), V::U(1 << 40)])),
        // Events.
        bytes(&batch(vec![V::U(1)])),
        bytes(&batch(vec![V::A(vec![])])),
        ev(vec![V::U(3), V::A(vec![])]),
        ev(vec![V::S("BlockStored"), V::A(vec![V::U(1)]), V::Nil]),
        ev(vec![V::S("BlockStored"), V::U(1), V::Nil, toks(16)]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::S("ab")]),
            V::Nil,
            toks(16),
        ]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::B(vec![])]),
            V::Nil,
            toks(16),
        ]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::B(vec![1; 33])]),
            V::Nil,
            toks(16),
        ]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::F(1.0)]),
            V::Nil,
            toks(16),
        ]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::U(1)]),
            V::S("p"),
            toks(16),
        ]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::U(1)]),
            V::Nil,
            V::U(16),
        ]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::U(1)]),
            V::Nil,
            toks(16),
            V::I(-16),
        ]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::U(1)]),
            V::Nil,
            toks(16),
            V::S("16"),
        ]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::U(1)]),
            V::Nil,
            toks(16),
            V::U(16),
            V::U(u64::MAX),
        ]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::U(1)]),
            V::Nil,
            toks(16),
            V::U(16),
            V::Nil,
            V::U(1),
        ]),
        ev(vec![
            V::S("BlockStored"),
            V::A(vec![V::U(1)]),
            V::Nil,
            toks(16),
            V::U(16),
            V::Nil,
            V::Raw(vec![0xa2, 0xff, 0xfe]), // invalid UTF-8 medium
        ]),
        ev(vec![V::S("BlockRemoved")]),
        ev(vec![V::S("BlockRemoved"), V::Nil]),
        // Map events.
        bytes(&batch(vec![V::M(vec![])])),
        bytes(&batch(vec![V::M(vec![(
            V::S("block_hashes"),
            V::A(vec![]),
        )])])),
        bytes(&batch(vec![V::M(vec![(V::S("type"), V::U(1))])])),
        bytes(&batch(vec![V::M(vec![(
            V::S("type"),
            V::S("BlockRemoved"),
        )])])),
        bytes(&batch(vec![V::M(vec![
            (V::S("type"), V::S("BlockStored")),
            (V::S("block_hashes"), V::A(vec![V::U(1)])),
        ])])),
        // Outer map without events, with a bad dp rank.
        bytes(&V::M(vec![(V::S("ts"), V::F(1.0))])),
        bytes(&V::M(vec![
            (V::S("events"), V::A(vec![])),
            (V::S("dp_rank"), V::S("one")),
        ])),
        // Reserved marker in a skipped element.
        bytes(&V::A(vec![
            V::F(1.0),
            V::A(vec![]),
            V::U(0),
            V::Raw(vec![0xc1]),
        ])),
    ];
    for (i, c) in cases.iter().enumerate() {
        let r = malformed(c);
        assert!(!r.is_empty(), "case {i}");
        assert_eq!(
            decode_batch(c).unwrap_err().reason(),
            DropReason::MalformedMsgpack
        );
    }
}

fn stored_with(block_size: Option<u64>, medium: Option<&'static str>, ntoks: u64) -> V {
    V::A(vec![
        V::S("BlockStored"),
        V::A(vec![V::U(1), V::U(2)]),
        V::Nil,
        toks(ntoks),
        block_size.map_or(V::Nil, V::U),
        V::Nil,
        medium.map_or(V::Nil, V::S),
    ])
}

#[test]
fn block_size_mismatch_is_dropped_and_reported() {
    let b = bytes(&batch(vec![
        stored_with(Some(32), None, 64),
        stored_with(Some(8), None, 16),
        stored_with(Some(16), None, 32),
        stored_with(None, None, 32),
    ]));
    let c = convert(decode_batch(&b).unwrap(), &BS);
    assert_eq!(c.block_size_mismatch, Some(32));
    assert_eq!(c.drops, vec![(DropReason::BlockSizeMismatch, 2)]);
    assert_eq!(c.events.len(), 2);
    // A zero router block size accepts no stores.
    let c = convert(decode_batch(&b).unwrap(), &ConvertConfig { block_size: 0 });
    assert!(c.events.is_empty());
    assert_eq!(c.drops, vec![(DropReason::BlockSizeMismatch, 4)]);
}

#[test]
fn non_gpu_medium_is_dropped() {
    let b = bytes(&batch(vec![
        stored_with(Some(16), Some("CPU"), 32),
        stored_with(Some(16), Some("gpu"), 32),
        stored_with(Some(16), Some("GPU"), 32),
        V::A(vec![
            V::S("BlockRemoved"),
            V::A(vec![V::U(1)]),
            V::S("DISK"),
        ]),
        V::A(vec![V::S("BlockRemoved"), V::A(vec![V::U(1)]), V::Nil]),
    ]));
    let c = convert(decode_batch(&b).unwrap(), &BS);
    assert_eq!(c.drops, vec![(DropReason::NonGpuMedium, 2)]);
    assert_eq!(c.events.len(), 3);
}

#[test]
fn token_count_mismatch_is_dropped() {
    let b = bytes(&batch(vec![
        stored_with(Some(16), None, 31),
        stored_with(Some(16), None, 33),
        stored_with(None, None, 16),
        stored_with(Some(16), None, 32),
    ]));
    let c = convert(decode_batch(&b).unwrap(), &BS);
    assert_eq!(c.drops, vec![(DropReason::TokenCountMismatch, 3)]);
    assert_eq!(c.events.len(), 1);
}

#[test]
fn empty_block_lists_produce_nothing() {
    let b = bytes(&batch(vec![
        V::A(vec![
            V::S("BlockStored"),
            V::A(vec![]),
            V::Nil,
            V::A(vec![]),
        ]),
        V::A(vec![V::S("BlockRemoved"), V::A(vec![])]),
    ]));
    let c = convert(decode_batch(&b).unwrap(), &BS);
    assert!(c.events.is_empty());
    assert!(c.drops.is_empty());
}

#[test]
fn unknown_event_types_are_skipped_and_counted() {
    let b = bytes(&batch(vec![
        V::A(vec![V::S("BlockPinned"), V::A(vec![V::U(1)]), V::M(vec![])]),
        V::A(vec![V::S("AllBlocksCleared")]),
        V::M(vec![
            (V::S("nested"), V::A(vec![V::A(vec![V::Nil])])),
            (V::S("type"), V::S("Mystery")),
        ]),
        V::A(vec![V::S("")]),
    ]));
    let d = decode_batch(&b).unwrap();
    assert_eq!(d.unknown_events, 3);
    assert_eq!(d.events, vec![WireEvent::Cleared]);
    let c = convert(d, &BS);
    assert_eq!(c.drops, vec![(DropReason::Other, 3)]);
    assert_eq!(c.events.len(), 1);
}

#[test]
fn map_events_with_unknown_keys_in_any_order() {
    let e = V::M(vec![
        (
            V::S("extra_keys"),
            V::A(vec![
                V::A(vec![V::S("ad")]),
                V::A(vec![V::S("ad"), V::A(vec![V::S("img"), V::U(2)])]),
            ]),
        ),
        (
            V::S("future"),
            V::A(vec![V::Nil, V::M(vec![(V::S("a"), V::B(vec![1]))])]),
        ),
        (V::S("token_ids"), toks(32)),
        (V::B(vec![1, 2]), V::U(1)),
        (V::S("medium"), V::S("GPU")),
        (V::S("lora_name"), V::S("ad")),
        (V::S("block_hashes"), V::A(vec![V::U(1), V::I(-2)])),
        (V::S("kv_cache_spec_kind"), V::S("sliding_window")),
        (V::S("lora_id"), V::I(-3)),
        (V::S("type"), V::S("BlockStored")),
        (V::S("parent_block_hash"), V::U(9)),
        (V::S("block_size"), V::U(16)),
    ]);
    let d = decode_batch(&bytes(&batch(vec![e]))).unwrap();
    assert_eq!(
        d.events,
        vec![WireEvent::Stored {
            block_hashes: vec![1, -2i64 as u64],
            parent: Some(9),
            token_ids: (0..32).map(|t| t * 1013).collect(),
            block_size: Some(16),
            lora_id: Some(-3),
            lora_name: Some("ad".into()),
            medium: Some("GPU".into()),
            extra_keys: Some(WireExtraKeys::Blocks(vec![
                Some(vec![WireExtraItem::Str("ad".into())]),
                Some(vec![
                    WireExtraItem::Str("ad".into()),
                    WireExtraItem::Mm("img".into(), 2)
                ]),
            ])),
        }]
    );
    // Same keys with an extra map, `type` first.
    let d = decode_batch(&bytes(&batch(vec![stored_map(vec![
        (
            V::S("unknown"),
            V::M(vec![(V::S("x"), V::A(vec![V::U(1)]))]),
        ),
        (V::S("medium"), V::S("GPU")),
    ])])))
    .unwrap();
    assert!(matches!(&d.events[0], WireEvent::Stored { medium: Some(m), .. } if m == "GPU"));
}

#[test]
fn positional_stores_of_every_length() {
    for len in (6..=12).chain([14]) {
        let d = decode_batch(&bytes(&batch(vec![stored_positional(len)])))
            .unwrap_or_else(|e| panic!("{len}: {e}"));
        let WireEvent::Stored {
            block_hashes,
            token_ids,
            block_size,
            medium,
            ..
        } = &d.events[0]
        else {
            panic!("{len}")
        };
        assert_eq!(block_hashes, &[1, 2]);
        assert_eq!(token_ids.len(), 32);
        assert_eq!(*block_size, Some(16));
        assert_eq!(medium.is_some(), len >= 7, "{len}");
        let c = convert(d, &BS);
        assert_eq!(c.events.len(), 1, "{len}");
        assert!(c.drops.is_empty());
    }
    // The minimum: tag, hashes, parent, tokens.
    let d = decode_batch(&bytes(&batch(vec![stored_positional(4)]))).unwrap();
    assert!(matches!(
        &d.events[0],
        WireEvent::Stored {
            block_size: None,
            ..
        }
    ));
}

#[test]
fn outer_array_with_extra_trailing_elements() {
    let b = bytes(&V::A(vec![
        V::U(7),
        V::A(vec![V::A(vec![V::S("AllBlocksCleared")])]),
        V::Nil,
        V::M(vec![(V::S("future"), V::A(vec![V::U(1), V::S("x")]))]),
        V::B(vec![0; 40]),
    ]));
    let d = decode_batch(&b).unwrap();
    assert_eq!(
        d,
        WireBatch {
            ts: Some(7.0),
            dp_rank: None,
            events: vec![WireEvent::Cleared],
            unknown_events: 0,
        }
    );
}

#[test]
fn outer_map_form() {
    for key in ["data_parallel_rank", "dp_rank"] {
        let b = bytes(&V::M(vec![
            (V::S("unknown"), V::A(vec![V::M(vec![])])),
            (V::S(key), V::U(4)),
            (
                V::S("events"),
                V::A(vec![V::A(vec![V::S("AllBlocksCleared")])]),
            ),
            (V::U(1), V::U(2)),
            (V::S("ts"), V::F(3.5)),
        ]));
        let d = decode_batch(&b).unwrap();
        assert_eq!(d.dp_rank, Some(4));
        assert_eq!(d.ts, Some(3.5));
        assert_eq!(d.events, vec![WireEvent::Cleared]);
        assert_eq!(convert(d, &BS).dp_rank, engine::DpRank(4));
    }
}

#[test]
fn hash_forms() {
    let b = bytes(&batch(vec![V::A(vec![
        V::S("BlockRemoved"),
        V::A(vec![
            V::U(5),
            V::I(-1),
            V::Raw(vec![0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]),
            V::B(vec![0x12, 0x34]),
            V::B((1..=32).collect()),
            V::Raw([&[0xc5, 0x00, 0x03][..], &[9, 8, 7]].concat()),
        ]),
    ])]));
    let d = decode_batch(&b).unwrap();
    assert_eq!(
        d.events,
        vec![WireEvent::Removed {
            block_hashes: vec![
                5,
                u64::MAX,
                1 << 63,
                0x1234,
                u64::from_be_bytes([25, 26, 27, 28, 29, 30, 31, 32]),
                0x090807,
            ],
            medium: None,
        }]
    );
}

#[test]
fn timestamps_of_every_numeric_type() {
    for (ts, want) in [
        (V::F(1.25), Some(1.25)),
        (V::Raw(vec![0xca, 0x3f, 0xa0, 0, 0]), Some(1.25)),
        (V::U(3), Some(3.0)),
        (V::I(-3), Some(-3.0)),
        (V::Nil, None),
    ] {
        let d = decode_batch(&bytes(&V::A(vec![ts, V::A(vec![])]))).unwrap();
        assert_eq!(d.ts, want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(b) = decode_batch(&data) {
            let _ = convert(b, &BS);
        }
    }

    #[test]
    fn valid_prefix_then_random_bytes_never_panic(
        which in 0usize..3,
        cut in 0usize..400,
        tail in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let corpus = corpus();
        let b = &corpus[which % corpus.len()];
        let mut data = b[..cut.min(b.len())].to_vec();
        data.extend_from_slice(&tail);
        let (r, n) = allocated_by(|| decode_batch(&data));
        prop_assert!(n <= 16 * data.len() + 4096);
        if let Ok(b) = r {
            let _ = convert(b, &BS);
        }
    }
}
