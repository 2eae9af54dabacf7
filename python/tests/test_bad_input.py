"""Bad input to `kvengine`: a clear Python exception, never a crash, never a changed index.

Malformed msgpack (random bytes; truncated, mutated and spliced valid batches), event dicts
of the wrong shape, stores with the wrong token count or another block size, mismatched
worker ids, bad token ids and block hashes, bad settings and endpoints, objects that are not
batches. After all of it, good batches still apply and queries answer as before.

Every indexer here checks its own state around each refusal: the answers to a few probe
prompts and `stats()` (entries and refusal counters) must not move.
"""

import array
import random

import msgpack
import pytest

import kvengine

BS = 4
A = [1, 2, 3, 4]
B = [5, 6, 7, 8]
C = [9, 10, 11, 12]
D = [13, 14, 15, 16]
PROBES = (A + B + C, A + C, B + C, D + A, C + D)


def stored(h, toks, parent=None, lora=None):
    """A dict stored event: one block per BS tokens, engine hashes h, h+1, ..."""
    blocks = [{"block_hash": h + i, "token_ids": toks[i * BS:(i + 1) * BS]} for i in range(len(toks) // BS)]
    ev = {"type": "stored", "parent_hash": parent, "blocks": blocks}
    if lora:
        ev["lora_name"] = lora
    return ev


def snapshot(ix):
    s = ix.stats()
    return (
        [ix.find_matches_for_request(p) for p in PROBES],
        s["entries"],
        s["rejected"],
    )


@pytest.fixture
def ix():
    """Worker 1 holds A+B (dp 0) and A (dp 1); every test starts from there."""
    ix = kvengine.KvIndexer(block_size=BS)
    ix.apply_events(1, {"events": [stored(100, A + B)]})
    ix.apply_events(1, {"dp_rank": 1, "events": [stored(100, A)]})
    assert ix.find_matches_for_request(A + B + C) == {(1, 0): 2, (1, 1): 1}
    return ix


def still_good(ix, before):
    """Nothing moved; a good batch still applies and is answered."""
    assert snapshot(ix) == before
    assert ix.apply_events(1, {"events": [stored(200, C, parent=101)]}) == {"events": 1, "blocks": 1, "dropped": {}}
    assert ix.find_matches_for_request(A + B + C) == {(1, 0): 3, (1, 1): 1}
    assert ix.apply_events(1, msgpack.packb([0.0, [["BlockRemoved", [200]]], 0])) == {"events": 1, "blocks": 1, "dropped": {}}
    assert ix.find_matches_for_request(A + B + C) == {(1, 0): 2, (1, 1): 1}
    assert ix.stats()["rejected"] == before[2]


# --------------------------------------------------------------------------------------
# Msgpack: random and damaged batches.


def valid_batches(rng):
    """Well-formed vLLM batches of every shape, storing and removing blocks of worker 7."""
    toks = A + B + C + D
    digest = lambda h: rng.randbytes(24) + h.to_bytes(8, "big")
    return [
        [1.5, [["BlockStored", [1, 2], None, toks[:8], BS, None]]],
        [1.5, [["BlockStored", [3], 2, toks[8:12], BS, None, "GPU", None, [None], 0, "full_attention", None],
               ["BlockRemoved", [1], "GPU"], ["AllBlocksCleared"]], 0],
        [17, [{"type": "BlockStored", "block_hashes": [digest(5), digest(6)], "parent_block_hash": None,
               "token_ids": toks[4:12], "block_size": BS, "lora_id": None, "medium": "GPU",
               "lora_name": "a", "extra_keys": [None, None], "group_idx": 0},
              {"type": "BlockRemoved", "block_hashes": [digest(6)], "medium": "GPU"},
              {"type": "AllBlocksCleared"}], 1],
        {"events": [{"token_ids": toks[:4], "lora_id": 7, "block_hashes": [2**64 - 1],
                     "parent_block_hash": None, "type": "BlockStored"},
                    ["SomeFutureEvent", {"x": [1, 2]}],
                    ["BlockStored", [-5], -1, toks[:4], None, None, "CPU"]],
         "data_parallel_rank": 0, "ts": None, "publisher": {"a": 1}},
        [None, [["BlockStored", [9, 10, 11], None, toks[:12], BS, None, "GPU"],
                ["BlockRemoved", [10, 12345]]]],
    ]


MARKERS = [0xC0, 0xC1, 0xC2, 0xC4, 0xC5, 0xC6, 0xCA, 0xCB, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD3,
           0xD4, 0xD8, 0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF, 0x80, 0x8F, 0x90, 0x9F,
           0xA0, 0xBF, 0x00, 0x7F]


def damaged(rng, good):
    """One random damage of a valid batch (or random bytes)."""
    k = rng.randrange(9)
    b = bytearray(good)
    i = rng.randrange(len(b))
    if k == 0:
        return bytes(b[:i])  # truncated
    if k == 1:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)  # flipped
        return bytes(b)
    if k == 2:
        b[i] = rng.choice(MARKERS)  # a marker where a value was
        return bytes(b)
    if k == 3:
        b.insert(i, rng.choice(MARKERS))
        return bytes(b)
    if k == 4:
        del b[i]
        return bytes(b)
    if k == 5:
        # A lying length: a 32-bit array / map / str / bin header claiming ~4 billion.
        b[i:i + 1] = bytes([rng.choice([0xDD, 0xDF, 0xDB, 0xC6])]) + b"\xff\xff\xff" + bytes([rng.randrange(256)])
        return bytes(b)
    if k == 6:
        return bytes(b) + bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))  # trailing
    if k == 7:
        j = rng.randrange(len(b))
        return bytes(b[:i] + b[j:])  # spliced
    return rng.randbytes(rng.randrange(0, 48))


