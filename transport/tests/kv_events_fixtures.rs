//! The vLLM / SGLang msgpack decoder against recorded fixtures and hand-built batches.
//!
//! The recorded fixtures live outside the product (`../shared/data/kv_events`); where they are
//! absent those tests print a note and pass. The hand-built batches below cover every shape
//! on their own.

mod common;

use common::{V, bytes};

use engine::event::{KvEvent, StoredBlock};
use engine::hash::{
    BASE_SEED, ExtraKey, chain, fold_extras, lora_seed, seq_hashes, seq_hashes_salted, tokens_hash,
    tokens_hashes,
};
use engine::{DpRank, EngineHash, SeqHash, TokensHash};
use serde_json::Value;
use std::path::{Path, PathBuf};
use transport::DropReason;
use transport::kv_events::{
    ConvertConfig, WireBatch, WireEvent, WireExtraItem, WireExtraKeys, convert, decode_batch,
};

const BS: ConvertConfig = ConvertConfig { block_size: 16 };

fn data_dir() -> Option<PathBuf> {
    let dir = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/data/kv_events"
    ));
    if dir.join("fixtures.json").is_file() {
        Some(dir.to_path_buf())
    } else {
        eprintln!(
            "note: {} is absent; recorded-fixture checks skipped",
            dir.display()
        );
        None
    }
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

// ---------------------------------------------------------------------------------------
fn toks(r: std::ops::Range<u32>) -> V {
    V::A(r.map(|t| V::U(u64::from(t) * 7919)).collect())
}

fn tok_vec(r: std::ops::Range<u32>) -> Vec<u32> {
    r.map(|t| t * 7919).collect()
}

