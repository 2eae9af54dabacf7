//! Snapshots of the whole engine, for a warm restart (issue 12).
//!
//! A snapshot is the engine at one consistent cut: every shard's tree, every worker key's
//! directory, the trunk, and per numbered event stream the last batch applied (its *mark*).
//! The runtime takes it without stopping ingest for longer than a promotion round (see
//! `runtime::promotion`, "snapshot rounds"); the transport writes it to disk and, on
//! start, restores the cores from it and asks each stream's publisher to replay what came
//! after its mark.
//!
//! # File layout
//! A 48-byte header, then the rkyv archive of an [`EngineImage`], then the caller's own
//! bytes (`meta`: the transport keeps its worker registry there):
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 8 | magic `KVESNAP\0` |
//! | 8 | 4 | [`FORMAT_VERSION`], little-endian |
//! | 12 | 4 | reserved (0) |
//! | 16 | 8 | archive length |
//! | 24 | 8 | meta length |
//! | 32 | 8 | XXH3-64 of archive and meta |
//! | 40 | 8 | reserved (0) |
//!
//! The archive starts 48 bytes in, so a buffer aligned to 16 bytes (rkyv's `AlignedVec`)
//! holds it aligned, and it is validated with bytecheck and read in place.
//!
//! # Versions
//! Format 2 added each mark's digest (the last batch's bytes, so that a restart can prove
//! the publisher still numbers the same history). [`upgrade`] turns a format-1 file into a
//! format-2 one whose marks have no digest: a restore treats them as unverified.
//!
//! # Invariants
//! 1. [`decode`] accepts exactly what [`encode`] wrote: any other length, checksum, magic or
//!    version is refused with [`EngineError::BadSnapshot`], never a panic. [`upgrade`]
//!    likewise refuses (never panics on) anything but a whole format-1 file.
//! 2. Restoring an image gives an engine that answers every query and applies every later
//!    event exactly as the engine it was taken from (tested against the reference model).

pub mod image;

pub use image::{
    ArchivedCoreImage, ArchivedEngineImage, CoreImage, EngineImage, EntryRec, HolderRec, KeyRec,
    MarkRec, NodeRec, PinRec, TrunkImage,
};

use crate::error::{EngineError, Result};
use crate::ids::WorkerId;
use rkyv::rancor;
use rkyv::util::AlignedVec;
use xxhash_rust::xxh3::xxh3_64;

/// The layout version [`encode`] writes and [`decode`] accepts.
pub const FORMAT_VERSION: u32 = 2;
/// The first 8 bytes of every snapshot file.
pub const MAGIC: [u8; 8] = *b"KVESNAP\0";
/// Bytes before the archive.
pub const HEADER_LEN: usize = 48;

/// The last batch applied from one numbered event stream of a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamMark {
    /// The worker.
    pub worker: WorkerId,
    /// Which of its streams (the transport's numbering).
    pub stream: u32,
    /// The batch's number.
    pub seq: u64,
    /// A digest of the batch's bytes (see [`MarkRec::digest`]); `None`: none known.
    pub digest: Option<u64>,
}

/// An empty image with room for a core of about this size (nodes, blocks, directory
/// entries), its memory already touched: a snapshot's requester builds these, so the
/// frozen cores copy into memory that takes no page fault (measured at 10 M entries: the
/// first cut into fresh memory took 0.5-1 s, the later ones 0.06-0.08 s).
pub fn prepared(nodes: usize, blocks: usize, entries: usize) -> CoreImage {
    // A little slack for what arrives between the sizing and the cut, and for blocks
    // nobody holds that only carry structure.
    let more = |n: usize| n + n / 8 + 16;
    let mut image = CoreImage {
        nodes: Vec::with_capacity(more(nodes)),
        seqs: Vec::with_capacity(more(blocks)),
        holders: Vec::with_capacity(more(nodes)),
        keys: Vec::new(),
        entries: Vec::with_capacity(more(entries)),
        marks: Vec::new(),
    };
    touch(&mut image.nodes);
    touch(&mut image.seqs);
    touch(&mut image.holders);
    touch(&mut image.entries);
    image
}

/// Writes zeros over `v`'s spare capacity (its pages are then mapped), leaving it empty.
fn touch<T>(v: &mut Vec<T>) {
    for slot in v.spare_capacity_mut() {
        *slot = std::mem::MaybeUninit::zeroed();
    }
}

fn bad(reason: impl Into<String>) -> EngineError {
    EngineError::BadSnapshot(reason.into())
}

