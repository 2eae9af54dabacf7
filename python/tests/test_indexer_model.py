"""Randomised test: `kvengine.KvIndexer` against DESIGN.md's reference model of the index.

The Python mirror of engine/tests/index_model.rs, through the Python API: random
interleavings of stores (roots, chains that extend or branch off held blocks, duplicate
stores of the same chain, conflicting engine hashes, unknown parents, LoRA adapters),
removals (mid-chain, unknown), clears (as events and through `clear()`), worker removals
and dp ranks 0 and 1, fed as event dicts and as vLLM msgpack (positional and map events,
array and map batches, int / signed / 32-byte-bin block hashes). After every operation
the answers to a set of prompts (held chains, their prefixes, extensions and diverging
variants), the refusal counters and the `apply_events` return values are compared with a
plain-Python model.

The model (DESIGN.md "Semantics of the index"): per worker key `(worker_id, dp_rank)`, a
directory engine hash -> (seq, copies) and a multiset of seqs. A seq is named here by the
tuple of its blocks' tokens hashes from the root (what the chained seq_hash names), so the
model needs `compute_block_hashes` only. `Stored` resolves its parent in that key's
directory (unknown: the whole store is refused and counted), then adds one copy per block
(except a chain from the root whose every block is held already: a report, no copy);
an engine hash already naming another seq refuses the whole store (counted as a conflict).
`Removed` drops one copy per engine hash (unknown ones counted). `Cleared` empties the key;
removing a worker forgets all its ranks. Overlap: the longest prefix of the prompt's seqs
all held with a positive count.
"""

import array
import random
from collections import Counter

import msgpack
import pytest

import kvengine

BS = 4
MASK = 2**64 - 1
WORKERS = (1, 2, 3, 2**64 - 1)
LORAS = (None, None, None, "a", "b", "7")
REASONS = ("unknown_parent", "unknown_block", "engine_hash_conflict")

# --------------------------------------------------------------------------------------
# The reference model.


class KeyModel:
    """One worker key: engine hash -> [seq, copies], and the multiset of seqs."""

    __slots__ = ("dir", "seqs")

    def __init__(self):
        self.dir = {}
        self.seqs = Counter()


class Model:
    def __init__(self):
        self.keys = {}
        self.registered = set()  # workers the indexer knows (remove_worker answers True)
        self.ranked = set()  # workers seen with a dp rank other than 0
        self.rejected = Counter()

    def key(self, key):
        km = self.keys.get(key)
        if km is None:
            km = self.keys[key] = KeyModel()
        return km

    def store(self, key, parent, blocks):
        """`blocks`: [(engine_hash, tokens_hash)]. Returns whether the store applied."""
        km = self.key(key)
        if parent is None:
            seq = ()
        elif parent in km.dir:
            seq = km.dir[parent][0]
        else:
            self.rejected["unknown_parent"] += 1
            return False
        if parent is None and blocks:
            # A chain from the root whose every block is held already, under the same engine
            # hash at the same place, is a report (vLLM's `kv_cache_report_mode: "full"`):
            # applied, no copy added (docs/architecture.md, "The index").
            at, held = (), True
            for eh, th in blocks:
                at = at + (th,)
                held = held and eh in km.dir and km.dir[eh][0] == at
            if held:
                return True
        planned = []
        pending = {}
        for eh, th in blocks:
            seq = seq + (th,)
            have = pending.get(eh, km.dir[eh][0] if eh in km.dir else None)
            if have is not None and have != seq:
                self.rejected["engine_hash_conflict"] += 1
                return False
            pending[eh] = seq
            planned.append((eh, seq))
        for eh, seq in planned:
            if eh in km.dir:
                km.dir[eh][1] += 1
            else:
                km.dir[eh] = [seq, 1]
            km.seqs[seq] += 1
        return True

    def remove(self, key, hashes):
        km = self.key(key)
        for eh in hashes:
            entry = km.dir.get(eh)
            if entry is None:
                self.rejected["unknown_block"] += 1
                continue
            entry[1] -= 1
            if entry[1] == 0:
                del km.dir[eh]
            km.seqs[entry[0]] -= 1
            if km.seqs[entry[0]] == 0:
                del km.seqs[entry[0]]

    def clear(self, key):
        """Empties `key`; returns the copies it held."""
        km = self.keys.pop(key, None)
        return sum(c for _, c in km.dir.values()) if km else 0

    def remove_worker(self, w):
        for key in [k for k in self.keys if k[0] == w]:
            del self.keys[key]
        self.ranked.discard(w)
        known = w in self.registered
        self.registered.discard(w)
        return known

    def matches(self, q):
        """`q`: the prompt's tokens hashes. `{worker or (worker, rank): overlap}`."""
        out = {}
        for (w, dp), km in self.keys.items():
            n, seq = 0, ()
            for th in q:
                seq = seq + (th,)
                if km.seqs.get(seq, 0) <= 0:
                    break
                n += 1
            if n:
                out[(w, dp) if w in self.ranked else w] = n
        return out

    def entries(self):
        return sum(len(km.seqs) for km in self.keys.values())