/// Hand-built batches, one per generation of the format, with their expected decoding.
fn hand_built() -> Vec<(&'static str, Vec<u8>, WireBatch)> {
    let mut cases = Vec::new();

    // vLLM ~0.9: [ts, events], 6-element stores, signed hashes.
    let b = V::A(vec![
        V::F(1.5),
        V::A(vec![
            V::A(vec![
                V::S("BlockStored"),
                V::A(vec![V::I64(-5), V::I(-7_208_924_346_116_347_423)]),
                V::Nil,
                toks(0..32),
                V::U(16),
                V::Nil,
            ]),
            V::A(vec![V::S("BlockRemoved"), V::A(vec![V::I(-5)])]),
            V::A(vec![V::S("AllBlocksCleared")]),
        ]),
    ]);
    cases.push((
        "v0_9_array",
        bytes(&b),
        WireBatch {
            ts: Some(1.5),
            dp_rank: None,
            events: vec![
                WireEvent::Stored {
                    block_hashes: vec![-5i64 as u64, -7_208_924_346_116_347_423i64 as u64],
                    parent: None,
                    token_ids: tok_vec(0..32),
                    block_size: Some(16),
                    lora_id: None,
                    lora_name: None,
                    medium: None,
                    extra_keys: None,
                },
                WireEvent::Removed {
                    block_hashes: vec![-5i64 as u64],
                    medium: None,
                },
                WireEvent::Cleared,
            ],
            unknown_events: 0,
        },
    ));

    // vLLM 0.10+: [ts, events, dp_rank], 12-element stores with extra keys (the adapter's
    // name on every block) and a nested trailing value, u64 hashes, a LoRA adapter by name,
    // a removal with a trailing group index.
    let b = V::A(vec![
        V::U(1_789_095_808),
        V::A(vec![
            V::A(vec![
                V::S("BlockStored"),
                V::A(vec![V::U64(u64::MAX - 1), V::U(3)]),
                V::U64(9_000_000_000_000_000_000),
                toks(100..132),
                V::U(16),
                V::U(2),
                V::S("GPU"),
                V::S("sql-adapter"),
                V::A(vec![
                    V::A(vec![V::S("sql-adapter")]),
                    V::A(vec![V::S("sql-adapter")]),
                ]),
                V::U(0),
                V::S("full_attention"),
                V::A(vec![V::S("x"), V::M(vec![])]),
            ]),
            V::A(vec![
                V::S("BlockRemoved"),
                V::A(vec![V::U64(u64::MAX - 1)]),
                V::S("GPU"),
                V::Nil,
            ]),
        ]),
        V::U(3),
    ]);
    cases.push((
        "array_full",
        bytes(&b),
        WireBatch {
            ts: Some(1_789_095_808.0),
            dp_rank: Some(3),
            events: vec![
                WireEvent::Stored {
                    block_hashes: vec![u64::MAX - 1, 3],
                    parent: Some(9_000_000_000_000_000_000),
                    token_ids: tok_vec(100..132),
                    block_size: Some(16),
                    lora_id: Some(2),
                    lora_name: Some("sql-adapter".into()),
                    medium: Some("GPU".into()),
                    extra_keys: Some(WireExtraKeys::Blocks(vec![
                        Some(vec![WireExtraItem::Str("sql-adapter".into())]),
                        Some(vec![WireExtraItem::Str("sql-adapter".into())]),
                    ])),
                },
                WireEvent::Removed {
                    block_hashes: vec![u64::MAX - 1],
                    medium: Some("GPU".into()),
                },
            ],
            unknown_events: 0,
        },
    ));

    // Current vLLM: map events, `type` first, 32-byte bin hashes; plus an unknown event type.
    let digest = |last: u8| -> Vec<u8> {
        let mut d: Vec<u8> = (0..32).map(|i| 0xa0 ^ i).collect();
        d[31] = last;
        d
    };
    let fold = |d: &[u8]| u64::from_be_bytes(d[d.len() - 8..].try_into().unwrap());
    let b = V::A(vec![
        V::F(2.25),
        V::A(vec![
            V::M(vec![
                (V::S("type"), V::S("BlockStored")),
                (V::S("block_hashes"), V::A(vec![V::B(digest(1))])),
                (V::S("parent_block_hash"), V::B(digest(0))),
                (V::S("token_ids"), toks(7..23)),
                (V::S("block_size"), V::U(16)),
                (V::S("lora_id"), V::Nil),
                (V::S("medium"), V::S("GPU")),
                (V::S("lora_name"), V::Nil),
                (V::S("extra_keys"), V::A(vec![V::Nil])),
                (V::S("group_idx"), V::U(0)),
            ]),
            V::M(vec![
                (V::S("type"), V::S("SomeFutureEvent")),
                (V::S("payload"), V::A(vec![V::U(1), V::M(vec![])])),
            ]),
            V::M(vec![
                (V::S("type"), V::S("BlockRemoved")),
                (V::S("block_hashes"), V::A(vec![V::B(digest(1))])),
                (V::S("medium"), V::S("GPU")),
            ]),
            V::M(vec![(V::S("type"), V::S("AllBlocksCleared"))]),
        ]),
        V::U(1),
    ]);
    cases.push((
        "map_events_bin_hashes",
        bytes(&b),
        WireBatch {
            ts: Some(2.25),
            dp_rank: Some(1),
            events: vec![
                WireEvent::Stored {
                    block_hashes: vec![fold(&digest(1))],
                    parent: Some(fold(&digest(0))),
                    token_ids: tok_vec(7..23),
                    block_size: Some(16),
                    lora_id: None,
                    lora_name: None,
                    medium: Some("GPU".into()),
                    extra_keys: Some(WireExtraKeys::Blocks(vec![None])),
                },
                WireEvent::Removed {
                    block_hashes: vec![fold(&digest(1))],
                    medium: Some("GPU".into()),
                },
                WireEvent::Cleared,
            ],
            unknown_events: 1,
        },
    ));

    // Outer map form, keys out of order, `type` last, LoRA by id only.
    let b = V::M(vec![
        (V::S("publisher"), V::M(vec![(V::S("a"), V::U(1))])),
        (
            V::S("events"),
            V::A(vec![
                V::M(vec![
                    (V::S("token_ids"), toks(0..16)),
                    (V::S("lora_id"), V::U(7)),
                    (V::U(99), V::S("non-string key")),
                    (V::S("block_hashes"), V::A(vec![V::U(42)])),
                    (V::S("parent_block_hash"), V::Nil),
                    (V::S("type"), V::S("BlockStored")),
                ]),
                V::A(vec![V::S("AllBlocksCleared"), V::U(5)]),
            ]),
        ),
        (V::S("data_parallel_rank"), V::U(2)),
        (V::S("ts"), V::Nil),
    ]);
    cases.push((
        "outer_map",
        bytes(&b),
        WireBatch {
            ts: None,
            dp_rank: Some(2),
            events: vec![
                WireEvent::Stored {
                    block_hashes: vec![42],
                    parent: None,
                    token_ids: tok_vec(0..16),
                    block_size: None,
                    lora_id: Some(7),
                    lora_name: None,
                    medium: None,
                    extra_keys: None,
                },
                WireEvent::Cleared,
            ],
            unknown_events: 0,
        },
    ));

    // SGLang: 7-element stores, one per page, signed parent.
    let b = V::A(vec![
        V::F(0.0),
        V::A(vec![
            V::A(vec![
                V::S("BlockStored"),
                V::A(vec![V::I(-1)]),
                V::Nil,
                toks(0..16),
                V::U(16),
                V::Nil,
                V::S("GPU"),
            ]),
            V::A(vec![
                V::S("BlockStored"),
                V::A(vec![V::U(2)]),
                V::I(-1),
                toks(16..32),
                V::U(16),
                V::Nil,
                V::S("GPU"),
            ]),
        ]),
        V::U(0),
    ]);
    cases.push((
        "sglang_array",
        bytes(&b),
        WireBatch {
            ts: Some(0.0),
            dp_rank: Some(0),
            events: vec![
                WireEvent::Stored {
                    block_hashes: vec![u64::MAX],
                    parent: None,
                    token_ids: tok_vec(0..16),
                    block_size: Some(16),
                    lora_id: None,
                    lora_name: None,
                    medium: Some("GPU".into()),
                    extra_keys: None,
                },
                WireEvent::Stored {
                    block_hashes: vec![2],
                    parent: Some(u64::MAX),
                    token_ids: tok_vec(16..32),
                    block_size: Some(16),
                    lora_id: None,
                    lora_name: None,
                    medium: Some("GPU".into()),
                    extra_keys: None,
                },
            ],
            unknown_events: 0,
        },
    ));
    cases
}

