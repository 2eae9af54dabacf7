//! A stuck core: every call gives up at its deadline, and replies that arrive after their
//! caller gave up never answer a later call.

use super::{RuntimeConfig, start};
use crate::error::EngineError;
use crate::event::{KvEvent, StoredBlock};
use crate::hash::seq_hash;
use crate::ids::{EngineHash, SeqHash, TokensHash, WorkerKey};
use crate::sharding::fixed_depth::FixedDepth;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A chain of `n` blocks for `key` starting at tokens hash `first`: the event and its seqs.
fn chain(key: WorkerKey, first: u64, n: u64) -> ((WorkerKey, KvEvent), Vec<SeqHash>) {
    let mut prev = None;
    let (mut blocks, mut seqs) = (vec![], vec![]);
    for t in first..first + n {
        let s = seq_hash(prev, TokensHash(t));
        blocks.push(StoredBlock {
            engine_hash: EngineHash(s.0),
            tokens_hash: TokensHash(t),
        });
        seqs.push(s);
        prev = Some(s);
    }
    let event = KvEvent::Stored {
        parent: None,
        blocks,
    };
    ((key, event), seqs)
}

#[test]
fn a_stuck_core_times_callers_out_and_its_late_replies_are_discarded() {
    let config = RuntimeConfig {
        pin_cores: false,
        call_timeout: Duration::from_millis(100),
        ..RuntimeConfig::default()
    };
    let mut st = start(FixedDepth::new(1, 0).unwrap(), config).unwrap();
    let (mut ingest, mut query) = (st.ingest.remove(0), st.query.remove(0));
    let (short, short_seqs) = chain(WorkerKey::new(1, 0), 10, 2);
    let (long, long_seqs) = chain(WorkerKey::new(2, 0), 100, 5);
    ingest.send(&Arc::from(vec![short, long])).unwrap();
    ingest.sync().unwrap();

    // The core sleeps 600 ms; each call gives up after about 100 ms.
    let t0 = Instant::now();
    let stall = query.stall_core(0, Duration::from_millis(600));
    assert!(
        matches!(stall, Err(EngineError::Timeout { core: 0, .. })),
        "{stall:?}"
    );
    let stuck = query.find_matches(&short_seqs);
    assert!(
        matches!(stuck, Err(EngineError::Timeout { .. })),
        "{stuck:?}"
    );
    let waited = t0.elapsed();
    assert!(
        waited < Duration::from_millis(500),
        "gave up after {waited:?}"
    );

    // Once the core is back, its replies to the two abandoned calls are waiting on the
    // ring ahead of the next reply: the next call still gets its own answer.
    std::thread::sleep(Duration::from_millis(700));
    let m = query.find_matches(&long_seqs).unwrap();
    assert_eq!(m.overlap(WorkerKey::new(2, 0)), 5);
    assert_eq!(m.overlap(WorkerKey::new(1, 0)), 0);
    let m = query.find_matches(&short_seqs).unwrap();
    assert_eq!(m.overlap(WorkerKey::new(1, 0)), 2);
    drop((ingest, query));
    st.runtime.join().unwrap();
}

#[test]
fn a_sync_behind_a_stuck_core_times_out_and_the_next_one_completes() {
    let config = RuntimeConfig {
        pin_cores: false,
        call_timeout: Duration::from_millis(50),
        sync_timeout: Duration::from_millis(100),
        ..RuntimeConfig::default()
    };
    let mut st = start(FixedDepth::new(2, 0).unwrap(), config).unwrap();
    let (mut ingest, mut query) = (st.ingest.remove(0), st.query.remove(0));
    let _ = query.stall_core(1, Duration::from_millis(400));
    let (ev, seqs) = chain(WorkerKey::new(1, 0), 7, 3);
    ingest.send(&Arc::from(vec![ev])).unwrap();
    let synced = ingest.sync();
    assert!(
        matches!(synced, Err(EngineError::Timeout { .. })),
        "{synced:?}"
    );
    std::thread::sleep(Duration::from_millis(450));
    ingest.sync().unwrap();
    let m = query.find_matches(&seqs).unwrap();
    assert_eq!(m.overlap(WorkerKey::new(1, 0)), 3);
    drop((ingest, query));
    st.runtime.join().unwrap();
}

/// Set in the child process of the next test.
const PANIC_CHILD: &str = "KVENGINE_TEST_PANIC_CHILD";

#[test]
fn a_core_that_panics_takes_the_process_down_with_a_message() {
    if std::env::var_os(PANIC_CHILD).is_some() {
        let config = RuntimeConfig {
            pin_cores: false,
            ..RuntimeConfig::default()
        };
        let mut st = start(FixedDepth::new(2, 0).unwrap(), config).unwrap();
        st.query[0].panic_core(1).unwrap();
        // The process ends while this waits; a hang here fails the parent's timeout.
        std::thread::sleep(Duration::from_secs(30));
        std::process::exit(0);
    }
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "runtime::deadline_tests::a_core_that_panics_takes_the_process_down_with_a_message",
            "--nocapture",
        ])
        .env(PANIC_CHILD, "1")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the process hung");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{status:?}");
    assert!(stderr.contains("core 1 panicked"), "{stderr}");
}
