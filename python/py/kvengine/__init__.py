"""kvengine in Python: the exact KV-cache-aware index and router, in-process.

```python
import kvengine

router = kvengine.KvRouter(kv_cache_block_size=16)
router.subscribe_zmq(1, "tcp://gpu-1:5557", replay="tcp://gpu-1:5558")
router.subscribe_zmq(2, "tcp://gpu-2:5557", replay="tcp://gpu-2:5558")
decision = router.route(prompt_token_ids)        # -> Decision(worker_id=2, overlap_blocks=37, ...)
...                                               # send the request to decision.worker_id
router.free(decision.request_id)
```

* `KvIndexer`: the index alone (Dynamo's `KvIndexer` surface): `apply_events`,
  `subscribe_zmq`, `find_matches_for_request`, `find_matches`, `compute_block_hashes`.
* `KvRouter`: the index plus the scheduler: `route` -> `Decision`, `mark_prefilled`,
  `free`, `update_load`; `KvRouter(policy=fn)` lets a Python function choose among the
  scored `Candidate`s.
* `Client`: a running `kvengine` server's HTTP API.
* `compute_block_hashes` / `compute_seq_hashes`: bit-exact with Dynamo's block hashes.

The index work runs in Rust with the GIL released; every class may be used from several
threads at once. See docs/python.md.
"""

from ._kvengine import (
    DEFAULT_BLOCK_SIZE,
    Candidate,
    Decision,
    EngineError,
    KvIndexer,
    KvRouter,
    compute_block_hashes,
    compute_seq_hashes,
)
from .client import ApiError, Client

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "ApiError",
    "Candidate",
    "Client",
    "Decision",
    "EngineError",
    "KvIndexer",
    "KvRouter",
    "compute_block_hashes",
    "compute_seq_hashes",
]