def test_random_and_damaged_msgpack_is_value_error_or_applied(ix):
    rng = random.Random(20240611)
    goods = [msgpack.packb(b, use_bin_type=True) for b in valid_batches(rng)]
    for g in goods:  # the undamaged ones apply, to another indexer
        kvengine.KvIndexer(block_size=BS).apply_events(7, g)
    worker1 = snapshot(ix)[0]
    before = snapshot(ix)
    outcomes = {"applied": 0, "ValueError": 0}
    for _ in range(3000):
        raw = damaged(rng, rng.choice(goods))
        try:
            out = ix.apply_events(7, raw)
        except ValueError as e:
            msg = str(e)
            assert msg, raw
            if "block size" in msg:
                before = snapshot(ix)  # another block size: the rest of the batch applied
            else:
                assert snapshot(ix) == before, (raw.hex(), msg)
            outcomes["ValueError"] += 1
            continue
        # Anything else than ValueError propagates and fails the test.
        assert set(out) == {"events", "blocks", "dropped"}
        outcomes["applied"] += 1
        before = snapshot(ix)
    assert outcomes["ValueError"] > 1000 and outcomes["applied"] > 100, outcomes
    # Worker 1 is untouched by all of it.
    ix.remove_worker(7)
    assert snapshot(ix)[0] == worker1
    still_good(ix, snapshot(ix))