# --------------------------------------------------------------------------------------
# Workload generation.

_TH_CACHE = {}


def th(block, lora):
    """tokens_hash of one block under `lora` (through kvengine; cached)."""
    k = (block, lora)
    if k not in _TH_CACHE:
        (_TH_CACHE[k],) = kvengine.compute_block_hashes(list(block), BS, lora)
    return _TH_CACHE[k]


def q_hashes(tokens, lora):
    """The prompt's tokens hashes: full blocks only, all under `lora`."""
    n = len(tokens) // BS
    return [th(tuple(tokens[i * BS:(i + 1) * BS]), lora) for i in range(n)]


class Workload:
    """Random operations drawn against the model's current state."""

    def __init__(self, rng):
        self.rng = rng
        u32 = lambda: rng.choice([0, 1, 2**32 - 1, rng.randrange(2**32), rng.randrange(1000)])
        # A small pool of block contents, so chains of different workers share blocks.
        self.pool = [tuple(u32() for _ in range(BS)) for _ in range(5)]
        self.seq_info = {}  # seq -> (token list, lora of its last block)
        self.known = []  # seqs in order of first sight
        self.eh_of = {}  # seq -> the engine hash every worker gives it

    def engine_hash(self, seq):
        if seq not in self.eh_of:
            # Mostly a prefix-derived id; now and then a small shared one (conflicts).
            r = self.rng.random()
            self.eh_of[seq] = self.rng.randint(1, 4) if r < 0.06 else self.rng.getrandbits(64)
        return self.eh_of[seq]

    def note(self, seq, tokens, lora):
        if seq not in self.seq_info:
            self.seq_info[seq] = (tokens, lora)
            self.known.append(seq)

    def store_event(self, model, key):
        """("stored", parent, [(eh, block)], lora), after the seqs are registered."""
        rng = self.rng
        km = model.keys.get(key)
        held = sorted(km.dir) if km else []
        r = rng.random()
        parent_seq, parent, tokens = (), None, []
        lora = rng.choice(LORAS)
        if r < 0.45 and held:
            parent = rng.choice(held)  # extend or branch off a held block
            parent_seq = km.dir[parent][0]
            tokens, plora = self.seq_info[parent_seq]
            lora = plora if rng.random() < 0.9 else rng.choice(LORAS)
        elif r < 0.55:
            # Unknown parent: never seen, or held only by another key (dp rank or worker).
            others = [eh for k, m in model.keys.items() if k != key for eh in m.dir if eh not in (km.dir if km else {})]
            parent = rng.choice(others) if others and rng.random() < 0.6 else rng.getrandbits(64)
        elif r < 0.75 and self.known:
            # A duplicate of a chain seen before (mostly one this key holds: a second copy),
            # from its root, when one adapter made it.
            mine = sorted(km.seqs) if km else []
            seq = rng.choice(mine if mine and rng.random() < 0.7 else self.known)
            toks, slora = self.seq_info[seq]
            if all(th(tuple(toks[i * BS:(i + 1) * BS]), slora) == h for i, h in enumerate(seq)):
                blocks = [tuple(toks[i * BS:(i + 1) * BS]) for i in range(len(seq))]
                return self._chain(None, (), [], blocks, slora)
        blocks = [rng.choice(self.pool) for _ in range(rng.randint(1, 4))]
        return self._chain(parent, parent_seq, tokens, blocks, lora)

    def _chain(self, parent, parent_seq, tokens, blocks, lora):
        out = []
        seq, toks = parent_seq, list(tokens)
        for b in blocks:
            seq = seq + (th(b, lora),)
            toks = toks + list(b)
            self.note(seq, toks, lora)
            out.append((self.engine_hash(seq), b))
        return ("stored", parent, out, lora)

    def remove_event(self, model, key):
        rng = self.rng
        km = model.keys.get(key)
        held = sorted(km.dir) if km else []
        hashes = [rng.choice(held) for _ in range(rng.randint(1, 3))] if held else []
        if not hashes or rng.random() < 0.15:
            hashes.append(rng.getrandbits(64))
        return ("removed", hashes)

    def queries(self, touched):
        """Prompts to ask: (tokens, lora)."""
        rng = self.rng
        seqs = list(touched)
        if self.known:
            seqs += rng.sample(self.known, min(3, len(self.known)))
        out = []
        for seq in seqs[:6]:
            toks, lora = self.seq_info[seq]
            if rng.random() < 0.1:
                lora = rng.choice(LORAS)
            kind = rng.randrange(4)
            if kind == 0:
                p = toks
            elif kind == 1:  # a prefix, maybe with a partial block
                p = toks[: rng.randint(0, len(toks))]
            elif kind == 2:  # extended by a block and a partial one
                p = toks + list(rng.choice(self.pool)) + [5] * rng.randint(0, BS - 1)
            else:  # diverging in one token
                p = list(toks)
                i = rng.randrange(len(p))
                p[i] = (p[i] + 1) % 2**32
            out.append((p, lora))
        out.append(([rng.randrange(2**32) for _ in range(2 * BS)], None))
        return out


