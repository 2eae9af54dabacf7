"""Type stubs for the compiled module `kvengine._kvengine` (python/src)."""

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, final

# A prompt: a list of ints, or (faster for long prompts) bytes of little-endian u32s, an
# array.array("I") or a numpy integer array.
TokenIds = Union[Sequence[int], bytes, bytearray, Any]
# vLLM/SGLang msgpack bytes, or the JSON shape of POST /v1/events as a dict or event list.
EventBatch = Union[bytes, bytearray, memoryview, Mapping[str, Any], List[Mapping[str, Any]]]
# find_matches answers: worker id, or (worker_id, dp_rank) for workers with dp ranks.
WorkerKey = Union[int, Tuple[int, int]]
# What a policy returns: a candidate, a worker id, (worker_id, dp_rank), or None (kv cost).
PolicyChoice = Union["Candidate", int, Tuple[int, int], None]

DEFAULT_BLOCK_SIZE: int

class EngineError(RuntimeError):
    """The engine stopped, missed its call deadline, or no registered worker can serve."""

def compute_block_hashes(
    token_ids: TokenIds, block_size: int = ..., lora_name: Optional[str] = None
) -> List[int]:
    """Each full block's XXH3-64 (seed 1337, or the adapter's): Dynamo's LocalBlockHash."""

def compute_seq_hashes(
    token_ids: TokenIds, block_size: int = ..., lora_name: Optional[str] = None
) -> List[int]:
    """Chained hashes: block i's names the whole prefix up to it (the index's keys)."""

@final
class KvIndexer:
    """The exact KV-block index of a cluster's workers, in-process."""

    def __new__(cls, block_size: int = ..., cores: Optional[int] = None) -> "KvIndexer": ...
    @property
    def block_size(self) -> int: ...
    @property
    def cores(self) -> int: ...
    def apply_events(
        self, worker_id: int, batch: EventBatch, *, wait: bool = True
    ) -> Dict[str, Any]:
        """Applies a batch; returns {"events", "blocks", "dropped": {reason: n}}."""
    def clear(self, worker_id: int, dp_rank: int = 0) -> int: ...
    def remove_worker(self, worker_id: int) -> bool: ...
    def subscribe_zmq(
        self, worker_id: int, endpoint: str, replay: Optional[str] = None
    ) -> None:
        """Follows a vLLM/SGLang ZMQ KV-event publisher in the background."""
    def subscriptions(self) -> List[int]: ...
    def find_matches_for_request(
        self, token_ids: TokenIds, lora_name: Optional[str] = None
    ) -> Dict[WorkerKey, int]:
        """{worker: leading blocks of the prompt it caches}; workers with none are absent."""
    def find_matches(self, block_hashes: Sequence[int]) -> Dict[WorkerKey, int]: ...
    def compute_block_hashes(
        self, token_ids: TokenIds, lora_name: Optional[str] = None
    ) -> List[int]: ...
    def stats(self) -> Dict[str, Any]: ...

@final
class Candidate:
    """One candidate worker rank as the cost function saw it."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    prefill_blocks: float
    decode_blocks: int
    logit: float
    active_blocks: Optional[int]
    active_prefill_tokens: Optional[int]
    active_requests: Optional[int]
    num_requests_waiting: Optional[int]
    kv_usage: Optional[float]
    cached_blocks: Optional[int]
    prompt_blocks: int
    @property
    def key(self) -> Tuple[int, int]: ...

@final
class Decision:
    """Where a request went, and every candidate's cost."""

    request_id: str
    worker_id: int
    dp_rank: int
    mode: str
    overlap_blocks: int
    best_available_overlap_blocks: int
    blocks: int
    busy_skipped: int
    candidates: List[Candidate]
    @property
    def key(self) -> Tuple[int, int]: ...
    @property
    def chosen(self) -> Optional[Candidate]: ...
    def to_dict(self) -> Dict[str, Any]: ...

@final
class KvRouter:
    """The index plus the scheduler, in-process; settings named as the CLI's flags."""

    def __new__(
        cls,
        config: Optional[Mapping[str, Any]] = None,
        *,
        policy: Optional[Callable[[List[Candidate]], PolicyChoice]] = None,
        **kwargs: Any,
    ) -> "KvRouter": ...
    @property
    def indexer(self) -> KvIndexer: ...
    @property
    def block_size(self) -> int: ...
    @property
    def mode(self) -> str: ...
    @property
    def active_requests(self) -> int: ...
    def add_worker(self, worker_id: int, dp_ranks: Optional[Sequence[int]] = None) -> bool: ...
    def remove_worker(self, worker_id: int) -> bool: ...
    def apply_events(
        self, worker_id: int, batch: EventBatch, *, wait: bool = True
    ) -> Dict[str, Any]: ...
    def subscribe_zmq(
        self, worker_id: int, endpoint: str, replay: Optional[str] = None
    ) -> None: ...
    def update_load(
        self, worker_id: int, num_requests_waiting: int, kv_usage: float, dp_rank: int = 0
    ) -> None: ...
    def route(
        self,
        token_ids: TokenIds,
        request_id: Optional[str] = None,
        *,
        lora_name: Optional[str] = None,
        mode: Optional[str] = None,
        worker_id: Optional[int] = None,
        overlap_weight: Optional[float] = None,
        temperature: Optional[float] = None,
    ) -> Decision: ...
    def mark_prefilled(self, request_id: str) -> None: ...
    def free(self, request_id: str) -> None: ...
    def refresh_cached_blocks(self) -> None: ...
    def active_load(self, worker_id: int, dp_rank: int = 0) -> Optional[Dict[str, int]]: ...
    def find_matches_for_request(
        self, token_ids: TokenIds, lora_name: Optional[str] = None
    ) -> Dict[WorkerKey, int]: ...