def test_lying_lengths_and_deep_nesting_are_refused_quickly(ix):
    before = snapshot(ix)
    for raw in (
        b"\xdd\xff\xff\xff\xff",  # an array of 4 billion, then nothing
        b"\x92\xc0\xdd\xff\xff\xff\xff",  # events: 4 billion
        b"\x92\xc0\x91\x92\xabBlockStored\xdd\xff\xff\xff\xff",
        b"\x92\xc0\x91\xdf\xff\xff\xff\xff",
        b"\x92\xc0\x91\x94\xabBlockStored\x91\xc6\xff\xff\xff\xff",
        b"\x93\xc0\x90" + b"\x91" * 100_000 + b"\xc0",  # a dp rank nested 100k deep
        b"",
        b"\xc1",
        b"\x92\xc0\x90\x00",  # trailing bytes
        b"\x91\xc0",  # one element
        b"\x92\xa2ts\x90",  # ts a string
        b"\x93\xc0\x90\xff",  # dp rank -1
        b"\x93\xc0\x90\xcf\x00\x00\x00\x01\x00\x00\x00\x00",  # dp rank 2**32
        b"\x81\xa2ts\xc0",  # a map without events
        b"\x92\xc0\x91\x90",  # an empty event array
        b"\x92\xc0\x91\x91\x01",  # an event tag that is no string
        b"\x92\xc0\x91\x81\xa4type\x01",  # a map "type" that is no string
        b"\x92\xc0\x91\x81\xa1x\x01",  # a map event without "type"
        b"\x92\xc0\x91\x92\xabBlockStored\x90",  # stored with 2 elements
        b"\x92\xc0\x91\x91\xacBlockRemoved",  # removed without hashes
        b"\x92\xc0\x91\x94\xabBlockStored\x91\xc4\x00\xc0\x94\x01\x02\x03\x04",  # an empty bin hash
        b"\x92\xc0\x91\x94\xabBlockStored\x91\xc4\x21" + b"\x01" * 33 + b"\xc0\x94\x01\x02\x03\x04",  # 33 bytes
        b"\x92\xc0\x91\x94\xabBlockStored\x91\x01\xc0\x94\x01\x02\x03\xff",  # token -1
        b"\x92\xc0\x91\x94\xabBlockStored\x91\x01\xc0\x94\x01\x02\x03\xcf\x00\x00\x00\x01\x00\x00\x00\x00",
        b"\x92\xc0\x91\x94\xabBlockStored\x91\x01\xc0\x94\x01\x02\x03\xcb" + b"\x00" * 8,  # a float token
        b"\x92\xc0\x91\x94\xabBlockStored\x91\xa1x\xc0\x94\x01\x02\x03\x04",  # a string hash
        b"\x92\xc0\x91\x95\xabBlockStored\x91\x01\xc0\x94\x01\x02\x03\x04\xff",  # block size -1
        b"\x92\xc0\x91\x97\xabBlockStored\x91\x01\xc0\x94\x01\x02\x03\x04\x04\xc0\xa2\xff\xfe",  # medium not UTF-8
    ):
        with pytest.raises(ValueError, match="msgpack"):
            ix.apply_events(7, raw)
        assert snapshot(ix) == before
    with pytest.raises(KeyError):
        ix.clear(7)  # a batch that does not decode registers nobody
    # A trailing element nested 100k deep is skipped (iteratively), and the batch applies.
    deep = b"\x94\xc0\x90\x00" + b"\x91" * 100_000 + b"\xc0"
    assert ix.apply_events(7, deep) == {"events": 0, "blocks": 0, "dropped": {}}
    assert snapshot(ix) == before
    ix.remove_worker(7)
    still_good(ix, before)


def test_oversized_batch_is_refused(ix):
    before = snapshot(ix)
    with pytest.raises(ValueError, match="exceeds the limit"):
        ix.apply_events(7, bytes(64 * 1024 * 1024 + 1))
    still_good(ix, before)


# --------------------------------------------------------------------------------------
# Dicts.

