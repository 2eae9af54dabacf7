"""Custom routing policies: a Python callable chooses among the scored candidates."""

import pytest

import kvengine

BS = 16


def tokens(tag: int, n: int) -> list:
    return [tag * 100_000 + i for i in range(n)]


def router(policy, workers=(1, 2, 3)):
    r = kvengine.KvRouter(kv_cache_block_size=BS, policy=policy)
    for w in workers:
        r.add_worker(w)
    return r


def test_the_policy_sees_overlap_active_and_reported_load_and_its_choice_is_recorded():
    seen = []

    def most_cached_then_least_waiting(cands):
        seen.append(cands)
        return max(cands, key=lambda c: (c.overlap_blocks, -(c.num_requests_waiting or 0)))

    r = router(most_cached_then_least_waiting)
    p = tokens(1, 64)
    r.apply_events(2, {"events": [{"type": "stored", "blocks": [
        {"block_hash": i, "token_ids": p[i * BS:(i + 1) * BS]} for i in range(3)]}]})
    r.update_load(3, num_requests_waiting=4, kv_usage=0.25)
    d = r.route(p, "one")
    assert (d.worker_id, d.mode, d.overlap_blocks) == (2, "custom", 3)
    cands = {c.worker_id: c for c in seen[-1]}
    assert cands[2].overlap_blocks == 3 and cands[1].overlap_blocks == 0
    assert (cands[3].num_requests_waiting, cands[3].kv_usage) == (4, 0.25)
    assert cands[1].num_requests_waiting is None and cands[1].active_requests == 0
    assert cands[2].cached_blocks is not None
    # The request is active on the chosen worker, and the next call's candidates show it.
    r.route(p, "two")
    cands = {c.worker_id: c for c in seen[-1]}
    assert cands[2].active_requests == 1 and cands[2].active_blocks == 4
    assert cands[2].active_prefill_tokens == 64 - 3 * BS
    r.free("one")
    assert r.active_load(2)["active_requests"] == 1


@pytest.mark.parametrize(
    "answer,expected",
    [
        (lambda cands: 3, (3, 0)),
        (lambda cands: (2, 0), (2, 0)),
        (lambda cands: cands[0], (1, 0)),
    ],
)
def test_a_policy_may_answer_with_an_id_a_key_or_a_candidate(answer, expected):
    assert router(answer).route(tokens(1, 32)).key == expected


def test_none_defers_to_the_kv_cost():
    r = router(lambda cands: None)
    p = tokens(1, 32)
    r.apply_events(3, {"events": [{"type": "stored", "blocks": [
        {"block_hash": 1, "token_ids": p[:16]}]}]})
    d = r.route(p)
    assert (d.worker_id, d.mode) == (3, "custom")


def test_an_int_answer_picks_that_workers_cheapest_rank():
    r = kvengine.KvRouter(kv_cache_block_size=BS, policy=lambda cands: 5)
    r.add_worker(5, dp_ranks=[0, 1])
    p = tokens(1, 32)
    r.apply_events(5, {"dp_rank": 1, "events": [{"type": "stored", "blocks": [
        {"block_hash": 1, "token_ids": p[:16]}]}]})
    assert r.route(p).key == (5, 1)


def test_what_a_policy_raises_reaches_the_caller_and_nothing_is_recorded():
    class Boom(Exception):
        pass

    def boom(cands):
        raise Boom("no")

    r = router(boom)
    with pytest.raises(Boom):
        r.route(tokens(1, 32), "a")
    assert r.active_requests == 0
    # The id was not taken.
    r2 = router(lambda c: 1)
    r2.route(tokens(1, 32), "a")
    assert r2.active_requests == 1


@pytest.mark.parametrize(
    "answer,error,match",
    [
        (lambda cands: 9, ValueError, "not a candidate"),
        (lambda cands: (1, 7), ValueError, "not a candidate"),
        (lambda cands: "w1", TypeError, "returns a Candidate"),
        (lambda cands: (1,), TypeError, "worker_id, dp_rank"),
        (lambda cands: -1, TypeError, "returns a Candidate"),
    ],
)
def test_a_bad_answer_is_a_clear_error(answer, error, match):
    r = router(answer)
    with pytest.raises(error, match=match):
        r.route(tokens(1, 32))
    assert r.active_requests == 0


def test_a_policy_calling_back_into_the_router_raises_instead_of_deadlocking():
    holder = {}

    def reentrant(cands):
        holder["r"].free("whatever")

    r = router(reentrant)
    holder["r"] = r
    with pytest.raises(RuntimeError, match="must not call"):
        r.route(tokens(1, 32))
    # The router still works afterwards, from outside the policy.
    r2 = router(lambda c: None)
    assert r2.route(tokens(1, 32)).worker_id in (1, 2, 3)


def test_per_call_mode_or_worker_bypasses_the_policy():
    calls = []

    def count(cands):
        calls.append(1)
        return cands[-1]

    r = router(count)
    assert r.mode == "custom"
    assert r.route(tokens(1, 32), worker_id=1).mode == "direct"
    assert r.route(tokens(1, 32), mode="round-robin").mode == "round-robin"
    assert calls == []
    assert r.route(tokens(1, 32)).worker_id == 3
    assert calls == [1]
