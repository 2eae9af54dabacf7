//! Fuzzing that runs on the stable toolchain, in the default test suite: every network
//! decoder (vLLM/SGLang msgpack batches, native QUIC frames, JSON events, `/v1/route`
//! bodies, OpenAI request bodies, router replicas' NATS frames, TensorRT-LLM event pages,
//! the ZMTP streams ZMQ peers send, snapshot files and their restore) gets a fixed budget
//! of inputs mutated from a corpus of valid ones (the recorded fixtures under
//! `../shared/data` when present and vLLM 0.32's under `tests/data/vllm-0.32.0`, the
//! hand-written TensorRT-LLM pages under `tests/data/trtllm`, and inputs built here with the
//! encoders), on top of the cargo-fuzz targets in `fuzz/` (which need nightly).
//!
//! Each input must be decoded without a panic, and where a decoder has a reference (the
//! `/v1/route` scanner and serde; the owned and in-place native frame decoders; the ZMTP
//! decoder fed whole and in 3-byte pieces) the two must agree. A run must see mutated
//! inputs both accepted and refused, or it explored nothing. Runs are deterministic (a
//! fixed RNG seed): a failure prints the shrunk corpus index and edits, which reproduce it.
//! `KVENGINE_FUZZ_CASES` raises the budget (default 3,000 inputs per decoder; CI also runs
//! 50,000).

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use transport::json_events::{parse_events_body, to_engine};
use transport::kv_events::{
    ConvertConfig, WireBatch, WireEvent, WireExtraItem, WireExtraKeys, convert, decode_batch,
};
use transport::native::frame::{
    FrameBuf, access_client_frame, batch_events, decode_client_frame, encode_batch,
    encode_client_frame,
};
use transport::native::schema::{ArchivedClientFrame, ClientFrame, NativeBlock, NativeEvent};

/// One edit of an input. Positions are fractions of the input's length (in 1/65536), so a
/// mutation means the same thing whatever input it lands on.
#[derive(Clone, Debug)]
enum Mutation {
    FlipBit {
        at: u16,
        bit: u8,
    },
    SetByte {
        at: u16,
        byte: u8,
    },
    Insert {
        at: u16,
        bytes: Vec<u8>,
    },
    Delete {
        at: u16,
        len: u8,
    },
    Truncate {
        at: u16,
    },
    /// Overwrites from `at` with a slice of another corpus input.
    Splice {
        at: u16,
        other: usize,
        from: u16,
        len: u8,
    },
    /// Repeats a run of the input in place (lengths and counts then lie).
    Repeat {
        at: u16,
        len: u8,
        times: u8,
    },
}

/// Bytes that sit on format boundaries: msgpack markers, JSON punctuation, extremes.
const INTERESTING: &[u8] = &[
    0x00, 0x01, 0x7f, 0x80, 0xff, 0xc0, 0xc1, 0xc2, 0xc3, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd9, 0xdc,
    0xdd, 0xde, 0xdf, 0x90, 0x9f, 0x80, 0x8f, 0xa0, b'{', b'}', b'[', b']', b'"', b',', b':', b'-',
    b'0', b'9', b'e', b'\\', b'n',
];