/// What `convert` must produce for an all-GPU, all-consistent batch: computed directly with
/// `engine::hash` on the token chunks.
fn expected_engine_events(b: &WireBatch, bs: usize) -> Vec<KvEvent> {
    b.events
        .iter()
        .filter_map(|e| match e {
            WireEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                lora_id,
                lora_name,
                ..
            } => {
                let name = lora_name.clone().or(lora_id.map(|i| i.to_string()));
                let seed = lora_seed(name.as_deref());
                let blocks = block_hashes
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| StoredBlock {
                        engine_hash: EngineHash(h),
                        tokens_hash: tokens_hash(&token_ids[i * bs..(i + 1) * bs], seed),
                    })
                    .collect::<Vec<_>>();
                (!blocks.is_empty()).then_some(KvEvent::Stored {
                    parent: parent.map(EngineHash),
                    blocks,
                })
            }
            WireEvent::Removed { block_hashes, .. } => {
                (!block_hashes.is_empty()).then(|| KvEvent::Removed {
                    blocks: block_hashes.iter().copied().map(EngineHash).collect(),
                })
            }
            WireEvent::Cleared => Some(KvEvent::Cleared),
        })
        .collect()
}

#[test]
fn hand_built_batches_decode_and_convert() {
    for (name, b, want) in hand_built() {
        let got = decode_batch(&b).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, want, "{name}");
        let conv = convert(got, &BS);
        assert_eq!(conv.events, expected_engine_events(&want, 16), "{name}");
        assert_eq!(conv.dp_rank, DpRank(want.dp_rank.unwrap_or(0)), "{name}");
        assert_eq!(conv.block_size_mismatch, None, "{name}");
        let want_drops: Vec<(DropReason, u64)> = if want.unknown_events > 0 {
            vec![(DropReason::Other, u64::from(want.unknown_events))]
        } else {
            vec![]
        };
        assert_eq!(conv.drops, want_drops, "{name}");
    }
}

#[test]
fn lora_seeds_follow_name_then_id() {
    let cases = hand_built();
    // array_full: named adapter (the id is ignored when a name is present).
    let conv = convert(decode_batch(&cases[1].1).unwrap(), &BS);
    let KvEvent::Stored { blocks, .. } = &conv.events[0] else {
        panic!("not a store")
    };
    let tokens = tok_vec(100..132);
    assert_eq!(
        blocks[0].tokens_hash,
        tokens_hash(&tokens[..16], lora_seed(Some("sql-adapter")))
    );
    assert_ne!(blocks[0].tokens_hash, tokens_hash(&tokens[..16], BASE_SEED));
    // outer_map: id only -> its decimal string.
    let conv = convert(decode_batch(&cases[3].1).unwrap(), &BS);
    let KvEvent::Stored { blocks, .. } = &conv.events[0] else {
        panic!("not a store")
    };
    assert_eq!(
        blocks[0].tokens_hash,
        tokens_hash(&tok_vec(0..16), lora_seed(Some("7")))
    );
}

