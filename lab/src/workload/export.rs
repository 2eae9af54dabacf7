//! The neutral workload format: an anchor workload's events, queries and expected answers
//! (W1-W4, or the trace replay as [`super::trace_anchor`] makes it an anchor plan) in files
//! any indexer can be timed against (`kvengine bench indexer --export DIR`,
//! `--import DIR`). Documented, with a worked example, in docs/benchmarks.md ("The
//! exported workload format").
//!
//! One directory per workload, version 1:
//!
//! * `manifest.json`: `format` (`"kvengine-indexer-workload"`), `version` (1), `workload`
//!   (its name), `params` and `shape` (the generator's parameters and sizes, as
//!   `kvengine bench indexer` reports them), `phases` (per phase: file, events, stored and
//!   removed blocks), `queries` (per query list: file, count), `answers` (file, count),
//!   `entries_after_base` and the generator's version.
//! * `base.events`, `extra.events`, `remove.events`: the phases' events, in order. Magic
//!   `KVEVENT1`, then the event count (u64), then each event: kind (u8: 1 stored, 2
//!   removed, 3 cleared), worker id (u64), dp rank (u32); a store then has a parent flag
//!   (u8, 0 or 1), the parent's engine hash (u64, 0 without a parent), a block count (u32)
//!   and per block its engine hash and tokens hash (u64 each); a removal has a block count
//!   (u32) and the engine hashes (u64 each); a clear has nothing more.
//! * `hit.queries`, `prefix.queries`: magic `KVQUERY1`, the query count (u64), then each
//!   query: its block count (u32), the blocks' tokens hashes (u64 each, from the prompt's
//!   first block on) and the id of its expected answer (u64). Chain them into seq_hashes
//!   with DESIGN.md's rule: the first block's seq_hash is its tokens hash, each later
//!   one `xxh3_64(le(parent seq_hash) ++ le(tokens hash), seed 1337)`.
//! * `answers.bin`: magic `KVANSWR1`, the answer count (u64), then each answer: its holder
//!   count (u32) and per holder, sorted by (worker, dp rank), worker id (u64), dp rank
//!   (u32) and the overlap in blocks (u32). An indexer is right on a query when it names
//!   exactly these holders with exactly these overlaps (after the base phase, before the
//!   extra one).
//!
//! Every integer is little-endian. The phases run as the anchor harness runs them
//! (`crate::anchor`): store `base`, query (hit, prefix-only; one caller, then the hit
//! queries over two), apply `extra` while querying, apply `remove`, after which nothing
//! may match.
//!
//! # Invariants
//! 1. [`import`] of what [`export`] wrote gives the same plan: the same events in the same
//!    order, the same queries (seq_hashes and tokens hashes), the same answers and sizes.
//! 2. Reading never panics and never allocates more than the file's size justifies: a
//!    count is checked against the bytes left before anything is reserved; a short, long
//!    or foreign file, a version other than 1, an unknown event kind or an answer id out
//!    of range is an error that names the file.
//! 3. An imported plan carries no generator provenance (`groups`, `hit_sequences`,
//!    `prefix_groups` and `holders` are empty): only what the files hold is checked.

use super::anchor::{AnchorPlan, AnchorShape, AnchorSpec, Expected};
use super::phase::{Phase, PhaseBuilder};
use super::query::Query;
use super::spec::WorkloadKind;
use anyhow::{Context, Result, bail};
use engine::event::{KvEvent, StoredBlock};
use engine::hash::seq_hash;
use engine::{DpRank, EngineHash, SeqHash, TokensHash, WorkerId, WorkerKey};
use serde::{Deserialize, Serialize};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

/// The manifest's `format`.
pub const FORMAT: &str = "kvengine-indexer-workload";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;

const EVENTS_MAGIC: &[u8; 8] = b"KVEVENT1";
const QUERIES_MAGIC: &[u8; 8] = b"KVQUERY1";
const ANSWERS_MAGIC: &[u8; 8] = b"KVANSWR1";

const STORED: u8 = 1;
const REMOVED: u8 = 2;
const CLEARED: u8 = 3;

