"""Recorded data through the Python API: hash vectors and vLLM / SGLang msgpack fixtures.

* `hash_vectors.json`'s Dynamo entry and DESIGN.md's reference vectors against
  `compute_block_hashes` / `compute_seq_hashes`.
* Every msgpack fixture of `fixtures.json` applied with `apply_events`: the returned counts
  are those of the fixture's decoded events (transport/tests/kv_events_fixtures.rs), and the
  overlap of the stored prompts after each prefix of the batch's events (re-encoded with
  `msgpack`, which reproduces the recorded bytes exactly) is what DESIGN.md's semantics give.
* Token ids as a list, bytes of little-endian u32s, or an `array.array` hash alike.
"""

import array
import json
import pathlib

import msgpack
import pytest

import kvengine
from conftest import need

# conftest.py's SHARED_DATA / "kv_events" (needed at collection, for the parameters).
KV = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "kv_events"
MASK = 2**64 - 1

DESIGN_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]
DESIGN_LOCAL = [14643705804678351452, 16777012769546811212]
DESIGN_SEQ = [14643705804678351452, 4945711292740353085]


def fixture_names():
    if not (KV / "fixtures.json").is_file():
        return ["<absent>"]
    return sorted(json.loads((KV / "fixtures.json").read_text())["fixtures"])


@pytest.fixture
def vectors(kv_events_dir):
    return json.loads((kv_events_dir / "hash_vectors.json").read_text())


# --------------------------------------------------------------------------------------
# Hash vectors.


def test_dynamo_hash_vectors(vectors):
    tokens, bs = vectors["tokens"], vectors["block_size"]
    dynamo = vectors["dynamo"]
    assert len(tokens) // bs == len(dynamo["local_block_hash_u64"]) == 2
    assert len(tokens) % bs != 0  # the partial tail block is not hashed
    assert kvengine.compute_block_hashes(tokens, bs) == dynamo["local_block_hash_u64"]
    assert kvengine.compute_seq_hashes(tokens, bs) == dynamo["sequence_hash_u64_seed1337"]
    assert kvengine.compute_block_hashes(tokens) == dynamo["local_block_hash_u64"]  # default 16
    ix = kvengine.KvIndexer(block_size=bs)
    assert ix.compute_block_hashes(tokens) == dynamo["local_block_hash_u64"]
    # Block hashes are position-independent: the second block alone hashes the same.
    assert kvengine.compute_block_hashes(tokens[bs:2 * bs], bs) == dynamo["local_block_hash_u64"][1:]


def test_design_reference_vectors():
    assert kvengine.DEFAULT_BLOCK_SIZE == 16
    assert kvengine.compute_block_hashes(DESIGN_TOKENS, 4) == DESIGN_LOCAL
    assert kvengine.compute_block_hashes([1, 2, 3, 4], 4) == DESIGN_LOCAL[:1]
    assert kvengine.compute_block_hashes([5, 6, 7, 8], 4) == DESIGN_LOCAL[1:]
    assert kvengine.compute_seq_hashes(DESIGN_TOKENS, 4) == DESIGN_SEQ
    assert kvengine.compute_seq_hashes(DESIGN_TOKENS + [9, 10, 11], 4) == DESIGN_SEQ
    assert kvengine.compute_seq_hashes([1, 2, 3], 4) == []
    assert kvengine.KvIndexer(block_size=4).compute_block_hashes(DESIGN_TOKENS) == DESIGN_LOCAL
    # A LoRA adapter changes every block's hash (the seed), and only for that name.
    lora = kvengine.compute_block_hashes(DESIGN_TOKENS, 4, "sql")
    assert lora == kvengine.compute_block_hashes(DESIGN_TOKENS, 4, lora_name="sql")
    assert set(lora).isdisjoint(DESIGN_LOCAL)
    assert lora != kvengine.compute_block_hashes(DESIGN_TOKENS, 4, "sql2")
    assert kvengine.compute_block_hashes(DESIGN_TOKENS, 4, None) == DESIGN_LOCAL