BAD_DICTS = [
    {},
    {"events": None},
    {"events": "stored"},
    {"events": {"type": "cleared"}},
    {"events": [None]},
    {"events": [1]},
    {"events": [{}]},
    {"events": [{"type": "moved"}]},
    {"events": [{"type": "Stored", "blocks": []}]},  # tags are snake_case
    {"events": [{"type": 1}]},
    {"events": [{"type": "stored"}]},
    {"events": [{"type": "stored", "blocks": None}]},
    {"events": [{"type": "stored", "blocks": [{"block_hash": 1}]}]},
    {"events": [{"type": "stored", "blocks": [{"token_ids": A}]}]},
    {"events": [{"type": "stored", "blocks": [{"block_hash": "1", "token_ids": A}]}]},
    {"events": [{"type": "stored", "blocks": [{"block_hash": -1, "token_ids": A}]}]},
    {"events": [{"type": "stored", "blocks": [{"block_hash": 2**64, "token_ids": A}]}]},
    {"events": [{"type": "stored", "blocks": [{"block_hash": 1.0, "token_ids": A}]}]},
    {"events": [{"type": "stored", "blocks": [{"block_hash": 1, "token_ids": [1, 2, 3, -4]}]}]},
    {"events": [{"type": "stored", "blocks": [{"block_hash": 1, "token_ids": [1, 2, 3, 2**32]}]}]},
    {"events": [{"type": "stored", "blocks": [{"block_hash": 1, "token_ids": [1, 2, 3, "4"]}]}]},
    {"events": [{"type": "stored", "blocks": [{"block_hash": 1, "token_ids": [1, 2, 3, 4.0]}]}]},
    {"events": [{"type": "stored", "blocks": [{"block_hash": 1, "token_ids": "abcd"}]}]},
    {"events": [{"type": "stored", "parent_hash": "x", "blocks": [{"block_hash": 1, "token_ids": A}]}]},
    {"events": [{"type": "stored", "parent_hash": -2, "blocks": [{"block_hash": 1, "token_ids": A}]}]},
    {"events": [{"type": "stored", "lora_name": 5, "blocks": [{"block_hash": 1, "token_ids": A}]}]},
    {"events": [{"type": "removed"}]},
    {"events": [{"type": "removed", "block_hashes": 1}]},
    {"events": [{"type": "removed", "block_hashes": [1.5]}]},
    {"events": [{"type": "removed", "block_hashes": ["1"]}]},
    {"events": [{"type": "removed", "block_hashes": [-1]}]},
    {"events": [{"type": "removed", "block_hashes": [2**64]}]},
    {"dp_rank": -1, "events": []},
    {"dp_rank": 2**32, "events": []},
    {"dp_rank": "1", "events": []},
    {"dp_rank": 1.0, "events": []},
    {"worker_id": "7", "events": []},
    {"worker_id": -7, "events": []},
    # A valid event before the bad one: nothing of the batch applies.
    {"events": [stored(300, D), {"type": "moved"}]},
    {"events": [stored(300, D), {"type": "removed", "block_hashes": [100]}, {"type": "stored"}]},
    [stored(300, D), {"type": "cleared", "oops": 1}, 5],
    [None],
    [{"type": "removed", "block_hashes": [100, "x"]}],
]


@pytest.mark.parametrize("batch", BAD_DICTS, ids=[str(i) for i in range(len(BAD_DICTS))])
def test_bad_dicts_are_value_errors(ix, batch):
    before = snapshot(ix)
    for w in (1, 7):
        with pytest.raises(ValueError) as e:
            ix.apply_events(w, batch)
        assert str(e.value)
        assert snapshot(ix) == before
    with pytest.raises(KeyError):
        ix.clear(7)  # nor registered the worker
    still_good(ix, before)


def test_unknown_keys_are_ignored_but_unknown_types_are_not(ix):
    """Forward compatibility (json_events.rs invariant 3), the one lenient case."""
    out = ix.apply_events(1, {"seq": 3, "future": [1], "events": [dict(stored(300, D), extra=1)]})
    assert out == {"events": 1, "blocks": 1, "dropped": {}}
    assert ix.find_matches_for_request(D + A) == {(1, 0): 1}


def test_a_json_block_with_the_wrong_token_count_refuses_the_whole_batch(ix):
    before = snapshot(ix)
    for bad_tokens in ([1, 2, 3], [1, 2, 3, 4, 5], []):
        batch = {"events": [
            stored(300, D),  # valid, first
            {"type": "removed", "block_hashes": [100]},  # valid
            {"type": "stored", "parent_hash": 300, "blocks": [
                {"block_hash": 301, "token_ids": A}, {"block_hash": 302, "token_ids": bad_tokens}]},
        ]}
        with pytest.raises(ValueError, match="token"):
            ix.apply_events(1, batch)
        assert snapshot(ix) == before
        assert ix.find_matches_for_request(D) == {}
    still_good(ix, before)