/// The phases, in the order they run: (name, file).
const PHASES: [(&str, &str); 3] = [
    ("base", "base.events"),
    ("extra", "extra.events"),
    ("remove", "remove.events"),
];
/// The query lists: (name, file).
const QUERY_LISTS: [(&str, &str); 2] = [("hit", "hit.queries"), ("prefix", "prefix.queries")];
const ANSWERS_FILE: &str = "answers.bin";
const MANIFEST_FILE: &str = "manifest.json";

/// `manifest.json`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// The workload's name (`dynamo-w1` ..).
    pub workload: String,
    /// What wrote it (`kvengine-lab` and its version).
    pub generator: String,
    /// The generator's parameters (informative).
    pub params: serde_json::Value,
    /// The generator's sizes (informative, except `entries_after_base`).
    pub shape: serde_json::Value,
    /// Live (block, worker) entries after the base phase.
    pub entries_after_base: u64,
    /// The phases, in order.
    pub phases: Vec<PhaseEntry>,
    /// The query lists.
    pub queries: Vec<FileCount>,
    /// The answers.
    pub answers: FileCount,
}

/// One phase in the manifest.
#[derive(Debug, Serialize, Deserialize)]
pub struct PhaseEntry {
    /// `base`, `extra` or `remove`.
    pub name: String,
    /// Its file, relative to the directory.
    pub file: String,
    /// Events.
    pub events: u64,
    /// Blocks stored.
    pub stored_blocks: u64,
    /// Blocks removed.
    pub removed_blocks: u64,
}

/// A file and how many records it holds.
#[derive(Debug, Serialize, Deserialize)]
pub struct FileCount {
    /// What it holds (`hit`, `prefix`, `answers`).
    pub name: String,
    /// Its file, relative to the directory.
    pub file: String,
    /// Records.
    pub count: u64,
}

/// Writes `plan` into `dir` (created if missing) in the format above; returns the bytes
/// written.
pub fn export(plan: &AnchorPlan, dir: &Path) -> Result<u64> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut bytes = 0u64;
    let phases = [&plan.base, &plan.extra, &plan.remove];
    let mut entries = Vec::new();
    for ((name, file), phase) in PHASES.iter().zip(phases) {
        bytes += write_file(&dir.join(file), |w| write_events(w, phase))?;
        entries.push(PhaseEntry {
            name: (*name).into(),
            file: (*file).into(),
            events: phase.events,
            stored_blocks: phase.stored_blocks,
            removed_blocks: phase.removed_blocks,
        });
    }
    let lists = [
        (&plan.hit_tokens, &plan.hit_answers),
        (&plan.prefix_tokens, &plan.prefix_answers),
    ];
    let mut queries = Vec::new();
    for ((name, file), (tokens, answers)) in QUERY_LISTS.iter().zip(lists) {
        if tokens.len() != answers.len() {
            bail!(
                "{name}: {} queries but {} answer ids",
                tokens.len(),
                answers.len()
            );
        }
        bytes += write_file(&dir.join(file), |w| write_queries(w, tokens, answers))?;
        queries.push(FileCount {
            name: (*name).into(),
            file: (*file).into(),
            count: tokens.len() as u64,
        });
    }
    bytes += write_file(&dir.join(ANSWERS_FILE), |w| write_answers(w, &plan.answers))?;
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        workload: plan.spec.kind.name().into(),
        generator: format!("kvengine-lab {}", env!("CARGO_PKG_VERSION")),
        params: serde_json::to_value(&plan.spec)?,
        shape: serde_json::to_value(&plan.shape)?,
        entries_after_base: plan.shape.entries_after_base,
        phases: entries,
        queries,
        answers: FileCount {
            name: "answers".into(),
            file: ANSWERS_FILE.into(),
            count: plan.answers.len() as u64,
        },
    };
    let json = serde_json::to_vec_pretty(&manifest)?;
    bytes += json.len() as u64;
    std::fs::write(dir.join(MANIFEST_FILE), json)
        .with_context(|| format!("writing {}", dir.join(MANIFEST_FILE).display()))?;
    Ok(bytes)
}

