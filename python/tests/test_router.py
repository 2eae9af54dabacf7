"""KvRouter: the cost function, modes, request lifecycle and settings, through the index.

`test_hand_computed_costs_match_the_rust_scheduler_test` replays engine/tests/
sched_routing.rs `cost_matches_a_hand_computed_example` through real events and routes,
and expects the same numbers.
"""

import pytest

import kvengine

BS = 16


def tokens(tag: int, n: int) -> list:
    """`n` token ids unique to `tag`."""
    return [tag * 100_000 + i for i in range(n)]


def store(router, worker, toks, first_hash, parent=None, dp_rank=0):
    """Stores the full blocks of `toks` on `worker` as one chain; returns the last hash."""
    blocks = []
    for i in range(len(toks) // BS):
        blocks.append({"block_hash": first_hash + i, "token_ids": toks[i * BS:(i + 1) * BS]})
    router.apply_events(
        worker,
        {"dp_rank": dp_rank, "events": [{"type": "stored", "parent_hash": parent, "blocks": blocks}]},
    )
    return first_hash + len(blocks) - 1


def rows(decision):
    return [
        (c.worker_id, c.overlap_blocks, c.prefill_blocks, c.decode_blocks, c.logit)
        for c in decision.candidates
    ]


def test_hand_computed_costs_match_the_rust_scheduler_test():
    # Dynamo's formula as DESIGN.md writes it (the default cost, named here since the test
    # checks its numbers by hand), without the recompute and footprint terms the default adds
    # (the footprint term has its own test below).
    r = kvengine.KvRouter(
        kv_cache_block_size=BS,
        router_cost="dynamo",
        router_recompute_weight=0.0,
        router_footprint_weight=0.0,
    )
    for w in (1, 2, 3):
        r.add_worker(w)
    new = tokens(1, 100)  # 6 full blocks, 100 tokens
    p_a = tokens(2, 48)  # A's active request: 3 blocks, 1 of them cached on A
    p_b = new[:32] + tokens(3, 16)  # B's: 3 blocks, the first two shared with `new`

    store(r, 1, p_a[:16], 1000)
    store(r, 1, new[:64], 2000)
    d = r.route(p_a, "a", worker_id=1)
    assert (d.worker_id, d.mode, d.overlap_blocks) == (1, "direct", 1)
    d = r.route(p_b, "b", worker_id=2)
    assert (d.worker_id, d.overlap_blocks) == (2, 0)
    r.mark_prefilled("b")
    store(r, 2, new[:32], 3000)

    d = r.route(new, "new", overlap_weight=2.0)
    assert rows(d) == [
        (1, 4, 4.25, 9, 17.5),  # (32 + 100 - 64) / 16; 3 + 6; 2 * 4.25 + 9
        (2, 2, 4.25, 7, 15.5),  # (0 + 100 - 32) / 16; 3 + (6 - 2 already active)
        (3, 0, 6.25, 6, 18.5),  # 100 / 16; 0 + 6
    ]
    assert (d.worker_id, d.mode, d.overlap_blocks, d.best_available_overlap_blocks) == (
        2,
        "kv",
        2,
        4,
    )
    assert d.chosen.logit == 15.5
    assert d.blocks == 6
    assert r.active_load(2) == {
        "active_blocks": 7,
        "active_prefill_tokens": 68,
        "active_requests": 2,
    }
    # Prefill weightless: decode blocks alone; C (6) beats B (7 + 6 now).
    assert r.route(new, overlap_weight=0.0).worker_id == 3


def test_the_footprint_term_reads_the_index_and_counts_routed_blocks_until_the_next_read():
    # Dynamo's cost without the recompute term: a logit is prefill + decode blocks plus the
    # footprint term, 0.05 per block a candidate caches beyond the least-filled one.
    def router(refresh_ms):
        r = kvengine.KvRouter(
            kv_cache_block_size=BS,
            router_cost="dynamo",
            router_recompute_weight=0.0,
            predict_on_route_ms=0,
            cached_refresh_ms=refresh_ms,
        )
        for w in (1, 2, 3):
            r.add_worker(w)
        store(r, 1, tokens(9, 10 * BS), 100)  # worker 1 caches 10 blocks
        store(r, 2, tokens(8, 4 * BS), 200)  # worker 2 caches 4, worker 3 none
        return r

    def route_and_check(r, model, tag):
        # `model`: the totals the router should be using; a routed cold prompt adds its
        # blocks to the chosen worker's.
        d = r.route(tokens(tag, 3 * BS))
        least = min(model.values())
        charged = {c.worker_id: c.logit - c.prefill_blocks - c.decode_blocks for c in d.candidates}
        assert charged == pytest.approx({w: 0.05 * (n - least) for w, n in model.items()})
        model[d.worker_id] += d.blocks - d.overlap_blocks
        return d.worker_id

    # An hour between reads: the first route reads the index, then only refresh_cached_blocks().
    r = router(3_600_000)
    model = {1: 10, 2: 4, 3: 0}
    chosen = [route_and_check(r, model, tag) for tag in range(1, 7)]
    assert chosen[0] == 3  # no load yet: the emptiest cache takes the first new prefix
    store(r, 3, tokens(7, 20 * BS), 300)  # not read yet: the routed totals stay in use
    route_and_check(r, model, 7)
    r.refresh_cached_blocks()  # the routes stored nothing: the index says 10, 4, 20
    model = {1: 10, 2: 4, 3: 20}
    for tag in range(8, 11):
        route_and_check(r, model, tag)

    # 0 ms: every route reads the index, so a store is seen by the next route and routed
    # prompts (stored nowhere) leave no trace.
    r = router(0)
    for tag in range(1, 4):
        route_and_check(r, {1: 10, 2: 4, 3: 0}, tag)
    store(r, 3, tokens(7, 20 * BS), 300)
    route_and_check(r, {1: 10, 2: 4, 3: 20}, 4)
    with pytest.raises(ValueError, match="cached_refresh_ms"):
        kvengine.KvRouter(cached_refresh_ms=-1)


def test_requests_live_until_freed_and_ids_are_checked():
    # Without predict-on-route: each identical prompt's decision would predict its blocks
    # for the next, whose prefill then counts 8 tokens, not 40.
    r = kvengine.KvRouter(kv_cache_block_size=BS, predict_on_route_ms=0)
    r.add_worker(1)
    d = r.route(tokens(1, 40), "x")
    assert d.request_id == "x" and r.active_requests == 1
    with pytest.raises(ValueError, match="already active"):
        r.route(tokens(1, 40), "x")
    generated = {r.route(tokens(1, 40)).request_id for _ in range(3)}
    assert len(generated) == 3 and "x" not in generated
    assert r.active_load(1)["active_prefill_tokens"] == 4 * 40
    r.mark_prefilled("x")
    assert r.active_load(1)["active_prefill_tokens"] == 3 * 40
    r.free("x")
    assert r.active_requests == 3
    with pytest.raises(KeyError, match="no active request"):
        r.free("x")
    with pytest.raises(KeyError):
        r.mark_prefilled("never")
    # By default a decision predicts its blocks on its worker for the next request (the
    # same 2 full blocks: 40 - 32 = 8 tokens left to prefill).
    p = kvengine.KvRouter(kv_cache_block_size=BS)
    p.add_worker(1)
    p.route(tokens(1, 40), "a")
    d = p.route(tokens(1, 40), "b")
    assert d.overlap_blocks == 2
    assert p.active_load(1)["active_prefill_tokens"] == 40 + 8
    # The freed id is usable again.
    assert r.route(tokens(1, 40), "x").request_id == "x"


def test_busy_workers_are_skipped_unless_all_are_busy():
    r = kvengine.KvRouter({"busy_threshold": 0.9, "busy_max_waiting": 5}, kv_cache_block_size=BS)
    r.add_worker(1)
    r.add_worker(2)
    p = tokens(7, 48)
    store(r, 1, p, 10)
    r.update_load(1, num_requests_waiting=6, kv_usage=0.1)
    d = r.route(p)
    assert (d.worker_id, d.busy_skipped, len(d.candidates)) == (2, 1, 1)
    r.update_load(2, num_requests_waiting=0, kv_usage=0.95)
    d = r.route(p)
    assert (d.worker_id, d.busy_skipped) == (1, 0), "all busy: the cost over everyone"
    with pytest.raises(ValueError, match="kv_usage"):
        r.update_load(1, num_requests_waiting=0, kv_usage=1.5)
    with pytest.raises(KeyError):
        r.update_load(99, num_requests_waiting=0, kv_usage=0.5)


def test_modes_and_overrides():
    r = kvengine.KvRouter(router_mode="round-robin", kv_cache_block_size=BS)
    for w in (1, 2, 3):
        r.add_worker(w)
    assert r.mode == "round-robin"
    got = [r.route(tokens(1, 16)).worker_id for _ in range(6)]
    assert got == [1, 2, 3, 1, 2, 3]
    assert r.route(tokens(1, 16), mode="kv").mode == "kv"
    assert r.route(tokens(1, 16), worker_id=2).worker_id == 2
    with pytest.raises(KeyError):
        r.route(tokens(1, 16), worker_id=9)
    with pytest.raises(ValueError, match="mode"):
        r.route(tokens(1, 16), mode="fastest")
    with pytest.raises(ValueError):
        r.route(tokens(1, 16), temperature=-1.0)
    with pytest.raises(ValueError):
        r.route(tokens(1, 16), mode="kv", worker_id=1)


def test_lora_blocks_match_only_their_adapter():
    r = kvengine.KvRouter(kv_cache_block_size=BS)
    r.add_worker(2)
    p = tokens(5, 32)
    r.apply_events(
        1,
        {"events": [{"type": "stored", "lora_name": "sql", "blocks": [
            {"block_hash": 1, "token_ids": p[:16]}, {"block_hash": 2, "token_ids": p[16:]}]}]},
    )
    assert r.find_matches_for_request(p) == {}
    assert r.find_matches_for_request(p, lora_name="sql") == {1: 2}
    assert r.route(p, lora_name="sql").worker_id == 1
    assert kvengine.compute_block_hashes(p, BS, "sql") != kvengine.compute_block_hashes(p, BS)


def test_dp_ranks_are_keys_of_their_own():
    r = kvengine.KvRouter(kv_cache_block_size=BS)
    p = tokens(9, 32)
    store(r, 4, p, 50, dp_rank=1)
    store(r, 4, p[:16], 60, dp_rank=0)
    assert r.find_matches_for_request(p) == {(4, 1): 2, (4, 0): 1}
    d = r.route(p)
    assert d.key == (4, 1) and d.overlap_blocks == 2
    assert {c.key for c in d.candidates} == {(4, 0), (4, 1)}
    # Removing the worker removes every rank, its blocks and its requests.
    assert r.remove_worker(4) is True
    assert r.find_matches_for_request(p) == {}
    assert r.active_requests == 0
    assert r.remove_worker(4) is False


def test_no_workers_and_bad_settings():
    r = kvengine.KvRouter()
    with pytest.raises(kvengine.EngineError, match="no worker"):
        r.route(tokens(1, 16))
    with pytest.raises(ValueError, match="unknown KvRouter setting"):
        kvengine.KvRouter(router_mod="kv")
    with pytest.raises(ValueError, match="router_mode"):
        kvengine.KvRouter(router_mode="fastest")
    with pytest.raises(ValueError):
        kvengine.KvRouter(kv_cache_block_size=0)
    with pytest.raises(ValueError):
        kvengine.KvRouter(kv_overlap_score_weight=float("nan"))
    with pytest.raises(TypeError):
        kvengine.KvRouter(policy=42)
    # Names as on the command line, dashes and all.
    r = kvengine.KvRouter({"--kv-cache-block-size": 32, "router-temperature": 0.0})
    assert r.block_size == 32 and r.indexer.block_size == 32


def test_decision_to_dict_has_the_http_shape():
    r = kvengine.KvRouter(kv_cache_block_size=BS)
    r.add_worker(1)
    d = r.route(tokens(1, 40), "q").to_dict()
    assert d["request_id"] == "q" and d["worker_id"] == 1 and d["mode"] == "kv"
    assert set(d["candidates"][0]) == {
        "worker_id", "dp_rank", "overlap_blocks", "prefill_blocks", "decode_blocks", "logit"}


def test_workers_at_their_active_limit_refuse_until_freed():
    r = kvengine.KvRouter(kv_cache_block_size=BS, max_active_requests_per_worker=2)
    r.add_worker(1)
    r.route(tokens(1, 16), "a")
    r.route(tokens(1, 16), "b")
    with pytest.raises(kvengine.EngineError, match="limit of 2 active requests"):
        r.route(tokens(1, 16), "c")
    assert r.active_requests == 2
    r.free("a")
    assert r.route(tokens(1, 16), "c").worker_id == 1
