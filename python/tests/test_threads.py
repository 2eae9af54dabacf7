"""Threads calling one indexer and router at once; the GIL is released during index work."""

import sys
import threading
import time

import kvengine

BS = 16


def chain(tag: int, blocks: int) -> list:
    return [tag * 1_000_000 + i for i in range(blocks * BS)]


def stored(toks, first_hash):
    return {"events": [{"type": "stored", "blocks": [
        {"block_hash": first_hash + i, "token_ids": toks[i * BS:(i + 1) * BS]}
        for i in range(len(toks) // BS)]}]}


def run_threads(n, target):
    errors = []

    def wrap(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []


def test_concurrent_ingest_queries_and_routes_agree_with_a_sequential_answer():
    r = kvengine.KvRouter(kv_cache_block_size=BS, cores=2)
    workers = 6
    prompts = {w: chain(w, 8) for w in range(workers)}

    def ingest_then_route(w):
        # Each thread owns one worker: its stores, then queries and routes.
        r.apply_events(w, stored(prompts[w][: 4 * BS], 100))
        r.apply_events(w, {"events": [{"type": "stored", "parent_hash": 103, "blocks": [
            {"block_hash": 104 + i, "token_ids": prompts[w][(4 + i) * BS:(5 + i) * BS]}
            for i in range(4)]}]})
        for i in range(200):
            assert r.find_matches_for_request(prompts[w])[w] == 8
            d = r.route(prompts[w], f"{w}-{i}")
            assert d.overlap_blocks == 8 or d.worker_id != w
            r.free(d.request_id)

    run_threads(workers, ingest_then_route)
    assert r.active_requests == 0
    for w in range(workers):
        assert r.find_matches_for_request(prompts[w]) == {w: 8}
    assert r.indexer.stats()["rejected"]["unknown_parent"] == 0


def test_policies_on_many_threads_all_record():
    lock = threading.Lock()
    calls = [0]

    def policy(cands):
        with lock:
            calls[0] += 1
        return min(cands, key=lambda c: (c.active_requests, c.worker_id))

    r = kvengine.KvRouter(kv_cache_block_size=BS, policy=policy)
    for w in range(4):
        r.add_worker(w)

    def route_many(t):
        for i in range(100):
            r.route(chain(t, 2), f"{t}-{i}")

    run_threads(4, route_many)
    assert calls[0] == 400 and r.active_requests == 400
    # The least-loaded choice spread them evenly.
    assert [r.active_load(w)["active_requests"] for w in range(4)] == [100] * 4


def test_the_gil_is_released_during_index_work():
    """With the switch interval at an hour, Python never preempts a thread: another thread
    runs only when the busy one releases the GIL, which only the extension's calls do. The
    calls are repeated until the other thread has run (a released GIL lets it in sooner or
    later, however loaded the machine) or a bound is reached (a GIL never released never
    lets it in)."""
    ix = kvengine.KvIndexer(block_size=BS)
    long_prompt = chain(1, 500)
    ix.apply_events(1, stored(long_prompt, 1))
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0)  # hands the GIL back at once

    def ran_during(call, bound=20_000):
        ticks.clear()
        for _ in range(bound):
            call()
            if ticks:
                return True
        return False

    old = sys.getswitchinterval()
    sys.setswitchinterval(3600)
    try:
        t = threading.Thread(target=ticker)
        t.start()
        time.sleep(0.01)  # let the ticker start
        querying = ran_during(lambda: ix.find_matches_for_request(long_prompt))
        hashing = ran_during(lambda: kvengine.compute_block_hashes(long_prompt, BS))
        stop.set()
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert querying, "no other thread ran during 20,000 index calls"
    assert hashing, "no other thread ran while 20,000 prompts were hashed"