/// The file's bytes for `image`, with `meta` after it. The archive is serialized straight
/// after the header's room in one buffer (no copy of it afterwards: at 10 M entries it is
/// about 280 MB).
pub fn encode(image: &EngineImage, meta: &[u8]) -> Result<AlignedVec> {
    let mut out = AlignedVec::<16>::new();
    out.extend_from_slice(&[0u8; HEADER_LEN]);
    // Positions inside the archive are relative to each other, and HEADER_LEN keeps the
    // 16-byte alignment, so the archive reads in place from `HEADER_LEN` on.
    let mut out = rkyv::api::high::to_bytes_in::<_, rancor::Error>(image, out)
        .map_err(|e| bad(e.to_string()))?;
    let archive_len = out.len() - HEADER_LEN;
    out.extend_from_slice(meta);
    let sum = xxh3_64(out.get(HEADER_LEN..).unwrap_or_default());
    let mut header = [0u8; HEADER_LEN];
    header[..8].copy_from_slice(&MAGIC);
    header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    header[16..24].copy_from_slice(&(archive_len as u64).to_le_bytes());
    header[24..32].copy_from_slice(&(meta.len() as u64).to_le_bytes());
    header[32..40].copy_from_slice(&sum.to_le_bytes());
    if let Some(h) = out.get_mut(..HEADER_LEN) {
        h.copy_from_slice(&header);
    }
    Ok(out)
}

fn u64_at(bytes: &[u8], at: usize) -> Result<u64> {
    bytes
        .get(at..at + 8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| bad("truncated header"))
}

/// The format version in a snapshot file's header.
fn version_of(bytes: &[u8]) -> Result<u32> {
    if bytes.len() < HEADER_LEN || bytes.get(..8) != Some(&MAGIC[..]) {
        return Err(bad("not a kvengine snapshot"));
    }
    bytes
        .get(8..12)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| bad("truncated header"))
}

/// The archive and meta bytes of a checked file of any version.
fn body_of(bytes: &[u8]) -> Result<(&[u8], &[u8])> {
    let archive_len = usize::try_from(u64_at(bytes, 16)?).map_err(|_| bad("bad length"))?;
    let meta_len = usize::try_from(u64_at(bytes, 24)?).map_err(|_| bad("bad length"))?;
    let sum = u64_at(bytes, 32)?;
    let body = bytes.get(HEADER_LEN..).unwrap_or_default();
    if Some(body.len()) != archive_len.checked_add(meta_len) {
        return Err(bad(format!(
            "{} bytes after the header, the header says {archive_len} + {meta_len}",
            body.len()
        )));
    }
    if xxh3_64(body) != sum {
        return Err(bad("checksum mismatch"));
    }
    Ok(body.split_at(archive_len))
}

/// The archived image and the meta bytes of a snapshot file, checked (invariant 1).
/// `bytes` must start 16-byte aligned (read the file into an `AlignedVec`).
pub fn decode(bytes: &[u8]) -> Result<(&ArchivedEngineImage, &[u8])> {
    let version = version_of(bytes)?;
    if version != FORMAT_VERSION {
        return Err(bad(format!(
            "format version {version}; this build reads {FORMAT_VERSION}"
        )));
    }
    let (archive, meta) = body_of(bytes)?;
    let image = rkyv::access::<ArchivedEngineImage, rancor::Error>(archive)
        .map_err(|e| bad(format!("invalid archive: {e}")))?;
    Ok((image, meta))
}

