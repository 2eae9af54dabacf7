"""A seed-style custom router: cache hit weighed against load, written in Python.

kvengine keeps the index and the load tracking in Rust; this policy only ranks the scored
candidates. Each candidate's score is its cache-hit fraction of the prompt minus a load
penalty (its active requests plus the requests its engine reports waiting), so a worker
holding the prompt wins until it is clearly busier than the others.

Runs on its own (no cluster, no GPU): events and loads are made up below, in the shapes a
vLLM worker publishes and a metrics scraper reports.

    python python/examples/custom_router.py
"""

import kvengine

BLOCK = 16
LOAD_WEIGHT = 0.15  # one waiting or active request costs 15% of a full cache hit


def cache_hit_vs_load(candidates):
    """Picks the candidate with the best cache hit after a load penalty."""

    def score(c):
        hit = c.overlap_blocks / max(c.prompt_blocks, 1)
        load = c.active_requests + (c.num_requests_waiting or 0)
        return hit - LOAD_WEIGHT * load

    return max(candidates, key=score)


def stored(token_ids, first_hash):
    """A `stored` event for the full blocks of `token_ids` (as /v1/events takes it)."""
    blocks = [
        {"block_hash": first_hash + i, "token_ids": token_ids[i * BLOCK:(i + 1) * BLOCK]}
        for i in range(len(token_ids) // BLOCK)
    ]
    return {"events": [{"type": "stored", "parent_hash": None, "blocks": blocks}]}


def main():
    router = kvengine.KvRouter(kv_cache_block_size=BLOCK, policy=cache_hit_vs_load)
    system_prompt = list(range(1000, 1000 + 8 * BLOCK))  # 8 blocks shared by every chat
    for worker in (1, 2, 3):
        router.add_worker(worker)
    router.apply_events(1, stored(system_prompt, 100))  # worker 1 has the system prompt

    chosen = []
    for user in range(6):
        prompt = system_prompt + [50_000 + user * 10 + t for t in range(40)]
        decision = router.route(prompt, request_id=f"chat-{user}")
        chosen.append(decision.worker_id)
        hit = decision.overlap_blocks / decision.blocks
        print(f"chat-{user}: worker {decision.worker_id} ({decision.mode}), "
              f"cache hit {hit:.0%}, candidates "
              + ", ".join(f"{c.worker_id}:{c.overlap_blocks}" for c in decision.candidates))
        # Worker 1 reports a growing queue (a metrics scraper would call this).
        router.update_load(1, num_requests_waiting=user, kv_usage=0.5)

    # The cached worker takes the first chats, then load sends them elsewhere.
    assert chosen[0] == 1, chosen
    assert len(set(chosen)) > 1, chosen
    for user in range(6):
        router.free(f"chat-{user}")
    assert router.active_requests == 0
    print("ok:", chosen)


if __name__ == "__main__":
    main()
