"""What Python adds to the index's two hot calls: the workload of
transport/benches/hub_calls.rs (its Rust-only cost), made through the `kvengine` package.

* `find_matches_8000_tokens`: `find_matches_for_request` of an 8,000-token prompt that 4
  workers hold 500, 400, 300 and 200 of 500 blocks of; token ids as a `list[int]`, as an
  `array.array("I")` and as little-endian `bytes`.
* `apply_msgpack_stored` / `_removed`: `apply_events` of vLLM msgpack batches of 32 chains
  of 32 blocks (encoded with the `msgpack` package in vLLM's map shape), waiting until
  applied, then the batch removing them.

Prints one JSON line per figure: the mean of each of 5 runs, as min / median / max.

    python python/bench/bench_python.py
"""

import array
import json
import statistics
import time

import msgpack

import kvengine

BS = 16
RUNS = 5
CHAINS = 32
CHAIN_BLOCKS = 32


def prompt():
    return [(i * 7919) % 151_000 for i in range(8000)]


def stored_batch(events):
    return msgpack.packb([1.0, events, 0])


def stored_event(hashes, tokens):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU"}


def report(name, unit, runs):
    runs = sorted(runs)
    print(json.dumps({"figure": name, "unit": unit, "min": round(runs[0], 3),
                      "median": round(statistics.median(runs), 3),
                      "max": round(runs[-1], 3), "runs": runs}))


def find_matches(ix):
    p = prompt()
    for w, blocks in [(1, 500), (2, 400), (3, 300), (4, 200)]:
        hashes = [(w << 32) + i for i in range(blocks)]
        ix.apply_events(w, stored_batch([stored_event(hashes, p[:blocks * BS])]))
    forms = {"list": p, "array": array.array("I", p), "bytes": array.array("I", p).tobytes()}
    for form, arg in forms.items():
        assert len(ix.find_matches_for_request(arg)) == 4
        iters = 20_000
        runs = []
        for _ in range(RUNS):
            t = time.perf_counter()
            for _ in range(iters):
                ix.find_matches_for_request(arg)
            runs.append((time.perf_counter() - t) * 1e6 / iters)
        report(f"find_matches_8000_tokens_{form}", "us/call", runs)


def batches(base):
    store, remove = [], []
    for c in range(CHAINS):
        first = base + c * CHAIN_BLOCKS
        hashes = list(range(first, first + CHAIN_BLOCKS))
        tokens = [((first * 31) + t) & 0xFFFFFFFF for t in range(CHAIN_BLOCKS * BS)]
        store.append(stored_event(hashes, tokens))
        remove.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"})
    return stored_batch(store), msgpack.packb([1.0, remove, 0])


def apply_msgpack(ix):
    pairs = [batches(i * CHAINS * CHAIN_BLOCKS) for i in range(64)]
    stores, removes = [], []
    for _ in range(RUNS):
        st = rm = 0.0
        blocks = 0
        for _ in range(8):
            for s, r in pairs:
                t = time.perf_counter()
                blocks += ix.apply_events(9, s)["blocks"]
                st += time.perf_counter() - t
                t = time.perf_counter()
                ix.apply_events(9, r)
                rm += time.perf_counter() - t
        stores.append(blocks / st / 1e6)
        removes.append(blocks / rm / 1e6)
    report("apply_msgpack_stored", "M blocks/s", stores)
    report("apply_msgpack_removed", "M blocks/s", removes)


def main():
    ix = kvengine.KvIndexer(block_size=BS, cores=1)
    find_matches(ix)
    apply_msgpack(ix)


if __name__ == "__main__":
    main()