/// A format-1 file rewritten as the current format, its marks without digest (so a
/// restore cannot trust them); `Ok(None)` for a file already in the current format (or
/// any other version, which [`decode`] then refuses). `bytes` must start 16-byte aligned.
pub fn upgrade(bytes: &[u8]) -> Result<Option<AlignedVec>> {
    if version_of(bytes)? != 1 {
        return Ok(None);
    }
    let (archive, meta) = body_of(bytes)?;
    let mut aligned = AlignedVec::<16>::with_capacity(archive.len());
    aligned.extend_from_slice(archive);
    let old: image::v1::EngineImage =
        rkyv::from_bytes::<image::v1::EngineImage, rancor::Error>(&aligned)
            .map_err(|e| bad(format!("invalid format-1 archive: {e}")))?;
    drop(aligned);
    let image = EngineImage {
        shards: old.shards,
        policy: old.policy,
        trunk: old.trunk,
        cores: old
            .cores
            .into_iter()
            .map(|c| CoreImage {
                nodes: c.nodes,
                seqs: c.seqs,
                holders: c.holders,
                keys: c.keys,
                entries: c.entries,
                marks: c
                    .marks
                    .into_iter()
                    .map(|m| MarkRec {
                        worker: m.worker,
                        stream: m.stream,
                        seq: m.seq,
                        digest: None,
                    })
                    .collect(),
            })
            .collect(),
    };
    encode(&image, meta).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> EngineImage {
        EngineImage {
            shards: 2,
            policy: "adaptive".into(),
            trunk: TrunkImage {
                version: 3,
                members: vec![1, 2],
                pins: vec![PinRec { seq: 5, shard: 1 }],
            },
            cores: vec![
                CoreImage {
                    nodes: vec![NodeRec {
                        parent: 0,
                        root: true,
                        len: 2,
                        holders: 1,
                    }],
                    seqs: vec![7, 8],
                    holders: vec![HolderRec {
                        worker: 1,
                        rank: 0,
                        count: 1,
                    }],
                    keys: vec![KeyRec {
                        worker: 1,
                        rank: 0,
                        len: 1,
                    }],
                    entries: vec![EntryRec {
                        engine: 70,
                        seq: 7,
                        route: 0,
                        count: 1,
                    }],
                    marks: vec![MarkRec {
                        worker: 1,
                        stream: 0,
                        seq: 41,
                        digest: Some(0xfeed),
                    }],
                },
                CoreImage::default(),
            ],
        }
    }

    fn aligned(bytes: &[u8]) -> AlignedVec {
        let mut v = AlignedVec::new();
        v.extend_from_slice(bytes);
        v
    }

    #[test]
    fn the_archive_starts_aligned_after_the_header() {
        let bytes = encode(&sample(), b"").unwrap();
        assert_eq!(bytes.as_ptr() as usize % 16, 0);
        assert!(decode(&bytes).is_ok());
    }

    #[test]
    fn round_trips_image_and_meta() {
        let img = sample();
        let bytes = aligned(&encode(&img, b"{\"workers\":[]}").unwrap());
        let (archived, meta) = decode(&bytes).unwrap();
        let back: EngineImage = rkyv::deserialize::<_, rancor::Error>(archived).unwrap();
        assert_eq!(back, img);
        assert_eq!(meta, b"{\"workers\":[]}");
    }

    #[test]
    fn refuses_damage_of_every_kind() {
        let good = encode(&sample(), b"m").unwrap().to_vec();
        let mut cases: Vec<Vec<u8>> = vec![Vec::new(), good[..HEADER_LEN - 1].to_vec()];
        cases.push(good[..good.len() - 1].to_vec());
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        cases.push(flipped);
        let mut magic = good.clone();
        magic[0] = b'X';
        cases.push(magic);
        let mut version = good.clone();
        version[8] = 9;
        cases.push(version);
        let mut archive_byte = good.clone();
        archive_byte[HEADER_LEN + 3] ^= 0x40;
        cases.push(archive_byte);
        for c in cases {
            assert!(matches!(
                decode(&aligned(&c)),
                Err(EngineError::BadSnapshot(_))
            ));
        }
    }

    /// A file in format 1 (marks without digest), as older builds wrote it.
    fn format_1(image: &EngineImage, meta: &[u8]) -> AlignedVec {
        let old = image::v1::EngineImage {
            shards: image.shards,
            policy: image.policy.clone(),
            trunk: image.trunk.clone(),
            cores: image
                .cores
                .iter()
                .map(|c| image::v1::CoreImage {
                    nodes: c.nodes.clone(),
                    seqs: c.seqs.clone(),
                    holders: c.holders.clone(),
                    keys: c.keys.clone(),
                    entries: c.entries.clone(),
                    marks: c
                        .marks
                        .iter()
                        .map(|m| image::v1::MarkRec {
                            worker: m.worker,
                            stream: m.stream,
                            seq: m.seq,
                        })
                        .collect(),
                })
                .collect(),
        };
        let archive = rkyv::to_bytes::<rancor::Error>(&old).unwrap();
        let mut out = AlignedVec::<16>::new();
        let mut header = [0u8; HEADER_LEN];
        header[..8].copy_from_slice(&MAGIC);
        header[8..12].copy_from_slice(&1u32.to_le_bytes());
        header[16..24].copy_from_slice(&(archive.len() as u64).to_le_bytes());
        header[24..32].copy_from_slice(&(meta.len() as u64).to_le_bytes());
        let mut body = archive.to_vec();
        body.extend_from_slice(meta);
        header[32..40].copy_from_slice(&xxh3_64(&body).to_le_bytes());
        out.extend_from_slice(&header);
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn a_format_1_file_upgrades_with_unverified_marks() {
        let img = sample();
        let old = format_1(&img, b"meta");
        assert!(
            decode(&old).is_err(),
            "format 1 is not read as the current one"
        );
        let new = upgrade(&old).unwrap().expect("upgraded");
        let (archived, meta) = decode(&new).unwrap();
        let back: EngineImage = rkyv::deserialize::<_, rancor::Error>(archived).unwrap();
        let mut want = img;
        for c in &mut want.cores {
            for m in &mut c.marks {
                m.digest = None;
            }
        }
        assert_eq!(back, want);
        assert_eq!(meta, b"meta");
        // A current file needs nothing; damage is refused, never a panic.
        let current = encode(&sample(), b"").unwrap();
        assert!(upgrade(&current).unwrap().is_none());
        let mut damaged = old.to_vec();
        let last = damaged.len() - 1;
        damaged[last] ^= 1;
        assert!(upgrade(&aligned(&damaged)).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        use rand::{Rng, SeedableRng};
        let good = encode(&sample(), b"").unwrap().to_vec();
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        for _ in 0..2_000 {
            let mut b = good.clone();
            for _ in 0..rng.random_range(1..4) {
                let i = rng.random_range(0..b.len());
                b[i] = rng.random();
            }
            // The checksum is recomputed so that damage reaches the archive validation.
            let sum = xxh3_64(&b[HEADER_LEN..]);
            b[32..40].copy_from_slice(&sum.to_le_bytes());
            b[..8].copy_from_slice(&MAGIC);
            b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
            let _ = decode(&aligned(&b));
        }
    }
}