def test_design_vectors_through_the_index():
    """A store of the reference blocks, as a dict and as msgpack, is found by its prompt."""
    for batch in (
        {"events": [{"type": "stored", "parent_hash": None, "blocks": [
            {"block_hash": 10, "token_ids": [1, 2, 3, 4]},
            {"block_hash": 11, "token_ids": [5, 6, 7, 8]}]}]},
        msgpack.packb([0.0, [["BlockStored", [10, 11], None, DESIGN_TOKENS, 4, None]]]),
    ):
        ix = kvengine.KvIndexer(block_size=4)
        assert ix.apply_events(7, batch) == {"events": 1, "blocks": 2, "dropped": {}}
        assert ix.find_matches_for_request(DESIGN_TOKENS + [9]) == {7: 2}
        assert ix.find_matches(DESIGN_LOCAL) == {7: 2}
        assert ix.find_matches(DESIGN_LOCAL[:1]) == {7: 1}
        assert ix.find_matches(DESIGN_LOCAL[1:]) == {}  # block 1 alone is another prefix
        assert ix.find_matches_for_request(DESIGN_TOKENS, lora_name="x") == {}


TOKEN_FORMS = {
    "list": list,
    "tuple": tuple,
    "bytes": lambda t: array.array("I", t).tobytes(),
    "bytearray": lambda t: bytearray(array.array("I", t).tobytes()),
    "array_I": lambda t: array.array("I", t),
    "array_L": lambda t: array.array("L", t),
    "array_q": lambda t: array.array("q", t),
    "memoryview": lambda t: memoryview(array.array("I", t)),
}


@pytest.mark.parametrize("form", sorted(TOKEN_FORMS))
def test_token_id_forms_hash_alike(form, vectors):
    """list / bytes (little-endian u32) / array.array give identical hashes and answers."""
    tokens = vectors["tokens"]
    extreme = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 65535, 65536, 7] * 3
    conv = TOKEN_FORMS[form]
    assert array.array("I").itemsize == 4
    for toks, bs in ((tokens, 16), (extreme, 4), (DESIGN_TOKENS, 4), ([], 4)):
        want_b = kvengine.compute_block_hashes(toks, bs)
        want_s = kvengine.compute_seq_hashes(toks, bs)
        assert kvengine.compute_block_hashes(conv(toks), bs) == want_b
        assert kvengine.compute_seq_hashes(conv(toks), bs) == want_s
        assert kvengine.compute_block_hashes(conv(toks), bs, "a") == kvengine.compute_block_hashes(toks, bs, "a")
    assert kvengine.compute_block_hashes(tokens, 16) == vectors["dynamo"]["local_block_hash_u64"]
    ix = kvengine.KvIndexer(block_size=4)
    ix.apply_events(3, msgpack.packb([0.0, [["BlockStored", [1, 2, 3, 4, 5, 6], None, extreme[:24], 4]]]))
    assert ix.compute_block_hashes(conv(extreme)) == kvengine.compute_block_hashes(extreme, 4)
    assert ix.find_matches_for_request(conv(extreme)) == {3: 6}
    assert ix.find_matches_for_request(conv(extreme[:10])) == {3: 2}


def test_bytes_are_little_endian_u32():
    raw = b"".join(t.to_bytes(4, "little") for t in DESIGN_TOKENS)
    assert kvengine.compute_block_hashes(raw, 4) == DESIGN_LOCAL
    big = b"".join(t.to_bytes(4, "big") for t in DESIGN_TOKENS)
    assert kvengine.compute_block_hashes(big, 4) != DESIGN_LOCAL


# --------------------------------------------------------------------------------------
# Msgpack fixtures.


def json_hash(v):
    """A block hash as fixtures.json writes it: an int (signed ones bit-cast), or digest hex."""
    if isinstance(v, int):
        return v & MASK
    return int.from_bytes(bytes.fromhex(v)[-8:], "big")


def field(ev, i, key):
    if isinstance(ev, list):
        return ev[i] if i < len(ev) else None
    return ev.get(key)