def test_a_foreign_block_size_is_a_value_error_and_the_rest_applies(ix):
    toks8 = A + B
    batch = msgpack.packb([0.0, [
        ["BlockStored", [300], None, D, BS, None, "GPU"],  # ours
        ["BlockStored", [400, 401], None, toks8 * 2, 8, None, "GPU"],  # 8-token blocks
        {"type": "BlockStored", "block_hashes": [402], "parent_block_hash": None,
         "token_ids": C + D, "block_size": 8},  # again
        ["BlockStored", [301], 300, A, BS, None, "GPU"],  # ours, after the foreign ones
        ["BlockRemoved", [100]],  # removes worker 1's block A (dp 0)
    ], 0])
    with pytest.raises(ValueError, match="block size 8") as e:
        ix.apply_events(1, batch)
    assert str(BS) in str(e.value) and "block_size" in str(e.value)
    assert ix.find_matches_for_request(D + A) == {(1, 0): 2}
    assert ix.find_matches_for_request(A + B) == {(1, 1): 1}
    assert ix.find_matches_for_request(C + D) == {}
    assert ix.find_matches_for_request(A + B + A + B) == {(1, 1): 1}


def test_a_recorded_fixture_into_an_index_of_another_block_size(kv_events_dir):
    raw = (kv_events_dir / "sglang_array.msgpack").read_bytes()
    ix = kvengine.KvIndexer(block_size=8)
    with pytest.raises(ValueError, match="block size 16"):
        ix.apply_events(1, raw)
    assert ix.stats()["entries"] == 0
    assert kvengine.KvIndexer(block_size=16).apply_events(1, raw)["events"] == 4


def test_msgpack_token_count_mismatch_is_dropped_not_raised(ix):
    before = snapshot(ix)
    out = ix.apply_events(1, msgpack.packb([0.0, [
        ["BlockStored", [300, 301], None, D + [1], BS],  # 5 tokens for 2 blocks
        ["BlockStored", [302], None, D + D, None],  # 8 tokens for 1 block, no block size sent
        ["BlockRemoved", [], "GPU"],  # no hashes: nothing
        ["BlockStored", [], None, [], BS],
    ]]))
    assert out == {"events": 0, "blocks": 0, "dropped": {"token_count_mismatch": 2}}
    assert snapshot(ix) == before


def test_a_batch_of_another_worker_is_refused(ix):
    before = snapshot(ix)
    for batch in (
        {"worker_id": 2, "events": [stored(300, D)]},
        {"worker_id": 2, "dp_rank": 0, "events": []},
        {"worker_id": 0, "events": [{"type": "cleared"}]},
    ):
        with pytest.raises(ValueError, match="worker"):
            ix.apply_events(1, batch)
        assert snapshot(ix) == before
    assert ix.apply_events(1, {"worker_id": 1, "events": []}) == {"events": 0, "blocks": 0, "dropped": {}}
    still_good(ix, before)


# --------------------------------------------------------------------------------------
# Token ids, block hashes, arguments.

