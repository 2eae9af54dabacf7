//! Fuzzes snapshot restore (`--state-dir` files and peer replicas' snapshots): the input is
//! the archive of a snapshot file, which the target frames as a file (header, lengths and
//! the checksum recomputed, so mutations reach past the checksum), then decodes, checks as
//! a restore does (transport's layout check), and rebuilds every core's shard and
//! directories from. Nothing may panic, hang on a count the bytes do not back, or allocate
//! for one. Run: `cd fuzz && cargo +nightly fuzz run snapshot_file`.
#![no_main]

use engine::sharding::ShardId;
use engine::sharding::adaptive::Adaptive;
use engine::sharding::ingest::Ingest;
use engine::sharding::shard::Shard;
use engine::snapshot::{self, FORMAT_VERSION, HEADER_LEN, MAGIC};
use libfuzzer_sys::fuzz_target;

/// `archive` (and no meta) as the bytes of a snapshot file, in an aligned buffer.
fn file_of(archive: &[u8]) -> rkyv::util::AlignedVec<16> {
    let mut out = rkyv::util::AlignedVec::<16>::with_capacity(HEADER_LEN + archive.len());
    let mut header = [0u8; HEADER_LEN];
    header[..8].copy_from_slice(&MAGIC);
    header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    header[16..24].copy_from_slice(&(archive.len() as u64).to_le_bytes());
    header[32..40].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(archive).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(archive);
    out
}

fuzz_target!(|data: &[u8]| {
    let file = file_of(data);
    let Ok((image, _)) = snapshot::decode(&file) else {
        return;
    };
    let shards = image.cores.len();
    if shards == 0 || shards > 64 || image.shards.to_native() as usize != shards {
        return;
    }
    let Ok(policy) = Adaptive::new(shards, 2) else {
        return;
    };
    for (k, core) in image.cores.iter().enumerate() {
        let mut shard = Shard::new(ShardId(k as u16));
        let _ = shard.restore_image(core);
        let mut ingest = Ingest::new(policy.clone());
        let _ = ingest.restore(core);
    }
});