def generic_events(ev_list):
    """fixtures.json's decoded events as (kind, fields) the way kvengine converts them."""
    out = []
    for ev in ev_list:
        tag = ev[0] if isinstance(ev, list) else ev["type"]
        if tag == "BlockStored":
            out.append((
                "stored",
                [json_hash(h) for h in field(ev, 1, "block_hashes")],
                None if field(ev, 2, "parent_block_hash") is None else json_hash(field(ev, 2, "parent_block_hash")),
                field(ev, 3, "token_ids"),
                field(ev, 4, "block_size"),
                field(ev, 7, "lora_name") or (
                    None if field(ev, 5, "lora_id") is None else str(field(ev, 5, "lora_id"))),
                field(ev, 6, "medium"),
            ))
        elif tag == "BlockRemoved":
            out.append(("removed", [json_hash(h) for h in field(ev, 1, "block_hashes")], field(ev, 2, "medium")))
        elif tag == "AllBlocksCleared":
            out.append(("cleared",))
        else:
            out.append(("unknown",))
    return out


def expected_counts(events):
    """apply_events' answer for an all-GPU batch of the index's block size."""
    n = blocks = other = 0
    for e in events:
        if e[0] == "unknown":
            other += 1
        elif e[0] == "cleared":
            n += 1
        elif e[1]:
            n += 1
            blocks += len(e[1])
    return {"events": n, "blocks": blocks, "dropped": {"other": other} if other else {}}


def model_after(events, bs):
    """DESIGN.md's semantics for one worker key: {engine hash: [seq tuple, copies]}, and the
    prompts the stores name (each stored chain's tokens from its root)."""
    directory, tokens_of, prompts = {}, {}, []
    for e in events:
        if e[0] == "stored" and e[1]:
            _, hashes, parent, toks, _, lora, _ = e
            if parent is None:
                seq, prefix = (), []
            elif parent in directory:
                seq, prefix = directory[parent][0], tokens_of[parent]
            else:
                continue  # refused whole
            for i, h in enumerate(hashes):
                block = toks[i * bs:(i + 1) * bs]
                (th,) = kvengine.compute_block_hashes(block, bs, lora)
                seq, prefix = seq + (th,), prefix + block
                if h in directory:
                    directory[h][1] += 1
                else:
                    directory[h] = [seq, 1]
                tokens_of[h] = prefix
            prompts.append((prefix, lora))
        elif e[0] == "removed":
            for h in e[1]:
                if h in directory:
                    directory[h][1] -= 1
                    if directory[h][1] == 0:
                        del directory[h]
        elif e[0] == "cleared":
            directory.clear()
    held = {s for s, c in directory.values() if c > 0}
    return held, prompts


def overlap(held, prompt, lora, bs):
    n, seq = 0, ()
    for th in kvengine.compute_block_hashes(prompt, bs, lora):
        seq += (th,)
        if seq not in held:
            break
        n += 1
    return n


# What kv_events_fixtures.rs decodes each recorded fixture to, summarised:
# (events applied, blocks named, dp rank, overlap of the hash-vector prompt after the first
# event, after the whole batch).
KNOWN = {
    "vllm_v0_9_array": (3, 3, 0, 2, 0),
    "vllm_array_full": (4, 4, 0, 2, 0),
    "vllm_map_current": (3, 4, 0, 2, 0),
    "vllm_map_bytes_hashes": (2, 3, 1, 2, 1),
    "sglang_array": (4, 3, 0, 1, 0),
}