BAD_TOKENS = [
    [1, 2, 3, -1],
    [1, 2, 3, 2**32],
    [1, 2, 3, 2**64],
    [1, 2, 3, "4"],
    ["1", "2", "3", "4"],
    [1.0, 2.0, 3.0, 4.0],
    [1, 2, 3, 4.5],
    [1, 2, 3, None],
    [[1], [2]],
    "abcd",
    None,
    5,
    {1: 2},
    b"\x01\x00\x00\x00\x02",  # 5 bytes: not whole u32s
    b"\x01",
    bytearray(b"\x01\x00\x00"),
    array.array("i", [1, 2, -3, 4]),
    array.array("q", [1, 2, 3, 2**32]),
    array.array("q", [1, 2, 3, -1]),
    array.array("H", [1, 2, 3, 4]),
    array.array("d", [1.0, 2.0, 3.0, 4.0]),
    memoryview(b"\x01\x00\x00\x00"),  # 1-byte items
]


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=[str(i) for i in range(len(BAD_TOKENS))])
def test_bad_token_ids_are_value_or_type_errors(ix, tokens):
    before = snapshot(ix)
    calls = (
        lambda: ix.find_matches_for_request(tokens),
        lambda: ix.find_matches_for_request(tokens, lora_name="a"),
        lambda: ix.compute_block_hashes(tokens),
        lambda: kvengine.compute_block_hashes(tokens, BS),
        lambda: kvengine.compute_seq_hashes(tokens, BS),
    )
    for call in calls:
        with pytest.raises((ValueError, TypeError)) as e:
            call()
        assert str(e.value)
    assert snapshot(ix) == before


def test_bytes_of_a_partial_token_name_the_length():
    for n in (1, 2, 3, 5, 7):
        with pytest.raises(ValueError, match=f"{n} bytes"):
            kvengine.compute_block_hashes(bytes(n), BS)
    assert kvengine.compute_block_hashes(bytes(0), BS) == []
    assert kvengine.compute_block_hashes(bytes(4 * BS), BS) == kvengine.compute_block_hashes([0] * BS, BS)


BAD_HASHES = [
    ["a"],
    [1.5],
    [1.0],
    [None],
    [2**64],
    [-(2**63) - 1],
    [[1]],
    [1, 2, "3"],
    5,
    None,
]


@pytest.mark.parametrize("hashes", BAD_HASHES, ids=[str(i) for i in range(len(BAD_HASHES))])
def test_block_hashes_that_are_not_64_bit_ints(ix, hashes):
    before = snapshot(ix)
    with pytest.raises((ValueError, TypeError)) as e:
        ix.find_matches(hashes)
    assert str(e.value)
    assert snapshot(ix) == before


def test_signed_block_hashes_are_their_bit_pattern(ix):
    hashes = kvengine.compute_block_hashes(A + B, BS)
    signed = [h - 2**64 if h >= 2**63 else h for h in hashes]
    assert ix.find_matches(signed) == ix.find_matches(hashes) == {(1, 0): 2, (1, 1): 1}
    assert ix.find_matches(iter(hashes)) == ix.find_matches(tuple(hashes))
    assert ix.find_matches([]) == {}


@pytest.mark.parametrize("obj", [5, 1.5, "stored", None, (1, 2), {1, 2}, object(), True],
                         ids=["int", "float", "str", "None", "tuple", "set", "object", "bool"])
def test_a_non_batch_object_is_a_type_error(ix, obj):
    before = snapshot(ix)
    with pytest.raises(TypeError, match="batch"):
        ix.apply_events(1, obj)
    assert snapshot(ix) == before


