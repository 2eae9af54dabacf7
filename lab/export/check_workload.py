#!/usr/bin/env python3
"""Reads a workload directory in kvengine's neutral indexer-workload format (version 1,
docs/benchmarks.md, "The exported workload format") with the standard library only, and
checks it with an exact index of its own: the base phase's events (stores, removals,
clears) applied to a radix tree keyed by tokens hashes, every query of both lists must get
exactly its expected answer.

    python3 lab/export/check_workload.py DIR/dynamo-w1

A worked example of the format for anyone writing an adapter; no seq_hash (xxh3) needed,
since a block is named by its path of tokens hashes from the root.
"""
import json
import struct
import sys
from pathlib import Path


class Reader:
    def __init__(self, path, magic):
        self.path, self.data, self.at = path, Path(path).read_bytes(), 0
        if self.take(8) != magic:
            raise SystemExit(f"{path}: not a {magic.decode()} file")
        (self.count,) = self.unpack("<Q")

    def take(self, n):
        if self.at + n > len(self.data):
            raise SystemExit(f"{self.path}: ends early at byte {self.at}")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def unpack(self, fmt):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def done(self):
        if self.at != len(self.data):
            raise SystemExit(f"{self.path}: {len(self.data) - self.at} bytes after the end")


def events(path):
    r = Reader(path, b"KVEVENT1")
    for _ in range(r.count):
        kind, worker, rank = r.unpack("<BQI")
        if kind == 1:
            has_parent, parent, n = r.unpack("<BQI")
            blocks = [r.unpack("<QQ") for _ in range(n)]
            yield ("stored", (worker, rank), parent if has_parent else None, blocks)
        elif kind == 2:
            (n,) = r.unpack("<I")
            yield ("removed", (worker, rank), [r.unpack("<Q")[0] for _ in range(n)])
        elif kind == 3:
            yield ("cleared", (worker, rank))
        else:
            raise SystemExit(f"{path}: unknown event kind {kind}")
    r.done()


def queries(path):
    r = Reader(path, b"KVQUERY1")
    for _ in range(r.count):
        (n,) = r.unpack("<I")
        tokens = list(r.unpack(f"<{n}Q")) if n else []
        (answer,) = r.unpack("<Q")
        yield tokens, answer
    r.done()


def answers(path):
    r = Reader(path, b"KVANSWR1")
    out = []
    for _ in range(r.count):
        (n,) = r.unpack("<I")
        out.append(sorted(((w, d), o) for w, d, o in (r.unpack("<QII") for _ in range(n))))
    r.done()
    return out


class Tree:
    """Nodes are paths of tokens hashes from the root; each keeps the keys holding it."""

    def __init__(self):
        self.children = [{}]  # node -> {tokens_hash: child}
        self.holders = [set()]
        self.node_of = {}  # (key, engine_hash) -> node

    def store(self, key, parent, blocks):
        node = 0 if parent is None else self.node_of[(key, parent)]
        for engine, tokens in blocks:
            child = self.children[node].get(tokens)
            if child is None:
                child = len(self.children)
                self.children[node][tokens] = child
                self.children.append({})
                self.holders.append(set())
            self.holders[child].add(key)
            self.node_of[(key, engine)] = child
            node = child

    def remove(self, key, engines):
        for engine in engines:
            node = self.node_of.pop((key, engine))
            self.holders[node].discard(key)

    def clear(self, key):
        for k, engine in [k for k in self.node_of if k[0] == key]:
            self.holders[self.node_of.pop((k, engine))].discard(key)

    def overlaps(self, tokens):
        scores, node, alive = {}, 0, None
        for depth, t in enumerate(tokens, 1):
            node = self.children[node].get(t)
            if node is None:
                break
            alive = self.holders[node] if alive is None else alive & self.holders[node]
            if not alive:
                break
            for key in alive:
                scores[key] = depth
        return sorted(scores.items())


def main(dir_):
    d = Path(dir_)
    m = json.loads((d / "manifest.json").read_text())
    if m["format"] != "kvengine-indexer-workload" or m["version"] != 1:
        raise SystemExit(f"{d}: format {m['format']} version {m['version']}, not 1")
    phases = {p["name"]: p for p in m["phases"]}
    tree = Tree()
    for ev in events(d / phases["base"]["file"]):
        if ev[0] == "stored":
            tree.store(ev[1], ev[2], ev[3])
        elif ev[0] == "removed":
            tree.remove(ev[1], ev[2])
        else:
            tree.clear(ev[1])
    for name in ("extra", "remove"):
        n = sum(1 for _ in events(d / phases[name]["file"]))
        if n != phases[name]["events"]:
            raise SystemExit(f"{name}: {n} events, the manifest says {phases[name]['events']}")
    want = answers(d / m["answers"]["file"])
    checked = 0
    for q in m["queries"]:
        for i, (tokens, a) in enumerate(queries(d / q["file"])):
            got = tree.overlaps(tokens)
            if got != want[a]:
                raise SystemExit(f"{q['name']} query {i}: {got[:3]}... != {want[a][:3]}...")
            checked += 1
    live = len(tree.node_of)
    if live != m["entries_after_base"]:
        raise SystemExit(f"{live} live entries after base, the manifest says {m['entries_after_base']}")
    print(f"{m['workload']}: {checked} queries answered as the files say "
          f"({len(tree.children) - 1} tree nodes, {live} live entries after base)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