#[test]
fn design_reference_vectors_through_the_decoder() {
    // DESIGN.md: block size 4, tokens [1..=8].
    let b = bytes(&V::A(vec![
        V::F(0.0),
        V::A(vec![V::A(vec![
            V::S("BlockStored"),
            V::A(vec![V::U(10), V::U(11)]),
            V::Nil,
            V::A((1..=8).map(V::U).collect()),
            V::U(4),
            V::Nil,
        ])]),
    ]));
    let conv = convert(decode_batch(&b).unwrap(), &ConvertConfig { block_size: 4 });
    let KvEvent::Stored { parent, blocks } = &conv.events[0] else {
        panic!("not a store")
    };
    assert_eq!(*parent, None);
    assert_eq!(blocks[0].tokens_hash.0, 14643705804678351452);
    assert_eq!(blocks[1].tokens_hash.0, 16777012769546811212);
    assert_eq!(blocks[1].engine_hash, EngineHash(11));
}

// ---------------------------------------------------------------------------------------
// Recorded fixtures.

/// A block hash as fixtures.json writes it: an integer, or the hex of a digest.
fn json_hash(v: &Value) -> u64 {
    if let Some(u) = v.as_u64() {
        return u;
    }
    if let Some(i) = v.as_i64() {
        return i as u64;
    }
    let hex = v.as_str().unwrap();
    let raw: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    raw[raw.len().saturating_sub(8)..]
        .iter()
        .fold(0, |a, &b| (a << 8) | u64::from(b))
}

fn json_opt<T>(v: Option<&Value>, f: impl Fn(&Value) -> T) -> Option<T> {
    v.filter(|v| !v.is_null()).map(f)
}

fn json_hashes(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(json_hash).collect()
}

fn json_tokens(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
        .collect()
}

/// `extra_keys` of a generic (JSON) event: per block null or untagged items (JSON has no
/// bin, so prompt-embeds digests do not occur in the recorded fixtures).
fn json_extra_keys(v: &Value) -> WireExtraKeys {
    let item = |v: &Value| match v {
        Value::String(s) => WireExtraItem::Str(s.clone()),
        Value::Array(a) => {
            WireExtraItem::Mm(a[0].as_str().unwrap().to_owned(), a[1].as_i64().unwrap())
        }
        _ => panic!("extra key {v}"),
    };
    WireExtraKeys::Blocks(
        v.as_array()
            .unwrap()
            .iter()
            .map(|e| {
                json_opt(Some(e), |e| {
                    e.as_array().unwrap().iter().map(item).collect()
                })
            })
            .collect(),
    )
}

/// The expected decoding of one generic (JSON) event; `None` for an unknown type.
fn json_event(v: &Value) -> Option<WireEvent> {
    let tag = match v {
        Value::Array(a) => a[0].as_str().unwrap(),
        Value::Object(m) => m["type"].as_str().unwrap(),
        _ => panic!("event {v}"),
    };
    // By position in an array event, by key in a map event.
    let field = |i: usize, k: &str| match v {
        Value::Array(a) => a.get(i),
        _ => v.get(k),
    };
    let s = |v: &Value| v.as_str().unwrap().to_owned();
    Some(match tag {
        "BlockStored" => WireEvent::Stored {
            block_hashes: json_hashes(field(1, "block_hashes").unwrap()),
            parent: json_opt(field(2, "parent_block_hash"), json_hash),
            token_ids: json_tokens(field(3, "token_ids").unwrap()),
            block_size: json_opt(field(4, "block_size"), |v| v.as_u64().unwrap() as u32),
            lora_id: json_opt(field(5, "lora_id"), |v| v.as_i64().unwrap()),
            medium: json_opt(field(6, "medium"), s),
            lora_name: json_opt(field(7, "lora_name"), s),
            extra_keys: json_opt(field(8, "extra_keys"), json_extra_keys),
        },
        "BlockRemoved" => WireEvent::Removed {
            block_hashes: json_hashes(field(1, "block_hashes").unwrap()),
            medium: json_opt(field(2, "medium"), s),
        },
        "AllBlocksCleared" => WireEvent::Cleared,
        _ => return None,
    })
}

fn json_batch(v: &Value) -> WireBatch {
    let a = v.as_array().unwrap();
    let mut events = Vec::new();
    let mut unknown_events = 0;
    for e in a[1].as_array().unwrap() {
        match json_event(e) {
            Some(e) => events.push(e),
            None => unknown_events += 1,
        }
    }
    WireBatch {
        ts: json_opt(a.first(), |v| v.as_f64().unwrap()),
        dp_rank: json_opt(a.get(2), |v| v.as_u64().unwrap() as u32),
        events,
        unknown_events,
    }
}