fn mutation(corpus: usize) -> impl Strategy<Value = Mutation> {
    let byte = prop_oneof![any::<u8>(), proptest::sample::select(INTERESTING)];
    prop_oneof![
        (any::<u16>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        (any::<u16>(), byte.clone()).prop_map(|(at, byte)| Mutation::SetByte { at, byte }),
        (any::<u16>(), proptest::collection::vec(byte, 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (any::<u16>(), 1u8..32).prop_map(|(at, len)| Mutation::Delete { at, len }),
        any::<u16>().prop_map(|at| Mutation::Truncate { at }),
        (any::<u16>(), 0..corpus, any::<u16>(), 1u8..64).prop_map(|(at, other, from, len)| {
            Mutation::Splice {
                at,
                other,
                from,
                len,
            }
        }),
        (any::<u16>(), 1u8..16, 1u8..8).prop_map(|(at, len, times)| Mutation::Repeat {
            at,
            len,
            times
        }),
    ]
}

fn pos(at: u16, len: usize) -> usize {
    (usize::from(at) * (len + 1)) >> 16
}

fn apply(input: &mut Vec<u8>, m: &Mutation, corpus: &[Vec<u8>]) {
    let n = input.len();
    match m {
        Mutation::FlipBit { at, bit } if n > 0 => {
            let i = pos(*at, n - 1);
            input[i] ^= 1 << bit;
        }
        Mutation::SetByte { at, byte } if n > 0 => {
            let i = pos(*at, n - 1);
            input[i] = *byte;
        }
        Mutation::Insert { at, bytes } => {
            let i = pos(*at, n);
            input.splice(i..i, bytes.iter().copied());
        }
        Mutation::Delete { at, len } => {
            let i = pos(*at, n);
            let end = (i + usize::from(*len)).min(n);
            input.drain(i..end);
        }
        Mutation::Truncate { at } => input.truncate(pos(*at, n)),
        Mutation::Splice {
            at,
            other,
            from,
            len,
        } => {
            let src = &corpus[*other % corpus.len()];
            let s = pos(*from, src.len());
            let piece = &src[s..(s + usize::from(*len)).min(src.len())];
            let i = pos(*at, n);
            let end = (i + piece.len()).min(n);
            input.splice(i..end, piece.iter().copied());
        }
        Mutation::Repeat { at, len, times } => {
            let i = pos(*at, n);
            let run: Vec<u8> = input[i..(i + usize::from(*len)).min(n)].to_vec();
            for _ in 0..*times {
                input.splice(i..i, run.iter().copied());
            }
        }
        _ => {}
    }
}

fn cases() -> u32 {
    std::env::var("KVENGINE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3_000)
}

/// Feeds `check` the corpus itself, then `cases()` mutated inputs (1-8 edits each).
/// `check` says whether the decoder accepted the input: a run where every mutated input is
/// accepted, or every one refused, explores nothing and fails.
fn run(name: &str, corpus: Vec<Vec<u8>>, check: impl Fn(&[u8]) -> bool) {
    let accepted = AtomicUsize::new(0);
    let refused = AtomicUsize::new(0);
    let check = |data: &[u8]| {
        let counter = if check(data) { &accepted } else { &refused };
        counter.fetch_add(1, Relaxed);
    };
    assert!(!corpus.is_empty(), "{name}: empty corpus");
    for seed in &corpus {
        check(seed);
    }
    let config = Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let n = corpus.len();
    let strategy = (0..n, proptest::collection::vec(mutation(n), 1..8));
    let result = runner.run(&strategy, |(seed, edits)| {
        let mut input = corpus[seed].clone();
        for m in &edits {
            apply(&mut input, m, &corpus);
        }
        check(&input);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    let (a, r) = (accepted.load(Relaxed), refused.load(Relaxed));
    assert!(
        a > corpus.len() && r > 0,
        "{name}: {a} inputs accepted, {r} refused: the mutations explore nothing"
    );
}

/// The recorded msgpack fixtures: vLLM 0.32's under `tests/data/vllm-0.32.0`, and the shared
/// ones when the shared data is there.
fn recorded_msgpack() -> Vec<Vec<u8>> {
    let own = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/vllm-0.32.0");
    let mut out: Vec<Vec<u8>> = ["stored_salted.msgpack"]
        .iter()
        .map(|f| std::fs::read(own.join(f)).unwrap())
        .collect();
    out.extend(shared_msgpack());
    out
}

fn shared_msgpack() -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/kv_events");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "msgpack"))
        .collect();
    files.sort();
    files.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

fn wire_batches() -> Vec<Vec<u8>> {
    let stored = |p: u64, lora: Option<&str>| WireEvent::Stored {
        block_hashes: vec![p, p + 1],
        parent: (p > 1).then_some(p - 1),
        token_ids: (0..32).map(|t| t as u32 + p as u32).collect(),
        block_size: Some(16),
        lora_id: lora.map(|_| 3),
        lora_name: lora.map(str::to_owned),
        medium: Some("GPU".into()),
        // vLLM 0.32's per-block extra keys: the adapter's name first, block 0 salted, a
        // multimodal item and an embeddings digest on block 1.
        extra_keys: Some(WireExtraKeys::Blocks(vec![
            Some(
                lora.map(|l| WireExtraItem::Str(l.into()))
                    .into_iter()
                    .chain([WireExtraItem::Str("salt".into())])
                    .collect(),
            ),
            Some(vec![
                WireExtraItem::Mm("img".into(), 4),
                WireExtraItem::Bin(vec![7; 32]),
            ]),
        ])),
    };
    let batches = [
        vec![stored(1, None)],
        vec![
            stored(5, Some("adapter")),
            WireEvent::Removed {
                block_hashes: vec![5, 6],
                medium: None,
            },
        ],
        vec![WireEvent::Cleared, stored(9, None)],
    ];
    batches
        .into_iter()
        .enumerate()
        .map(|(i, events)| {
            transport::zmq::publisher::encode_batch(&WireBatch {
                ts: Some(1.5),
                dp_rank: Some(i as u32),
                events,
                unknown_events: 0,
            })
        })
        .collect()
}

#[test]
fn msgpack_batches_survive_mutation() {
    let mut corpus = recorded_msgpack();
    corpus.extend(wire_batches());
    // The corpus is valid: the run starts from inputs that reach deep into the decoder.
    for seed in &corpus {
        assert!(decode_batch(seed).is_ok(), "a corpus batch does not decode");
    }
    run("msgpack batch", corpus, |data| match decode_batch(data) {
        Ok(b) => {
            for block_size in [0, 1, 16] {
                let _ = convert(b.clone(), &ConvertConfig { block_size });
            }
            true
        }
        Err(_) => false,
    });
}

fn native_frames() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = FrameBuf::new();
    let hello = ClientFrame::Hello {
        version: 1,
        worker_id: 7,
        dp_ranks: vec![0, 1],
        block_size: 16,
        token: "secret".into(),
        instance: 0,
    };
    encode_client_frame(&hello, &mut buf).unwrap();
    out.push(buf.to_vec());
    let events = [
        NativeEvent::Stored {
            parent: None,
            blocks: vec![
                NativeBlock {
                    engine_hash: 1,
                    tokens_hash: 11,
                },
                NativeBlock {
                    engine_hash: 2,
                    tokens_hash: 12,
                },
            ],
        },
        NativeEvent::StoredTokens {
            parent: Some(2),
            engine_hashes: vec![3],
            token_ids: (0..16).collect(),
            lora_name: Some("adapter".into()),
        },
        NativeEvent::Removed { blocks: vec![1, 3] },
        NativeEvent::Cleared,
    ];
    encode_batch(7, 1, 42, &events, &mut buf).unwrap();
    out.push(buf.to_vec());
    out
}

#[test]
fn native_frames_survive_mutation() {
    let corpus = native_frames();
    for seed in &corpus {
        assert!(decode_client_frame(seed).is_ok());
    }
    run("native frame", corpus, |data| {
        let owned = decode_client_frame(data).is_ok();
        let mut buf = FrameBuf::with_capacity(data.len());
        buf.extend_from_slice(data);
        let in_place = access_client_frame(&buf);
        // The owned and the in-place decoders validate alike.
        assert_eq!(owned, in_place.is_ok(), "the two frame decoders disagree");
        if let Ok(ArchivedClientFrame::Batch(batch)) = in_place {
            for block_size in [0, 1, 16] {
                let mut out = Vec::new();
                batch_events(batch, block_size, &mut out, |_| {});
            }
        }
        owned
    });
}

#[test]
fn json_events_survive_mutation() {
    let tokens: Vec<u32> = (0..16).collect();
    let corpus: Vec<Vec<u8>> = [
        serde_json::json!({"worker_id": 7, "dp_rank": 0, "seq": 12, "events": [
            {"type": "stored", "parent_hash": null, "lora_name": null,
             "blocks": [{"block_hash": 11, "token_ids": tokens},
                        {"block_hash": 12, "token_ids": tokens}]},
            {"type": "removed", "block_hashes": [11]},
            {"type": "cleared"}]}),
        serde_json::json!({"worker_id": 1, "events": [
            {"type": "stored", "parent_hash": 4, "lora_name": "a",
             "blocks": [{"block_hash": 18446744073709551615u64, "token_ids": tokens}]}]}),
    ]
    .iter()
    .map(|v| v.to_string().into_bytes())
    .collect();
    for seed in &corpus {
        assert!(parse_events_body(seed).is_ok());
    }
    run("JSON events", corpus, |data| {
        match parse_events_body(data) {
            Ok(body) => {
                for e in &body.events {
                    for block_size in [0, 1, 16] {
                        let _ = to_engine(e, block_size);
                    }
                }
                true
            }
            Err(_) => false,
        }
    });
}

#[test]
fn route_bodies_decode_as_serde_does() {
    use transport::http::route_body::{parse_prompt, parse_prompt_serde};
    let ids: Vec<u32> = (0..40).map(|i| i * 1_000_003 % 4_000_000_000).collect();
    let corpus: Vec<Vec<u8>> = [
        serde_json::json!({"token_ids": ids}),
        serde_json::json!({"token_ids": [1, 2, 3], "request_id": "r-1", "lora_name": "a",
                           "mode": "kv", "worker_id": 3, "overlap_weight": 1.5,
                           "temperature": 0.0, "pool": "prefill", "model": "m"}),
    ]
    .iter()
    .map(|v| v.to_string().into_bytes())
    .chain([b" { \"token_ids\" : [ 0 , 4294967295 ] , \"model\" : null } ".to_vec()])
    .collect();
    run("route body", corpus, |data| {
        let (mut fast, mut slow) = (Vec::new(), Vec::new());
        match (
            parse_prompt(data, &mut fast),
            parse_prompt_serde(data, &mut slow),
        ) {
            (Ok(a), Ok(b)) => {
                assert!(a == b && fast == slow, "scanner and serde disagree");
                true
            }
            (Err(_), Err(_)) => false,
            (a, b) => panic!("scanner {a:?} vs serde {b:?}"),
        }
    });
}

#[test]
fn openai_bodies_survive_mutation() {
    use transport::openai::request_prompt::{PromptSource, parse_request};
    let corpus: Vec<Vec<u8>> = [
        serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
            "stream": true, "max_tokens": 8}),
        serde_json::json!({"model": "m", "prompt": "once upon a time", "max_tokens": 4}),
        serde_json::json!({"prompt": [[1, 2, 3]]}),
    ]
    .iter()
    .map(|v| v.to_string().into_bytes())
    .collect();
    run("OpenAI body", corpus, |data| {
        let mut accepted = false;
        for source in [PromptSource::Chat, PromptSource::Completion] {
            if let Ok(p) = parse_request(data, source) {
                accepted |= p.token_ids(None).is_ok();
            }
        }
        accepted
    });
}

#[test]
fn replica_frames_survive_mutation() {
    use transport::replicas::wire::{
        Body, Frame, LoadEvent, Resync, SESSION_WIRE_VERSION, SessionAssign, SessionFrame,
        WIRE_VERSION, decode_frame, decode_resync, decode_sessions, encode_frame, encode_resync,
        encode_sessions,
    };
    let events = Frame {
        version: WIRE_VERSION,
        replica: 0xabcdef,
        seq: 9,
        body: Body::Events(vec![
            LoadEvent::Reset,
            LoadEvent::Added {
                request: "req-1".into(),
                worker: 3,
                dp_rank: 1,
                input_tokens: 4096,
                overlap_blocks: 12,
                blocks: (0..40).collect(),
            },
            LoadEvent::Prefilled {
                request: "req-1".into(),
            },
            LoadEvent::Freed {
                request: "kvr-7".into(),
            },
        ]),
    };
    let heartbeat = Frame {
        seq: 12,
        body: Body::Heartbeat {
            name: "router-a".into(),
            active: 3,
        },
        ..events.clone()
    };
    let resync = Resync {
        version: WIRE_VERSION,
        from: 5,
        target: 0,
    };
    let sessions = SessionFrame {
        version: SESSION_WIRE_VERSION,
        replica: 0xabcdef,
        sessions: (0..5)
            .map(|i| SessionAssign {
                model: "qwen".into(),
                session: 0x1234_5678_9abc + i,
                worker: i,
                dp_rank: 0,
            })
            .collect(),
    };
    let corpus = vec![
        encode_frame(&events).unwrap().to_vec(),
        encode_frame(&heartbeat).unwrap().to_vec(),
        encode_resync(&resync).unwrap().to_vec(),
        encode_sessions(&sessions).unwrap().to_vec(),
    ];
    run("replica frames", corpus, |data| {
        let frame = decode_frame(data);
        // What decodes must encode back to a frame that decodes to the same.
        if let Ok(f) = &frame {
            let again = decode_frame(&encode_frame(f).unwrap()).unwrap();
            assert_eq!(&again, f);
        }
        let resync = decode_resync(data);
        let session = decode_sessions(data);
        if let Ok(f) = &session {
            let again = decode_sessions(&encode_sessions(f).unwrap()).unwrap();
            assert_eq!(&again, f);
        }
        frame.is_ok() || resync.is_ok() || session.is_ok()
    });
}

/// Snapshot files (`--state-dir`, peer replicas' snapshots): the input is the archive,
/// framed as a file with its checksum recomputed (so mutations reach the archive and the
/// restore, not only the checksum), decoded and rebuilt core by core. A count the bytes do
/// not back must be refused, never reserved or looped over: each input restores in
/// milliseconds.
#[test]
fn snapshot_files_survive_mutation() {
    use engine::sharding::ShardId;
    use engine::sharding::adaptive::Adaptive;
    use engine::sharding::ingest::Ingest;
    use engine::sharding::shard::Shard;
    use engine::snapshot::{
        self, CoreImage, EngineImage, EntryRec, FORMAT_VERSION, HEADER_LEN, HolderRec, KeyRec,
        MAGIC, MarkRec, NodeRec, PinRec, TrunkImage,
    };
    let file_of = |archive: &[u8]| {
        let mut out = rkyv::util::AlignedVec::<16>::with_capacity(HEADER_LEN + archive.len());
        let mut header = [0u8; HEADER_LEN];
        header[..8].copy_from_slice(&MAGIC);
        header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        header[16..24].copy_from_slice(&(archive.len() as u64).to_le_bytes());
        header[32..40].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(archive).to_le_bytes());
        out.extend_from_slice(&header);
        out.extend_from_slice(archive);
        out
    };
    let core = |w: u64| CoreImage {
        nodes: vec![
            NodeRec {
                parent: 0,
                root: true,
                len: 3,
                holders: 2,
            },
            NodeRec {
                parent: 12,
                root: false,
                len: 2,
                holders: 1,
            },
        ],
        seqs: vec![10, 11, 12, 13, 14],
        holders: vec![
            HolderRec {
                worker: w,
                rank: 0,
                count: 2,
            },
            HolderRec {
                worker: w + 1,
                rank: 1,
                count: 1,
            },
            HolderRec {
                worker: w,
                rank: 0,
                count: 1,
            },
        ],
        keys: vec![KeyRec {
            worker: w,
            rank: 0,
            len: 2,
        }],
        entries: vec![
            EntryRec {
                engine: 100,
                seq: 10,
                route: 0,
                count: 2,
            },
            EntryRec {
                engine: 101,
                seq: 11,
                route: 0,
                count: 1,
            },
        ],
        marks: vec![MarkRec {
            worker: w,
            stream: 0,
            seq: 41,
            digest: Some(7),
        }],
    };
    let image = EngineImage {
        shards: 2,
        policy: "adaptive".into(),
        trunk: TrunkImage {
            version: 1,
            members: vec![10],
            pins: vec![PinRec { seq: 11, shard: 1 }],
        },
        cores: vec![core(1), core(5)],
    };
    let encoded = snapshot::encode(&image, b"").unwrap();
    let corpus = vec![encoded[HEADER_LEN..].to_vec()];
    run("snapshot files", corpus, |archive| {
        let file = file_of(archive);
        let Ok((image, _)) = snapshot::decode(&file) else {
            return false;
        };
        let shards = image.cores.len();
        if shards == 0 || shards > 64 || image.shards.to_native() as usize != shards {
            return false;
        }
        let began = std::time::Instant::now();
        let policy = Adaptive::new(shards, 2).unwrap();
        let mut restored = true;
        for (k, core) in image.cores.iter().enumerate() {
            let mut shard = Shard::new(ShardId(k as u16));
            restored &= shard.restore_image(core).is_ok();
            let mut ingest = Ingest::new(policy.clone());
            restored &= ingest.restore(core).is_ok();
        }
        assert!(
            began.elapsed() < std::time::Duration::from_secs(2),
            "a {}-byte snapshot took {:?} to restore",
            archive.len(),
            began.elapsed()
        );
        restored
    });
}

#[test]
fn trtllm_pages_survive_mutation() {
    use std::collections::BTreeMap;
    use transport::trtllm::{PageEntry, RankConverter, decode_page};
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/trtllm");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let corpus: Vec<Vec<u8>> = files.iter().map(|p| std::fs::read(p).unwrap()).collect();
    for seed in &corpus {
        let page = decode_page(seed).unwrap();
        assert!(page.iter().all(|e| matches!(e, PageEntry::Event { .. })));
    }
    run("TensorRT-LLM pages", corpus, |data| {
        match decode_page(data) {
            Ok(page) => {
                for block_size in [0, 16, 32] {
                    let mut ranks: BTreeMap<u32, RankConverter> = BTreeMap::new();
                    let mut out = Vec::new();
                    for entry in &page {
                        if let PageEntry::Event { event, .. } = entry {
                            let rank = ranks
                                .entry(event.attention_dp_rank.unwrap_or(0))
                                .or_default();
                            let _ = rank.convert(event.data.clone(), block_size, &mut out);
                        }
                    }
                }
                true
            }
            Err(_) => false,
        }
    });
}

/// Everything a ZMTP decoder bounded at `max` gives for `input` fed `chunk` bytes at a time,
/// and whether it ended in an error; the decoder never asks past its bound.
fn zmtp_decode(
    input: &[u8],
    max: usize,
    chunk: usize,
) -> (Vec<transport::zmq::zmtp::Decoded>, bool) {
    use transport::zmq::zmtp::codec::{Decoder, GREETING_LEN, MAX_COMMAND_BYTES};
    let bound = max.max(MAX_COMMAND_BYTES).max(GREETING_LEN) + 9;
    let mut d = Decoder::new(max);
    let mut buf = bytes::BytesMut::new();
    let mut out = Vec::new();
    for piece in input.chunks(chunk.max(1)) {
        buf.extend_from_slice(piece);
        loop {
            match d.decode(&mut buf) {
                Ok(Some(unit)) => out.push(unit),
                Ok(None) => break,
                Err(_) => return (out, true),
            }
        }
        assert!(
            d.needed(&buf) <= bound,
            "the ZMTP decoder asked past its bound"
        );
    }
    (out, false)
}

/// What ZMQ peers send: a greeting (libzmq's 3.1), READY, then live messages, vLLM's replay
/// replies (a long frame among them), subscriptions and heartbeats.
fn zmtp_streams() -> Vec<Vec<u8>> {
    use bytes::{Bytes, BytesMut};
    use transport::zmq::zmtp::SocketType;
    use transport::zmq::zmtp::codec::{encode_command, encode_message, encode_ready, greeting};
    let start = |t: SocketType| {
        let mut b = BytesMut::from(&greeting()[..]);
        b[11] = 1;
        encode_ready(&mut b, t);
        b
    };
    let payload = Bytes::from(wire_batches().remove(0));
    let seq = |s: u64| Bytes::copy_from_slice(&s.to_be_bytes());
    let topic = Bytes::from_static(b"kv-events");
    let mut live = start(SocketType::Pub);
    for s in 0..3 {
        encode_message(&mut live, &[topic.clone(), seq(s), payload.clone()]);
    }
    encode_command(&mut live, "PING", &[0, 0]);
    let mut replay = start(SocketType::Router);
    encode_message(
        &mut replay,
        &[Bytes::new(), topic.clone(), seq(0), payload.clone()],
    );
    encode_message(
        &mut replay,
        &[Bytes::new(), Bytes::new(), seq(u64::MAX), Bytes::new()],
    );
    let mut sub = start(SocketType::Sub);
    encode_message(&mut sub, &[Bytes::from_static(b"\x01kv-events")]);
    encode_command(&mut sub, "SUBSCRIBE", b"kv");
    encode_command(&mut sub, "CANCEL", b"kv");
    let mut dealer = start(SocketType::Dealer);
    encode_message(&mut dealer, &[Bytes::new(), seq(7)]);
    [live, replay, sub, dealer]
        .into_iter()
        .map(|b| b.to_vec())
        .collect()
}

#[test]
fn zmtp_streams_decode_alike_in_any_split() {
    let corpus = zmtp_streams();
    for seed in &corpus {
        assert!(!zmtp_decode(seed, 1 << 20, seed.len()).1);
    }
    run("ZMTP streams", corpus, |data| {
        // A bound that the corpus's batches fit, and one they do not.
        let mut accepted = false;
        for max in [1 << 20, 100] {
            let whole = zmtp_decode(data, max, data.len());
            assert_eq!(
                whole,
                zmtp_decode(data, max, 3),
                "ZMTP decoding depends on the split"
            );
            accepted |= !whole.1;
        }
        accepted
    });
}
