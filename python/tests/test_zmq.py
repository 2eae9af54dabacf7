"""`subscribe_zmq` end to end: the Python indexer follows simulated vLLM workers' ZMQ KV
events (published by `kvengine --sim-workers`, exactly as vLLM publishes them) and agrees
with the router process that follows the same publishers."""

import json
import time
import urllib.request

import pytest

import kvengine
from server import BLOCK, start_router


@pytest.fixture(scope="module")
def cluster():
    r = start_router(["--sim-workers", "2"])
    try:
        yield r
    finally:
        r.stop()


def call(url, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def wait_for(predicate, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def test_the_python_indexer_sees_what_the_router_sees(cluster):
    workers = call(cluster.url, "/v1/workers")["workers"]
    assert len(workers) == 2
    indexer = kvengine.KvIndexer(block_size=BLOCK)
    for w in workers:
        indexer.subscribe_zmq(w["worker_id"], w["zmq"], replay=w["replay"])
    assert sorted(indexer.subscriptions()) == sorted(w["worker_id"] for w in workers)

    prompts = [[7_000 + p * 1_000 + t for t in range(3 * BLOCK + 5)] for p in range(4)]
    for p in prompts:
        # Each completion makes its worker store the prompt's blocks and publish them.
        call(cluster.url, "/v1/completions",
             {"model": "kvengine-sim", "prompt": p, "max_tokens": 1})
    for p in prompts:
        def both_agree(p=p):
            server = {s["worker_id"]: s["overlap_blocks"]
                      for s in call(cluster.url, "/v1/overlap", {"token_ids": p})["scores"]}
            mine = indexer.find_matches_for_request(p)
            return server if server and mine == server else None
        got = wait_for(both_agree, "the Python indexer to match the router's index")
        assert max(got.values()) == 3

    # Removing a worker stops its subscription and forgets its blocks.
    first = workers[0]["worker_id"]
    assert indexer.remove_worker(first)
    assert first not in indexer.subscriptions()
    for p in prompts:
        assert first not in indexer.find_matches_for_request(p)