#[test]
fn every_fixture_file_decodes_to_its_generic_value() {
    let Some(dir) = data_dir() else { return };
    let fixtures = read_json(&dir.join("fixtures.json"));
    let fixtures = fixtures["fixtures"].as_object().unwrap();
    // Every .msgpack file in the directory is described (so none goes untested).
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".msgpack"))
        .collect();
    files.sort();
    let mut described: Vec<String> = fixtures
        .values()
        .map(|f| f["file"].as_str().unwrap().to_owned())
        .collect();
    described.sort();
    assert_eq!(files, described);
    assert!(!files.is_empty());

    for (name, f) in fixtures {
        let raw = std::fs::read(dir.join(f["file"].as_str().unwrap())).unwrap();
        assert_eq!(raw.len() as u64, f["bytes"].as_u64().unwrap(), "{name}");
        let want = json_batch(&f["decoded_generic"]);
        let mut got = decode_batch(&raw).unwrap_or_else(|e| panic!("{name}: {e}"));
        // serde_json's default float parsing may be one ulp off the exact f64.
        let (g, w) = (got.ts.unwrap(), want.ts.unwrap());
        assert!((g - w).abs() <= w.abs() * 1e-15, "{name}: ts {g} vs {w}");
        got.ts = want.ts;
        assert_eq!(got, want, "{name}");
        assert!(!got.events.is_empty(), "{name}");

        let conv = convert(got, &BS);
        assert_eq!(conv.events, expected_engine_events(&want, 16), "{name}");
        assert_eq!(conv.dp_rank, DpRank(want.dp_rank.unwrap_or(0)), "{name}");
        assert!(conv.drops.is_empty(), "{name}: {:?}", conv.drops);
        assert_eq!(conv.block_size_mismatch, None, "{name}");
        eprintln!("fixture {name}: {} events ok", conv.events.len());
    }
}