def test_bad_settings_and_arguments(ix):
    before = snapshot(ix)
    with pytest.raises(ValueError, match="block_size"):
        kvengine.KvIndexer(block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        kvengine.compute_block_hashes(A, 0)
    with pytest.raises(ValueError, match="block_size"):
        kvengine.compute_seq_hashes(A, 0)
    for bad in (-1, 2**32, "16", 1.5, None):
        with pytest.raises((ValueError, TypeError, OverflowError)):
            kvengine.KvIndexer(block_size=bad)
    for bad in (-1, 2**64, "1", 1.5, None):
        with pytest.raises((ValueError, TypeError, OverflowError)):
            ix.apply_events(bad, {"events": []})
        with pytest.raises((ValueError, TypeError, OverflowError)):
            ix.remove_worker(bad)
        with pytest.raises((ValueError, TypeError, OverflowError, KeyError)):
            ix.clear(bad)
    with pytest.raises((ValueError, TypeError, OverflowError)):
        ix.clear(1, dp_rank=-1)
    with pytest.raises(KeyError):
        ix.clear(12345)
    assert ix.clear(1, dp_rank=7) == 0
    with pytest.raises(TypeError):
        ix.find_matches_for_request(A, lora_name=5)
    with pytest.raises(TypeError):
        ix.apply_events(1, {"events": []}, True)  # wait is keyword-only
    assert ix.remove_worker(12345) is False
    assert snapshot(ix) == before
    still_good(ix, before)


@pytest.mark.parametrize("endpoint, replay", [
    ("", None),
    ("localhost:5557", None),
    ("tcp://", None),
    ("tcp://host", None),
    ("tcp://:5557", None),
    ("tcp://host:port", None),
    ("tcp://host:65536", None),
    ("tcp://host:-1", None),
    ("ipc:///tmp/kv.sock", None),
    ("http://host:5557", None),
    ("TCP://host:5557", None),
    ("tcp://127.0.0.1:1", "tcp://127.0.0.1"),
    ("tcp://127.0.0.1:1", "udp://127.0.0.1:2"),
    ("tcp://127.0.0.1:1", ""),
])
def test_subscribe_zmq_with_a_malformed_endpoint(ix, endpoint, replay):
    before = snapshot(ix)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        ix.subscribe_zmq(9, endpoint, replay=replay)
    assert ix.subscriptions() == []
    with pytest.raises(KeyError):
        ix.clear(9)  # not registered
    assert snapshot(ix) == before


def test_everything_bad_in_a_row_then_good_batches_still_apply(ix):
    """All the refusals above on one indexer; then it works as if none had happened."""
    rng = random.Random(7)
    before = snapshot(ix)
    goods = [msgpack.packb(b, use_bin_type=True) for b in valid_batches(rng)]
    for batch in BAD_DICTS:
        with pytest.raises(ValueError):
            ix.apply_events(1, batch)
    for tokens in BAD_TOKENS:
        with pytest.raises((ValueError, TypeError)):
            ix.find_matches_for_request(tokens)
    for hashes in BAD_HASHES:
        with pytest.raises((ValueError, TypeError)):
            ix.find_matches(hashes)
    refused = 0
    for _ in range(300):
        raw = damaged(rng, rng.choice(goods))
        try:
            ix.apply_events(1, raw)  # may apply: then it changed worker 1
        except ValueError:
            refused += 1
    assert refused > 100
    ix.remove_worker(1)
    assert ix.stats()["entries"] == 0
    assert [ix.find_matches_for_request(p) for p in PROBES] == [{}] * len(PROBES)
    ix.apply_events(1, {"events": [stored(100, A + B)]})
    ix.apply_events(1, {"dp_rank": 1, "events": [stored(100, A)]})
    assert snapshot(ix)[0] == before[0]
    still_good(ix, snapshot(ix))


# --------------------------------------------------------------------------------------
# Buffers whose items are not native-order integers are refused, never read as ids:
# before tokens.rs checked the item type (array typecode, numpy dtype, memoryview format),
# each of these was hashed as the bit patterns noted.

NON_INTEGER_BUFFERS = {
    # Was hashed as the ids [1065353216, 1073741824, 1077936128, 1082130432] (the float bits).
    "array_f": array.array("f", [1.0, 2.0, 3.0, 4.0]),
    # Was hashed as [0, 0, 0, 0].
    "array_d_zeros": array.array("d", [0.0] * 4),
    # Was hashed as [2**32 - 1] * 4; array.array("i", [-1] * 4) itself is refused.
    "memoryview_i_negative": memoryview(array.array("i", [-1] * 4)),
    # Was hashed as [1065353216] * 4.
    "memoryview_f": memoryview(array.array("f", [1.0] * 4)),
    # Was hashed as [97, 98, 99, 100].
    "array_u": array.array("u", "abcd"),
}


@pytest.mark.parametrize("name", sorted(NON_INTEGER_BUFFERS))
def test_non_integer_token_buffers_are_refused(name):
    buf = NON_INTEGER_BUFFERS[name]
    with pytest.raises((TypeError, ValueError)):
        kvengine.compute_block_hashes(buf, BS)