# --------------------------------------------------------------------------------------
# Encoders: the same events as dicts or as vLLM msgpack.


def json_batch(rng, w, dp, events):
    evs = []
    for e in events:
        if e[0] == "stored":
            _, parent, blocks, lora = e
            ev = {
                "type": "stored",
                "parent_hash": parent,
                "blocks": [{"block_hash": eh, "token_ids": list(b)} for eh, b in blocks],
            }
            if lora is not None or rng.random() < 0.5:
                ev["lora_name"] = lora
            if parent is None and rng.random() < 0.5:
                del ev["parent_hash"]
        elif e[0] == "removed":
            ev = {"type": "removed", "block_hashes": list(e[1])}
        else:
            ev = {"type": "cleared"}
        evs.append(ev)
    if dp == 0 and rng.random() < 0.3:
        return evs  # a bare list of events: rank 0
    batch = {"events": evs}
    if dp != 0 or rng.random() < 0.5:
        batch["dp_rank"] = dp
    if rng.random() < 0.3:
        batch["worker_id"] = w
    return batch


def mp_hash(rng, eh):
    """A block hash as some engine publishes it: u64, signed i64, or a 32-byte digest."""
    r = rng.random()
    if r < 0.5:
        return eh
    if r < 0.75:
        return eh - 2**64 if eh >= 2**63 else eh
    return rng.randbytes(24) + eh.to_bytes(8, "big")


def mp_stored(rng, parent, hashes, tokens, lora, medium, block_size=BS):
    lora_id, lora_name = None, lora
    if lora == "7" and rng.random() < 0.5:
        lora_id, lora_name = 7, None  # an adapter named by its id only
    elif lora is not None and rng.random() < 0.3:
        lora_id = 99  # ignored when a name is sent
    hashes = [mp_hash(rng, h) for h in hashes]
    parent = None if parent is None else mp_hash(rng, parent)
    bs = block_size if rng.random() < 0.8 or block_size != BS else None
    if rng.random() < 0.5:
        ev = ["BlockStored", hashes, parent, tokens, bs, lora_id, medium, lora_name]
        if rng.random() < 0.3:
            ev += [[None] * (len(hashes)), 0, "full_attention", None]  # newer vLLM fields
        else:
            while len(ev) > 4 and ev[-1] is None and rng.random() < 0.5:
                ev.pop()  # older vLLM: fewer fields
        return ev
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens}
    for k, v in (("block_size", bs), ("lora_id", lora_id), ("medium", medium), ("lora_name", lora_name)):
        if v is not None or rng.random() < 0.3:
            ev[k] = v
    ev["extra_keys"] = [None] * len(hashes)
    ev["group_idx"] = 0
    if rng.random() < 0.3:  # "type" not first
        items = list(ev.items())
        rng.shuffle(items)
        ev = dict(items)
    return ev


def mp_removed(rng, hashes, medium):
    hashes = [mp_hash(rng, h) for h in hashes]
    if rng.random() < 0.5:
        ev = ["BlockRemoved", hashes]
        if medium is not None or rng.random() < 0.5:
            ev.append(medium)
        return ev
    ev = {"type": "BlockRemoved", "block_hashes": hashes}
    if medium is not None:
        ev["medium"] = medium
    return ev