#[test]
fn fixtures_agree_with_hash_vectors() {
    let Some(dir) = data_dir() else { return };
    let hv = read_json(&dir.join("hash_vectors.json"));
    let tokens = json_tokens(&hv["tokens"]);
    let bs = hv["block_size"].as_u64().unwrap() as usize;
    assert_eq!(bs, 16);
    let local: Vec<u64> = hv["dynamo"]["local_block_hash_u64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    // Our tokens_hash is Dynamo's LocalBlockHash.
    for (i, &want) in local.iter().enumerate() {
        assert_eq!(
            tokens_hash(&tokens[i * bs..(i + 1) * bs], BASE_SEED).0,
            want
        );
    }
    // vLLM publishes the last 8 digest bytes big-endian; our bin folding agrees.
    for algo in ["sha256_cbor", "xxhash_cbor", "sha256_pickle_default"] {
        let v = &hv["vllm"][algo];
        let folded: Vec<u64> = v["block_digests_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(json_hash)
            .collect();
        assert_eq!(folded, json_hashes(&v["published_u64"]), "{algo}");
    }
    let vllm_u64 = json_hashes(&hv["vllm"]["sha256_cbor"]["published_u64"]);
    let sglang = json_hashes(&hv["sglang"]["published_i64"]);

    let fixtures = read_json(&dir.join("fixtures.json"));
    let mut checked_blocks = 0;
    for (name, f) in fixtures["fixtures"].as_object().unwrap() {
        let raw = std::fs::read(dir.join(f["file"].as_str().unwrap())).unwrap();
        let batch = decode_batch(&raw).unwrap();
        // The first store's engine hashes are the published vectors of its generation.
        if let Some(WireEvent::Stored { block_hashes, .. }) = batch.events.first() {
            if name.starts_with("vllm_") && name != "vllm_v0_9_array" {
                assert_eq!(block_hashes, &vllm_u64, "{name}");
            }
            if name.starts_with("sglang") {
                assert_eq!(block_hashes[0], sglang[0], "{name}");
            }
        }
        if name.starts_with("sglang") {
            let stored: Vec<u64> = batch
                .events
                .iter()
                .filter_map(|e| match e {
                    WireEvent::Stored { block_hashes, .. } => Some(block_hashes[0]),
                    _ => None,
                })
                .collect();
            assert_eq!(stored, sglang, "{name}");
        }
        // Every converted block whose tokens are one of the vector blocks has its hash.
        let conv = convert(batch.clone(), &BS);
        let stores = batch.events.iter().filter_map(|e| match e {
            WireEvent::Stored { token_ids, .. } => Some(token_ids),
            _ => None,
        });
        let conv_stores = conv.events.iter().filter_map(|e| match e {
            KvEvent::Stored { blocks, .. } => Some(blocks),
            _ => None,
        });
        for (token_ids, blocks) in stores.zip(conv_stores) {
            for (chunk, block) in token_ids.chunks_exact(bs).zip(blocks) {
                for (i, &want) in local.iter().enumerate() {
                    if chunk == &tokens[i * bs..(i + 1) * bs] {
                        assert_eq!(block.tokens_hash.0, want, "{name}");
                        checked_blocks += 1;
                    }
                }
            }
        }
    }
    assert!(checked_blocks >= 8, "only {checked_blocks} blocks matched");
}

/// Throughput of decode + convert on a realistic batch (32 stores of 4 blocks of 16 tokens).
/// Run: `cargo test --release -p kvengine-transport --test kv_events_fixtures -- --ignored
/// --nocapture`.
#[test]
#[ignore = "measurement; run in release"]
fn decode_convert_throughput() {
    let mut events = Vec::new();
    for e in 0..32u64 {
        events.push(V::A(vec![
            V::S("BlockStored"),
            V::A((0..4).map(|i| V::U64(u64::MAX - e * 8 - i)).collect()),
            if e == 0 { V::Nil } else { V::U64(e) },
            V::A((0..64).map(|t| V::U(1000 + t * 2311 + e)).collect()),
            V::U(16),
            V::Nil,
            V::S("GPU"),
            V::Nil,
            V::A(vec![V::Nil; 4]),
            V::U(0),
            V::S("full_attention"),
            V::Nil,
        ]));
    }
    let b = bytes(&V::A(vec![V::F(1.0), V::A(events), V::U(0)]));
    let iters = 20_000;
    let t = std::time::Instant::now();
    let mut blocks = 0usize;
    for _ in 0..iters {
        let batch = decode_batch(std::hint::black_box(&b)).unwrap();
        let conv = convert(batch, &BS);
        blocks += conv
            .events
            .iter()
            .map(|e| match e {
                KvEvent::Stored { blocks, .. } => blocks.len(),
                _ => 0,
            })
            .sum::<usize>();
    }
    let s = t.elapsed().as_secs_f64();
    let t2 = std::time::Instant::now();
    for _ in 0..iters {
        std::hint::black_box(decode_batch(std::hint::black_box(&b)).unwrap());
    }
    let s2 = t2.elapsed().as_secs_f64();
    eprintln!(
        "batch {} bytes; decode+convert: {:.2} M block events/s ({:.0} MB/s); decode only: {:.2} M blocks/s",
        b.len(),
        blocks as f64 / s / 1e6,
        (b.len() * iters) as f64 / s / 1e6,
        blocks as f64 / s2 / 1e6,
    );
}

// ---------------------------------------------------------------------------------------
// vLLM 0.32 `BlockStored.extra_keys` (cache_salt, LoRA name, multimodal, prompt embeds).

fn vllm_0_32(file: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/data/vllm-0.32.0/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn stored_blocks(e: &KvEvent) -> Vec<TokensHash> {
    match e {
        KvEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.tokens_hash).collect(),
        other => panic!("not a store: {other:?}"),
    }
}

#[test]
fn recorded_vllm_0_32_salted_stores_key_blocks_as_the_request_side() {
    let raw = vllm_0_32("stored_salted.msgpack");
    let batch = decode_batch(&raw).unwrap();
    let salt = |s: &str| WireExtraItem::Str(s.into());
    let extras: Vec<Option<WireExtraKeys>> = batch
        .events
        .iter()
        .map(|e| match e {
            WireEvent::Stored { extra_keys, .. } => extra_keys.clone(),
            other => panic!("not a store: {other:?}"),
        })
        .collect();
    assert_eq!(
        extras,
        vec![
            Some(WireExtraKeys::Blocks(vec![
                Some(vec![salt("salt-a")]),
                None,
                None
            ])),
            Some(WireExtraKeys::Blocks(vec![
                Some(vec![salt("sql-adapter"), salt("salt-b")]),
                Some(vec![salt("sql-adapter")]),
            ])),
            Some(WireExtraKeys::Blocks(vec![Some(vec![
                WireExtraItem::Mm("img-0123".into(), 3),
                salt("salt-c"),
                WireExtraItem::Bin((0..32).collect()),
            ])])),
            None,
        ]
    );

    let conv = convert(batch, &BS);
    assert!(conv.drops.is_empty(), "{:?}", conv.drops);
    assert_eq!(conv.events.len(), 4);
    let tokens: Vec<u32> = (0..48).map(|t| (t * 7919) % 150_000).collect();
    let plain = seq_hashes(&tokens, 16, BASE_SEED);

    // 1: the salt keys block 0; the request side with the same salt gives the same chain, and
    // every block differs from the unsalted chain.
    let got = chain(None, &stored_blocks(&conv.events[0]));
    assert_eq!(
        got,
        seq_hashes_salted(&tokens, 16, BASE_SEED, Some("salt-a"))
    );
    for i in 0..3 {
        assert_ne!(got[i], plain[i], "block {i}");
    }
    assert_eq!(
        stored_blocks(&conv.events[0])[1..],
        tokens_hashes(&tokens, 16, BASE_SEED)[1..]
    );

    // 2: the adapter's name is in the seed, not folded again; the salt is.
    let seed = lora_seed(Some("sql-adapter"));
    let got = chain(None, &stored_blocks(&conv.events[1]));
    assert_eq!(
        got,
        seq_hashes_salted(&tokens[..32], 16, seed, Some("salt-b"))
    );
    assert_ne!(got, seq_hashes(&tokens[..32], 16, seed));

    // 3: multimodal item, salt and embeddings digest, folded in order.
    let want = fold_extras(
        tokens_hash(&tokens[..16], BASE_SEED),
        &[
            ExtraKey::Multimodal {
                identifier: "img-0123".into(),
                offset: 3,
            },
            ExtraKey::CacheSalt("salt-c".into()),
            ExtraKey::PromptEmbeds((0..32).collect()),
        ],
    );
    assert_eq!(stored_blocks(&conv.events[2]), vec![want]);
    assert_ne!(
        SeqHash(want.0),
        seq_hashes_salted(&tokens[..16], 16, BASE_SEED, Some("salt-c"))[0]
    );
    assert_ne!(SeqHash(want.0), plain[0]);

    // 4: no extra keys: the plain hash.
    assert_eq!(
        stored_blocks(&conv.events[3]),
        tokens_hashes(&tokens[..16], 16, BASE_SEED)
    );
}

/// A positional (array-like) store with `extra_keys` at index 8, as older array-like vLLM
/// events place it after `lora_name`.
fn positional_store(hash: u64, lora: Option<&'static str>, extra: V) -> V {
    V::A(vec![
        V::S("BlockStored"),
        V::A(vec![V::U(hash), V::U(hash + 1)]),
        V::Nil,
        toks(0..32),
        V::U(16),
        V::Nil,
        V::S("GPU"),
        lora.map_or(V::Nil, V::S),
        extra,
    ])
}

#[test]
fn malformed_extra_keys_drop_their_event_only() {
    let good = V::A(vec![V::A(vec![V::S("s")]), V::Nil]);
    let events = vec![
        // Not a list.
        positional_store(10, None, V::U(5)),
        // One entry for two blocks.
        positional_store(20, None, V::A(vec![V::Nil])),
        // An entry that is neither nil nor a list.
        positional_store(30, None, V::A(vec![V::S("s"), V::Nil])),
        // An item of an unknown shape (a map; a three-element array).
        positional_store(40, None, V::A(vec![V::A(vec![V::M(vec![])]), V::Nil])),
        positional_store(
            50,
            None,
            V::A(vec![
                V::A(vec![V::A(vec![V::S("img"), V::U(1), V::U(2)])]),
                V::Nil,
            ]),
        ),
        // A LoRA store whose entry does not start with the adapter's name.
        positional_store(
            60,
            Some("adapter"),
            V::A(vec![V::A(vec![V::S("s")]), V::Nil]),
        ),
        // Applied: a salted store, and nil extra keys.
        positional_store(70, None, good),
        positional_store(80, None, V::Nil),
    ];
    let b = bytes(&V::A(vec![V::F(0.0), V::A(events)]));
    let batch = decode_batch(&b).unwrap();
    assert_eq!(batch.events.len(), 8);
    let conv = convert(batch, &BS);
    assert_eq!(conv.drops, vec![(DropReason::MalformedMsgpack, 6)]);
    assert_eq!(conv.events.len(), 2);
    let tokens = tok_vec(0..32);
    assert_eq!(
        chain(None, &stored_blocks(&conv.events[0])),
        seq_hashes_salted(&tokens, 16, BASE_SEED, Some("s"))
    );
    assert_eq!(
        stored_blocks(&conv.events[1]),
        tokens_hashes(&tokens, 16, BASE_SEED)
    );

    // Bytes that end inside `extra_keys` refuse the batch (as any truncation does).
    let whole = bytes(&V::A(vec![
        V::F(0.0),
        V::A(vec![positional_store(
            90,
            None,
            V::A(vec![V::A(vec![V::S("salt")]), V::Nil]),
        )]),
    ]));
    for cut in 1..12 {
        assert!(
            decode_batch(&whole[..whole.len() - cut]).is_err(),
            "cut {cut}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Payloads a real vLLM 0.32.0 server published in the conformance suite (`observed_*`,
// conformance/vllm_suite.py with KVENGINE_RECORD_FIXTURES=1): events as maps with "type".

const BS32: ConvertConfig = ConvertConfig { block_size: 32 };

fn observed(file: &str) -> Vec<KvEvent> {
    let batch = decode_batch(&vllm_0_32(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    assert_eq!(batch.dp_rank, Some(0), "{file}");
    let conv = convert(batch, &BS32);
    assert!(conv.drops.is_empty(), "{file}: {:?}", conv.drops);
    assert_eq!(conv.block_size_mismatch, None);
    conv.events
}

#[test]
fn payloads_observed_from_a_real_vllm_0_32_server_convert() {
    let stored = observed("observed_stored.msgpack");
    assert!(
        matches!(&stored[..], [KvEvent::Stored { parent: Some(_), blocks }] if blocks.len() == 1),
        "{stored:?}"
    );
    let removed = observed("observed_removed.msgpack");
    assert!(
        matches!(&removed[..], [KvEvent::Removed { blocks }] if blocks.len() == 1),
        "{removed:?}"
    );
    assert_eq!(observed("observed_cleared.msgpack"), vec![KvEvent::Cleared]);

    // A salted chain (the suite's `cache_salt` step): its first block carries the salt in
    // `extra_keys`, so its hash is not the plain hash of its tokens.
    let raw = decode_batch(&vllm_0_32("observed_salted_stored.msgpack")).unwrap();
    let salted: Vec<(Vec<u32>, String)> = raw
        .events
        .iter()
        .filter_map(|e| match e {
            WireEvent::Stored {
                parent: None,
                token_ids,
                extra_keys: Some(WireExtraKeys::Blocks(keys)),
                ..
            } => match keys.first() {
                Some(Some(items)) => match items.as_slice() {
                    [WireExtraItem::Str(salt)] => Some((token_ids.clone(), salt.clone())),
                    _ => None,
                },
                _ => None,
            },
            _ => None,
        })
        .collect();
    assert!(!salted.is_empty(), "no salted root store in the recording");
    let events = observed("observed_salted_stored.msgpack");
    for (tokens, salt) in &salted {
        let want = seq_hashes_salted(tokens, 32, BASE_SEED, Some(salt));
        let got = events.iter().find_map(|e| match e {
            KvEvent::Stored { parent: None, .. } => {
                let c = chain(None, &stored_blocks(e));
                (c == want).then_some(c)
            }
            _ => None,
        });
        assert!(
            got.is_some(),
            "salt {salt:?}: no store keyed as the request side"
        );
        assert_ne!(want[0], seq_hashes(tokens, 32, BASE_SEED)[0]);
    }
}

/// vLLM's `kv_cache_report_mode: "full"` re-announce, as a real server sent it: a root chain
/// of blocks the worker holds. Applied after the blocks' store it adds no copy, so one
/// eviction per block empties the worker.
#[test]
fn a_real_full_mode_reannounce_adds_no_copy() {
    let events = observed("observed_full_reannounce.msgpack");
    let [
        reannounce @ KvEvent::Stored {
            parent: None,
            blocks,
        },
    ] = &events[..]
    else {
        panic!("{events:?}");
    };
    assert_eq!(blocks.len(), 7);
    let key = engine::WorkerKey::new(1, 0);
    let mut ix = engine::kv_index::KvIndex::new();
    assert_eq!(
        ix.apply(key, reannounce).unwrap().blocks,
        7,
        "first seen: a store"
    );
    assert_eq!(
        ix.apply(key, reannounce).unwrap().blocks,
        0,
        "then a report"
    );
    assert_eq!(ix.cached_blocks(key), 7);
    let evict = KvEvent::Removed {
        blocks: blocks.iter().map(|b| b.engine_hash).collect(),
    };
    ix.apply(key, &evict).unwrap();
    assert_eq!(ix.cached_blocks(key), 0, "nothing outlives its eviction");
}