/// Reads the workload in `dir` back into a plan (invariants 1-3).
pub fn import(dir: &Path) -> Result<AnchorPlan> {
    let path = dir.join(MANIFEST_FILE);
    let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let manifest: Manifest = serde_json::from_slice(&text)
        .with_context(|| format!("{}: not a workload manifest", path.display()))?;
    if manifest.format != FORMAT {
        bail!(
            "{}: format {:?}, expected {FORMAT:?}",
            path.display(),
            manifest.format
        );
    }
    if manifest.version != VERSION {
        bail!(
            "{}: format version {}, this build reads {VERSION}",
            path.display(),
            manifest.version
        );
    }
    let Some(kind) = WorkloadKind::from_name(&manifest.workload)
        .filter(|k| k.is_anchor() || *k == WorkloadKind::Trace)
    else {
        bail!(
            "{}: workload {:?} is not one of dynamo-w1 .. dynamo-w4, trace",
            path.display(),
            manifest.workload
        );
    };
    let mut spec = serde_json::from_value::<AnchorSpec>(manifest.params.clone())
        .with_context(|| format!("{}: params", path.display()))?;
    spec.kind = kind;
    let mut shape = serde_json::from_value::<AnchorShape>(manifest.shape.clone())
        .with_context(|| format!("{}: shape", path.display()))?;
    shape.entries_after_base = manifest.entries_after_base;
    let phase = |name: &str| -> Result<Phase> {
        let Some(e) = manifest.phases.iter().find(|p| p.name == name) else {
            bail!("{}: no phase {name:?}", path.display());
        };
        let file = dir.join(&e.file);
        let bytes = read(&file)?;
        let phase = read_events(&bytes).with_context(|| file.display().to_string())?;
        if (phase.events, phase.stored_blocks, phase.removed_blocks)
            != (e.events, e.stored_blocks, e.removed_blocks)
        {
            bail!(
                "{}: {} events, {} stored and {} removed blocks, the manifest says {}, {}, {}",
                file.display(),
                phase.events,
                phase.stored_blocks,
                phase.removed_blocks,
                e.events,
                e.stored_blocks,
                e.removed_blocks
            );
        }
        Ok(phase)
    };
    let (base, extra, remove) = (phase("base")?, phase("extra")?, phase("remove")?);
    let answers_file = dir.join(&manifest.answers.file);
    let answers =
        read_answers(&read(&answers_file)?).with_context(|| answers_file.display().to_string())?;
    let list = |name: &str| -> Result<Queries> {
        let Some(e) = manifest.queries.iter().find(|q| q.name == name) else {
            bail!("{}: no query list {name:?}", path.display());
        };
        let file = dir.join(&e.file);
        let q = read_queries(&read(&file)?, answers.len() as u64)
            .with_context(|| file.display().to_string())?;
        if q.seqs.len() as u64 != e.count {
            bail!(
                "{}: {} queries, the manifest says {}",
                file.display(),
                q.seqs.len(),
                e.count
            );
        }
        Ok(q)
    };
    let (hit, prefix) = (list("hit")?, list("prefix")?);
    Ok(AnchorPlan {
        spec,
        shape,
        groups: Vec::new(),
        base,
        extra,
        remove,
        hit_queries: hit.seqs,
        hit_sequences: Vec::new(),
        prefix_queries: prefix.seqs,
        prefix_groups: Vec::new(),
        holders: Vec::new(),
        hit_tokens: hit.tokens,
        prefix_tokens: prefix.tokens,
        answers,
        hit_answers: hit.answers,
        prefix_answers: prefix.answers,
    })
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

fn write_file(
    path: &Path,
    body: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<u64> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = Counting {
        inner: BufWriter::new(file),
        bytes: 0,
    };
    body(&mut w)
        .and_then(|()| w.flush())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(w.bytes)
}

/// A writer that counts what goes through it.
struct Counting<W> {
    inner: W,
    bytes: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn u32_of(n: usize) -> std::io::Result<[u8; 4]> {
    u32::try_from(n)
        .map(u32::to_le_bytes)
        .map_err(|_| std::io::Error::other("more than 2^32 - 1 items in one record"))
}

fn write_events(w: &mut dyn Write, phase: &Phase) -> std::io::Result<()> {
    w.write_all(EVENTS_MAGIC)?;
    w.write_all(&phase.events.to_le_bytes())?;
    for (key, event) in phase.iter() {
        let kind = match event {
            KvEvent::Stored { .. } => STORED,
            KvEvent::Removed { .. } => REMOVED,
            KvEvent::Cleared => CLEARED,
        };
        w.write_all(&[kind])?;
        w.write_all(&key.worker.0.to_le_bytes())?;
        w.write_all(&key.dp_rank.0.to_le_bytes())?;
        match event {
            KvEvent::Stored { parent, blocks } => {
                w.write_all(&[u8::from(parent.is_some())])?;
                w.write_all(&parent.map_or(0, |p| p.0).to_le_bytes())?;
                w.write_all(&u32_of(blocks.len())?)?;
                for b in blocks {
                    w.write_all(&b.engine_hash.0.to_le_bytes())?;
                    w.write_all(&b.tokens_hash.0.to_le_bytes())?;
                }
            }
            KvEvent::Removed { blocks } => {
                w.write_all(&u32_of(blocks.len())?)?;
                for b in blocks {
                    w.write_all(&b.0.to_le_bytes())?;
                }
            }
            KvEvent::Cleared => {}
        }
    }
    Ok(())
}

fn write_queries(
    w: &mut dyn Write,
    tokens: &[Arc<[TokensHash]>],
    answers: &[u64],
) -> std::io::Result<()> {
    w.write_all(QUERIES_MAGIC)?;
    w.write_all(&(tokens.len() as u64).to_le_bytes())?;
    for (q, answer) in tokens.iter().zip(answers) {
        w.write_all(&u32_of(q.len())?)?;
        for t in q.iter() {
            w.write_all(&t.0.to_le_bytes())?;
        }
        w.write_all(&answer.to_le_bytes())?;
    }
    Ok(())
}

fn write_answers(w: &mut dyn Write, answers: &[Expected]) -> std::io::Result<()> {
    w.write_all(ANSWERS_MAGIC)?;
    w.write_all(&(answers.len() as u64).to_le_bytes())?;
    for a in answers {
        w.write_all(&u32_of(a.len())?)?;
        for (key, overlap) in a {
            w.write_all(&key.worker.0.to_le_bytes())?;
            w.write_all(&key.dp_rank.0.to_le_bytes())?;
            w.write_all(&overlap.to_le_bytes())?;
        }
    }
    Ok(())
}

/// A cursor over a file's bytes that refuses to read past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// Checks the magic and reads the record count, which must fit in what is left at
    /// `min_record` bytes each (invariant 2).
    fn open(bytes: &'a [u8], magic: &[u8; 8], min_record: usize) -> Result<(Self, usize)> {
        let mut r = Self { bytes, at: 0 };
        if r.take(8)? != magic {
            bail!(
                "not a {} file (or another version of the format)",
                String::from_utf8_lossy(magic)
            );
        }
        let count = r.u64()?;
        let count = r.fits(count, min_record)?;
        Ok((r, count))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            bail!("ends early, at byte {} of {}", self.at, self.bytes.len());
        };
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }

    /// Whether `count` items of `size` bytes can still follow.
    fn fits(&self, count: u64, size: usize) -> Result<usize> {
        let left = self.bytes.len() - self.at;
        let need = u128::from(count) * size as u128;
        if need > left as u128 {
            bail!(
                "claims {count} records of at least {size} bytes at byte {}, but {left} bytes are left",
                self.at
            );
        }
        Ok(count as usize)
    }

    fn done(&self) -> Result<()> {
        if self.at != self.bytes.len() {
            bail!("{} bytes after the last record", self.bytes.len() - self.at);
        }
        Ok(())
    }
}

