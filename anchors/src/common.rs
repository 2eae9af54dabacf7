//! What the adapters share: the worker-key mapping. (The concurrent mixed phase is the
//! lab's `driver::concurrent_mixed`.)

use engine::WorkerKey;

/// SMG names workers by string: kvengine's worker key as `"worker/dp_rank"`.
pub fn worker_name(key: WorkerKey) -> String {
    format!("{}/{}", key.worker.0, key.dp_rank.0)
}