def msgpack_batch(rng, dp, events):
    """The batch as msgpack, with dropped-on-purpose extras; returns (bytes, dropped)."""
    evs = []
    dropped = Counter()
    gpu = lambda: rng.choice(["GPU", "gpu", None])
    for e in events:
        if rng.random() < 0.05:  # offloaded blocks: not GPU cache hits, dropped
            medium = rng.choice(["CPU", "disk"])
            if rng.random() < 0.5:
                evs.append(mp_stored(rng, None, [123], list(range(BS)), None, medium))
            else:
                evs.append(mp_removed(rng, [123], medium))
            dropped["non_gpu_medium"] += 1
        if rng.random() < 0.03:
            evs.append(rng.choice([["SomeFutureEvent", 1, {"x": [2]}], {"type": "Other", "a": None}]))
            dropped["other"] += 1
        if e[0] == "stored":
            _, parent, blocks, lora = e
            tokens = [t for _, b in blocks for t in b]
            evs.append(mp_stored(rng, parent, [eh for eh, _ in blocks], tokens, lora, gpu()))
        elif e[0] == "removed":
            evs.append(mp_removed(rng, e[1], gpu()))
        else:
            evs.append(["AllBlocksCleared"] if rng.random() < 0.5 else {"type": "AllBlocksCleared"})
    ts = rng.choice([1789095808.8378847, 17, None])
    r = rng.random()
    if r < 0.6:
        batch = [ts, evs, dp]
        if dp == 0 and rng.random() < 0.3:
            batch = [ts, evs]  # no rank: 0
    else:
        batch = {"ts": ts, "events": evs, rng.choice(["data_parallel_rank", "dp_rank"]): dp}
    return msgpack.packb(batch, use_bin_type=True), dict(dropped)


# --------------------------------------------------------------------------------------
# The test.


def check(ix, model, wl, touched, cores):
    for tokens, lora in wl.queries(touched):
        want = model.matches(q_hashes(tokens, lora))
        got = ix.find_matches_for_request(tokens, lora_name=lora)
        assert got == want, f"prompt {tokens} lora {lora}"
        if wl.rng.random() < 0.2:
            packed = array.array("I", tokens)
            assert ix.find_matches_for_request(packed.tobytes(), lora) == want
            assert ix.find_matches_for_request(packed, lora_name=lora) == want
        if wl.rng.random() < 0.3:
            locals_ = ix.compute_block_hashes(tokens, lora)
            assert locals_ == kvengine.compute_block_hashes(tokens, BS, lora)
            assert ix.find_matches(locals_) == want
    stats = ix.stats()
    for reason in REASONS:
        assert stats["rejected"][reason] == model.rejected[reason], reason
    if cores == 1:  # with more shards a block may be copied to several
        assert stats["entries"] == model.entries()


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_indexer_equals_the_reference_model(seed, cores):
    rng = random.Random(seed * 1000 + cores)
    ix = kvengine.KvIndexer(block_size=BS, cores=cores)
    assert (ix.block_size, ix.cores) == (BS, cores)
    model = Model()
    wl = Workload(rng)
    forms = Counter()
    for step in range(400):
        r = rng.random()
        w = rng.choice(WORKERS)
        dp = 1 if rng.random() < 0.3 else 0
        key = (w, dp)
        touched = []
        if r < 0.85:
            # One batch of 1..3 events for one worker key, applied to the model as drawn.
            events = []
            for _ in range(rng.choice([1, 1, 2, 3])):
                k = rng.random()
                if k < 0.6:
                    e = wl.store_event(model, key)
                    _, parent, blocks, lora = e
                    model.store(key, parent, [(eh, th(b, lora)) for eh, b in blocks])
                    km = model.keys[key]
                    touched += [km.dir[eh][0] for eh, _ in blocks if eh in km.dir]
                elif k < 0.92:
                    e = wl.remove_event(model, key)
                    model.remove(key, e[1])
                else:
                    e = ("cleared",)
                    model.clear(key)
                events.append(e)
            n_blocks = sum(len(e[1]) if e[0] == "removed" else len(e[2]) if e[0] == "stored" else 0 for e in events)
            if rng.random() < 0.5:
                form = "dict"
                out = ix.apply_events(w, json_batch(rng, w, dp, events))
                dropped = {}
            else:
                form = "msgpack"
                raw, dropped = msgpack_batch(rng, dp, events)
                out = ix.apply_events(w, raw)
            forms[form] += 1
            assert out == {"events": len(events), "blocks": n_blocks, "dropped": dropped}, (form, events)
            model.registered.add(w)
            if dp:
                model.ranked.add(w)
        elif r < 0.92:
            # clear() from Python: the copies the key held; KeyError for an unknown worker.
            if w in model.registered:
                assert ix.clear(w, dp_rank=dp) == model.clear(key)
            else:
                with pytest.raises(KeyError):
                    ix.clear(w, dp)
        else:
            assert ix.remove_worker(w) == model.remove_worker(w)
        check(ix, model, wl, touched, cores)
    assert forms["dict"] > 50 and forms["msgpack"] > 50
    # Everything the index holds, it can forget: back to no entries.
    for w in list(model.registered):
        assert ix.remove_worker(w)
        model.remove_worker(w)
    assert ix.stats()["entries"] == 0
    for seq in wl.known[:20]:
        toks, lora = wl.seq_info[seq]
        assert ix.find_matches_for_request(toks, lora) == {}