/// The events of one phase, in one stream.
fn read_events(bytes: &[u8]) -> Result<Phase> {
    // The shortest event, a clear: kind, worker, rank.
    let (mut r, count) = Reader::open(bytes, EVENTS_MAGIC, 13)?;
    let mut b = PhaseBuilder::new(1);
    for i in 0..count {
        let kind = r.u8()?;
        let key = WorkerKey {
            worker: WorkerId(r.u64()?),
            dp_rank: DpRank(r.u32()?),
        };
        let event = match kind {
            STORED => {
                let has_parent = r.u8()?;
                let parent = r.u64()?;
                let parent = match has_parent {
                    0 => None,
                    1 => Some(EngineHash(parent)),
                    f => bail!("event {i}: parent flag {f} (0 or 1)"),
                };
                let n = r.u32()?;
                let n = r.fits(u64::from(n), 16)?;
                let mut blocks = Vec::with_capacity(n);
                for _ in 0..n {
                    blocks.push(StoredBlock {
                        engine_hash: EngineHash(r.u64()?),
                        tokens_hash: TokensHash(r.u64()?),
                    });
                }
                KvEvent::Stored { parent, blocks }
            }
            REMOVED => {
                let n = r.u32()?;
                let n = r.fits(u64::from(n), 8)?;
                let mut blocks = Vec::with_capacity(n);
                for _ in 0..n {
                    blocks.push(EngineHash(r.u64()?));
                }
                KvEvent::Removed { blocks }
            }
            CLEARED => KvEvent::Cleared,
            k => bail!("event {i}: unknown kind {k} (1 stored, 2 removed, 3 cleared)"),
        };
        b.push(key, event);
    }
    r.done()?;
    Ok(b.finish())
}