@pytest.mark.parametrize("name", fixture_names())
def test_fixture_applies_with_the_decoded_counts_and_overlaps(name, kv_events_dir, vectors):
    fixtures = json.loads((kv_events_dir / "fixtures.json").read_text())["fixtures"]
    f = fixtures[name]
    raw = (kv_events_dir / f["file"]).read_bytes()
    assert len(raw) == f["bytes"]
    assert raw.hex().startswith(f["first_bytes_hex"])
    generic = f["decoded_generic"]
    events = generic_events(generic[1])
    dp = generic[2] if len(generic) > 2 and generic[2] is not None else 0
    sizes = {e[4] for e in events if e[0] == "stored" and e[4] is not None}
    bs = sizes.pop() if sizes else vectors["block_size"]
    assert not sizes
    assert all(e[-1] in (None, "GPU") for e in events if e[0] in ("stored", "removed"))
    key = (9, dp) if dp else 9

    want = expected_counts(events)
    ix = kvengine.KvIndexer(block_size=bs)
    assert ix.apply_events(9, raw) == want, name
    for form in (bytearray, memoryview):  # the same bytes in other buffers, on other workers
        other = kvengine.KvIndexer(block_size=bs)
        assert other.apply_events(9, form(raw)) == want

    # The batch's events one prefix at a time (re-encoded: msgpack reproduces the bytes).
    decoded = msgpack.unpackb(raw, raw=False)
    assert msgpack.packb(decoded, use_bin_type=True) == raw
    hv_prompt = vectors["tokens"]
    first_overlap = None
    for k in range(1, len(decoded[1]) + 1):
        part = list(decoded)
        part[1] = decoded[1][:k]
        ixk = kvengine.KvIndexer(block_size=bs)
        assert ixk.apply_events(9, msgpack.packb(part, use_bin_type=True)) == expected_counts(events[:k])
        held, prompts = model_after(events[:k], bs)
        for prompt, lora in prompts + [(hv_prompt, None)]:
            n = overlap(held, prompt, lora, bs)
            got = ixk.find_matches_for_request(prompt, lora_name=lora)
            assert got == ({key: n} if n else {}), (name, k, prompt)
            if lora is None:
                assert ixk.find_matches(kvengine.compute_block_hashes(prompt, bs)) == got
        if k == 1:
            first_overlap = overlap(held, hv_prompt, None, bs)
    held, _ = model_after(events, bs)
    last_overlap = overlap(held, hv_prompt, None, bs)
    got = ix.find_matches_for_request(hv_prompt)
    assert got == ({key: last_overlap} if last_overlap else {})

    if name in KNOWN:
        assert KNOWN[name] == (want["events"], want["blocks"], dp, first_overlap, last_overlap)
    # The first store names the hash-vector blocks (the fixtures record the same prompt).
    first = next(e for e in events if e[0] == "stored")
    assert first[3] == hv_prompt[: len(first[3])]
    if name.startswith("vllm_") and name != "vllm_v0_9_array":
        assert first[1] == vectors["vllm"]["sha256_cbor"]["published_u64"]
    if name.startswith("sglang"):
        stored = [e[1][0] for e in events if e[0] == "stored"]
        assert stored == [h & MASK for h in vectors["sglang"]["published_i64"]]


def test_every_fixture_file_is_listed(kv_events_dir):
    fixtures = json.loads((kv_events_dir / "fixtures.json").read_text())["fixtures"]
    files = sorted(p.name for p in kv_events_dir.glob("*.msgpack"))
    assert files == sorted(f["file"] for f in fixtures.values())
    assert set(KNOWN) <= set(fixtures)


def test_numpy_token_arrays_hash_like_lists():
    """numpy integer arrays are read in one copy; other dtypes and byte orders are refused."""
    try:
        import numpy as np
    except ImportError:
        need(False, "numpy is not installed")
    ids = [0, 1, 2**31, 2**32 - 1] * 8
    want = kvengine.compute_block_hashes(ids, 16)
    for dtype in ("<u4", "=u4", "<i8", "<u8"):
        assert kvengine.compute_block_hashes(np.array(ids, dtype=dtype), 16) == want, dtype
    small = [i % 2**31 for i in ids]
    assert kvengine.compute_block_hashes(np.array(small, dtype="<i4"), 16) == \
        kvengine.compute_block_hashes(small, 16)
    with pytest.raises(ValueError):
        kvengine.compute_block_hashes(np.array([-1] * 16, dtype="<i4"), 16)
    with pytest.raises(ValueError):
        kvengine.compute_block_hashes(np.array([2**32] * 16, dtype="<i8"), 16)
    for bad in (np.zeros(16, dtype="<f4"), np.zeros(16, dtype=">u4"), np.zeros(16, dtype="<u2")):
        with pytest.raises(TypeError):
            kvengine.compute_block_hashes(bad, 16)