def test_the_model_reproduces_hand_computed_answers():
    """The model itself, on a case worked by hand (so a wrong model cannot pass quietly)."""
    m = Model()
    a, b, c = th((1, 2, 3, 4), None), th((5, 6, 7, 8), None), th((9, 9, 9, 9), None)
    assert m.store((1, 0), None, [(10, a), (11, b)])
    assert m.store((1, 0), 10, [(12, c)])  # branch off block 0
    assert not m.store((1, 1), 10, [(13, c)])  # rank 1 never stored 10
    assert not m.store((1, 0), 11, [(10, c)])  # 10 already names another seq
    assert m.rejected == Counter(unknown_parent=1, engine_hash_conflict=1)
    assert m.matches([a, b]) == {1: 2}
    assert m.matches([a, c, b]) == {1: 2}
    assert m.store((1, 0), None, [(10, a)])  # held already: a report, no copy
    assert m.store((1, 0), 10, [(11, b)])  # a second copy of block 1, under its parent
    m.remove((1, 0), [11, 99])
    assert m.matches([a, b]) == {1: 2} and m.rejected["unknown_block"] == 1
    m.remove((1, 0), [11])
    assert m.matches([a, b]) == {1: 1}
    m.remove((1, 0), [10])
    assert m.matches([a, b]) == {}
    m.ranked.add(1)
    assert m.store((1, 1), None, [(20, a)])
    assert m.matches([a]) == {(1, 1): 1}
    assert m.clear((1, 1)) == 1 and m.matches([a]) == {}



def test_clear_and_remove_worker_show_at_once():
    """After `clear()` / `remove_worker()` returns, queries no longer show the blocks.

    With 2 cores, the worker's home core answers the call at once and sends the removal of
    the entries other shards hold to those cores, which apply it at their next round; a
    core in the middle of a long event slice answers queries between events. The calls
    therefore wait for every shard (a sync) before returning. Worker 2 (home core 0) stores
    16 one-block chains (about half of them on shard 1); worker 3 (home core 1) is sent a
    60,000-event batch without waiting; then worker 2 is cleared / removed and its prompts
    queried. Before the calls synced, about half the trials saw `{2: 1}` for a prompt
    after the call returned. Stops at the first stale answer.
    """
    rng = random.Random(11)
    flood = msgpack.packb([0.0, [["BlockStored", [10**7 + i], None, [rng.randrange(2**32) for _ in range(BS)], BS]
                                 for i in range(60_000)], 0])
    ix = kvengine.KvIndexer(block_size=BS, cores=2)
    stale = []
    for trial in range(40):
        prompts = [[rng.randrange(2**32) for _ in range(BS)] for _ in range(16)]
        blocks = [{"type": "stored", "blocks": [{"block_hash": i + 1, "token_ids": p}]} for i, p in enumerate(prompts)]
        assert ix.apply_events(2, {"events": blocks})["blocks"] == 16
        assert all(ix.find_matches_for_request(p) == {2: 1} for p in prompts)
        ix.apply_events(3, flood, wait=False)  # keeps core 1 busy
        op = "clear" if trial % 2 else "remove_worker"
        assert (ix.clear(2) == 16) if op == "clear" else ix.remove_worker(2)
        got = [ix.find_matches_for_request(p) for p in prompts]
        if any(got):
            stale.append((trial, op, [g for g in got if g]))
            break
        ix.clear(3)
    assert not stale, stale