/// A query list as read: seq_hashes chained from the tokens hashes.
struct Queries {
    seqs: Vec<Query>,
    tokens: Vec<Arc<[TokensHash]>>,
    answers: Vec<u64>,
}

fn read_queries(bytes: &[u8], answers: u64) -> Result<Queries> {
    // The shortest query: no blocks, an answer id.
    let (mut r, count) = Reader::open(bytes, QUERIES_MAGIC, 12)?;
    let mut out = Queries {
        seqs: Vec::with_capacity(count),
        tokens: Vec::with_capacity(count),
        answers: Vec::with_capacity(count),
    };
    for i in 0..count {
        let n = r.u32()?;
        let n = r.fits(u64::from(n), 8)?;
        let mut tokens = Vec::with_capacity(n);
        let mut seqs: Vec<SeqHash> = Vec::with_capacity(n);
        for _ in 0..n {
            let t = TokensHash(r.u64()?);
            seqs.push(seq_hash(seqs.last().copied(), t));
            tokens.push(t);
        }
        let answer = r.u64()?;
        if answer >= answers {
            bail!("query {i}: answer {answer}, but there are {answers} answers");
        }
        out.seqs.push(Arc::from(seqs));
        out.tokens.push(Arc::from(tokens));
        out.answers.push(answer);
    }
    r.done()?;
    Ok(out)
}

fn read_answers(bytes: &[u8]) -> Result<Vec<Expected>> {
    let (mut r, count) = Reader::open(bytes, ANSWERS_MAGIC, 4)?;
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let n = r.u32()?;
        let n = r.fits(u64::from(n), 16)?;
        let mut answer = Vec::with_capacity(n);
        for _ in 0..n {
            let key = WorkerKey {
                worker: WorkerId(r.u64()?),
                dp_rank: DpRank(r.u32()?),
            };
            answer.push((key, r.u32()?));
        }
        if !answer.windows(2).all(|p| p[0].0 < p[1].0) {
            bail!("answer {i}: holders not sorted by (worker, dp rank) or repeated");
        }
        out.push(answer);
    }
    r.done()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn foreign_and_truncated_files_are_errors_not_panics() {
        assert!(read_events(b"").is_err());
        assert!(read_events(b"KVEVENT2\0\0\0\0\0\0\0\0").is_err());
        // Claims 2^60 events in no bytes: refused before anything is reserved.
        let mut huge = EVENTS_MAGIC.to_vec();
        huge.extend((1u64 << 60).to_le_bytes());
        assert!(read_events(&huge).is_err());
        let mut one = EVENTS_MAGIC.to_vec();
        one.extend(1u64.to_le_bytes());
        one.push(9);
        one.extend([0u8; 12]);
        let e = read_events(&one).unwrap_err().to_string();
        assert!(e.contains("unknown kind 9"), "{e}");
        let mut q = QUERIES_MAGIC.to_vec();
        q.extend(1u64.to_le_bytes());
        q.extend(0u32.to_le_bytes());
        q.extend(5u64.to_le_bytes());
        let e = read_queries(&q, 5).err().map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("answer 5")));
        assert!(read_queries(&q, 6).is_ok());
        let mut a = ANSWERS_MAGIC.to_vec();
        a.extend(0u64.to_le_bytes());
        a.push(0);
        assert!(read_answers(&a).is_err(), "a byte after the last record");
    }
}
