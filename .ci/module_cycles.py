#!/usr/bin/env python3
"""Module cycles in the workspace's crates: `python3 .ci/module_cycles.py` (from anywhere).

For each crate below, two kinds of graph are built from the files under `<crate>/src`:

* the crate's top-level modules (a module is the first path segment under `src/`: `hub.rs`
  is `hub`, `runtime/*.rs` is `runtime`), with an edge A -> B when a file of A names
  something of B;
* inside each top-level module that is a directory, its direct submodules (the second
  segment; the directory's own `mod.rs` is `mod`), with the same rule.

A file names B through a path: `crate::B::..`, `super::..` and `self::..` resolved from the
file's own module, a child module's bare name, and every leaf of a `use` tree
(`use crate::{a, b::{c, d}}`). A name that a module only imports (`use`, `pub use`) is
followed to where it comes from, so `crate::EngineError` counts as `error`. What does not
count: comments (doc comments included), string literals, `#[cfg(test)] mod ..` (inline or
a file of its own), `pub(in ..)` visibilities, and re-exports (`pub use`: a facade, not a
dependency; they are followed as names).

Every strongly connected component of more than one module is printed with one reference
(file:line) per edge inside it. The exit status is 1 if a component has an edge that no
line of the allow list (`--allow`, default `.ci/module_cycles_allow.txt`) covers, else 0.
An allow line names one cycle, `<graph>: a -> b -> c` (closing back to `a`), where
`<graph>` is a crate or `<crate>/<top-level module>`; an edge is covered when it is a step
of such a cycle. A line whose cycle no longer exists is reported so it can be removed.

Python 3 standard library only.
"""

import argparse
import os
import re
import sys
from collections import defaultdict

CRATES = ["engine", "wire", "transport", "sim", "lab", "bin", "python"]

# Comments, string/char literals: blanked out (newlines kept, so line numbers hold).
TOKEN = re.compile(
    r"//[^\n]*"
    r"|/\*"
    r"|b?r(?P<hashes>#*)\""
    r"|b?\""
    r"|b?'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]{1,6}\}|.)|[^\\'\n])'"
)
CFG_TEST = re.compile(r"#\s*\[\s*cfg\s*\(\s*(?:test|all\s*\(\s*test\b[^\]]*\))\s*\)\s*\]")
ATTR = re.compile(r"\s*#\s*\[[^\]]*\]")
MOD_ITEM = re.compile(r"\s*(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+(\w+)\s*([{;])")
INLINE_MOD = re.compile(r"(?<![\w$])mod\s+(\w+)\s*\{")
PUB_IN = re.compile(r"pub\s*\(\s*in\s+[\w:\s]+\)")
USE = re.compile(r"(?<![\w$])(?P<vis>pub(?:\s*\([^)]*\))?\s+)?use\s+(?P<tree>[^;]*);")
USE_TOKEN = re.compile(r"::|[{},*]|\$?\w+")
INLINE = re.compile(r"(?<![\w:$])(\$?crate|super|self|[a-z_][a-z0-9_]*)((?:\s*::\s*\w+)+)")


def blank(text):
    return re.sub(r"[^\n]", " ", text)


def strip(src):
    """The source with comments and literals replaced by spaces."""
    out, pos = [], 0
    while True:
        m = TOKEN.search(src, pos)
        if m is None:
            out.append(src[pos:])
            return "".join(out)
        out.append(src[pos : m.start()])
        tok = m.group(0)
        if tok.startswith("//"):
            end = m.end()
        elif tok == "/*":
            depth, end = 1, m.end()
            while end < len(src) and depth:
                if src.startswith("/*", end):
                    depth, end = depth + 1, end + 2
                elif src.startswith("*/", end):
                    depth, end = depth - 1, end + 2
                else:
                    end += 1
        elif m.group("hashes") is not None:
            close = src.find('"' + m.group("hashes"), m.end())
            end = len(src) if close < 0 else close + 1 + len(m.group("hashes"))
        elif tok.endswith('"'):
            end = m.end()
            while end < len(src) and src[end] != '"':
                end += 2 if src[end] == "\\" else 1
            end += 1
        else:
            end = m.end()
        out.append(blank(src[m.start() : end]))
        pos = end


def drop_test_modules(text):
    """Blanks inline `#[cfg(test)] mod x { .. }`; returns (text, names of `#[cfg(test)] mod x;`)."""
    test_files = set()
    pos = 0
    while True:
        m = CFG_TEST.search(text, pos)
        if m is None:
            return text, test_files
        end = m.end()
        while (a := ATTR.match(text, end)) is not None:
            end = a.end()
        item = MOD_ITEM.match(text, end)
        if item is None:
            pos = m.end()
            continue
        if item.group(2) == ";":
            test_files.add(item.group(1))
            pos = item.end()
            continue
        depth, close = 1, item.end()
        while close < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[close], 0)
            close += 1
        text = text[: m.start()] + blank(text[m.start() : close]) + text[close:]
        pos = close


def parse_use_tree(tree, base_offset):
    """Leaves of a use tree: [(segments, bound name or None for globs, offset)]."""
    toks = [(t.group(0), base_offset + t.start()) for t in USE_TOKEN.finditer(tree)]
    leaves = []

    def one(i, prefix):
        path = list(prefix)
        while i < len(toks):
            tok, off = toks[i]
            if tok == "{":
                i += 1
                while i < len(toks) and toks[i][0] != "}":
                    i = one(i, path)
                    if i < len(toks) and toks[i][0] == ",":
                        i += 1
                return i + 1
            if tok == "*":
                leaves.append((path, None, off))
                return i + 1
            if tok in (",", "}"):
                return i
            if tok == "::":
                i += 1
                continue
            path.append(tok)
            i += 1
            if i < len(toks) and toks[i][0] == "::":
                i += 1
                continue
            name = path[-2] if tok == "self" and len(path) > 1 else tok
            if i < len(toks) and toks[i][0] == "as" and i + 1 < len(toks):
                name = toks[i + 1][0]
                i += 2
            leaves.append((path, name, off))
            return i
        return i

    i = 0
    while i < len(toks):
        i = one(i, [])
        if i < len(toks) and toks[i][0] == ",":
            i += 1
    return leaves


class Crate:
    def __init__(self, root, name):
        self.name = name
        self.src = os.path.join(root, name, "src")
        self.files = {}  # module path (tuple) -> file
        for dirpath, dirs, names in os.walk(self.src):
            dirs.sort()
            for n in sorted(names):
                if not n.endswith(".rs"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, n), self.src).split(os.sep)
                if rel in (["lib.rs"], ["main.rs"]):
                    mod = ()
                elif rel[-1] == "mod.rs":
                    mod = tuple(rel[:-1])
                else:
                    mod = tuple(rel[:-1]) + (rel[-1][:-3],)
                self.files[mod] = os.path.join(dirpath, n)
        self.children = defaultdict(set)
        for mod in self.files:
            for k in range(1, len(mod) + 1):
                self.children[mod[: k - 1]].add(mod[k - 1])
        self.texts, self.inline, self.bindings, self.refs = {}, {}, defaultdict(dict), {}
        tests = set()
        for mod in sorted(self.files):
            with open(self.files[mod], encoding="utf-8") as f:
                text, test_files = drop_test_modules(strip(f.read()))
            self.texts[mod] = text
            tests |= {mod + (t,) for t in test_files}
        for mod in list(self.files):
            if any(mod[: len(t)] == t for t in tests):
                del self.files[mod], self.texts[mod]
        self.modules = set(self.files)
        for mod in self.files:
            self.inline[mod] = self.inline_modules(mod)
        for mod in self.files:
            self.scan(mod)

    def inline_modules(self, mod):
        """`mod x { .. }` blocks of the file: [(start, end, module path)], outermost first."""
        text, spans = self.texts[mod], []
        for m in INLINE_MOD.finditer(text):
            depth, end = 1, m.end()
            while end < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                end += 1
            outer = [s for s in spans if s[0] <= m.start() < s[1]]
            path = (outer[-1][2] if outer else mod) + (m.group(1),)
            spans.append((m.start(), end, path))
            self.modules.add(path)
            self.children[path[:-1]].add(path[-1])
        return spans

    def module_at(self, mod, offset):
        """The module that the code at `offset` of `mod`'s file is in."""
        inside = [s for s in self.inline[mod] if s[0] <= offset < s[1]]
        return inside[-1][2] if inside else mod

    def scan(self, mod):
        """Collects the module's `use` bindings and its references (path, offset)."""
        text = PUB_IN.sub(lambda m: blank(m.group(0)), self.texts[mod])
        refs, spans = [], []
        for m in USE.finditer(text):
            spans.append((m.start(), m.end()))
            reexport = m.group("vis") is not None
            here = self.module_at(mod, m.start())
            for path, name, off in parse_use_tree(m.group("tree"), m.start("tree")):
                absolute = self.absolute(here, path)
                if absolute is None:
                    continue
                if name is not None:
                    self.bindings[here][name] = absolute
                if not reexport:
                    refs.append((absolute, off))
        spans.sort()
        for m in INLINE.finditer(text):
            if any(a <= m.start() < b for a, b in spans):
                continue
            path = [m.group(1)] + re.findall(r"\w+", m.group(2))
            absolute = self.absolute(self.module_at(mod, m.start()), path)
            if absolute is not None:
                refs.append((absolute, m.start()))
        self.refs[mod] = refs

    def absolute(self, mod, path):
        """`path` as written in `mod`, from the crate root; None if not this crate's."""
        head = path[0]
        if head in ("crate", "$crate"):
            base, rest = [], path[1:]
        elif head == "self":
            base, rest = list(mod), path[1:]
        elif head == "super":
            base, rest = list(mod), path
            while rest and rest[0] == "super":
                if not base:
                    return None
                base, rest = base[:-1], rest[1:]
        elif head in self.children[mod]:
            base, rest = list(mod), path
        else:
            return None
        rest = [s for s in rest if s not in ("self", "*")]
        return tuple(base + rest)

    def target(self, path, depth=0):
        """The module that defines what `path` (from the root) names."""
        k = len(path)
        while k and path[:k] not in self.modules:
            k -= 1
        mod = path[:k]
        if k < len(path) and depth < 8:
            bound = self.bindings.get(mod, {}).get(path[k])
            if bound is not None and bound != path[: k + 1]:
                return self.target(bound + path[k + 1 :], depth + 1)
        return mod

    def line(self, mod, offset):
        return self.texts[mod].count("\n", 0, offset) + 1

    def graphs(self):
        """{graph name: {(a, b): example}}: the crate's top level and each directory module."""
        dirs = {m[0] for m in self.files if len(m) > 1}
        graphs = defaultdict(dict)
        for mod in sorted(self.files):
            for path, off in self.refs[mod]:
                dst = self.target(path)
                if not mod or not dst:
                    continue
                where = "%s:%d" % (os.path.relpath(self.files[mod]), self.line(mod, off))
                example = "%s  (%s)" % (where, "::".join(path))
                if mod[0] != dst[0]:
                    graphs[self.name].setdefault((mod[0], dst[0]), example)
                elif mod[0] in dirs:
                    a = mod[1] if len(mod) > 1 else "mod"
                    b = dst[1] if len(dst) > 1 else "mod"
                    if a != b:
                        graphs["%s/%s" % (self.name, mod[0])].setdefault((a, b), example)
        return graphs


def components(edges):
    """Strongly connected components (Tarjan), each a sorted list."""
    succ = defaultdict(list)
    nodes = set()
    for a, b in edges:
        succ[a].append(b)
        nodes |= {a, b}
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        work = [(v, iter(sorted(succ[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(succ[w]))))
                    advanced = True
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def covering_cycles(comp, edges, covered):
    """Cycles (each a module list) through every edge of `comp` not in `covered`."""
    succ = defaultdict(list)
    for a, b in sorted(edges):
        if a in comp and b in comp:
            succ[a].append(b)
    covered, out = set(covered), []
    for a, b in sorted(e for e in edges if e[0] in comp and e[1] in comp):
        if (a, b) in covered:
            continue
        # Shortest path b -> a inside the component: the edge's cycle.
        prev, queue = {b: None}, [b]
        while queue and a not in prev:
            node = queue.pop(0)
            for w in succ[node]:
                if w not in prev:
                    prev[w] = node
                    queue.append(w)
        path, node = [], a
        while node is not None:
            path.append(node)
            node = prev[node]
        cycle = path[::-1]  # b .. a
        cycle = [a] + cycle[:-1]
        covered |= {(cycle[i], cycle[(i + 1) % len(cycle)]) for i in range(len(cycle))}
        out.append(cycle)
    return out


def read_allow(path):
    """{graph: [(line number, [modules])]} from the allow file."""
    allowed = defaultdict(list)
    if path is None or not os.path.exists(path):
        return allowed
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            graph, _, cycle = line.partition(":")
            mods = [m.strip() for m in cycle.split("->") if m.strip()]
            if not graph.strip() or len(mods) < 2:
                sys.exit("%s:%d: expected `<graph>: a -> b [-> c ..]`" % (path, n))
            allowed[graph.strip()].append((n, mods))
    return allowed


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--root", default=os.path.dirname(here), help="the workspace root")
    ap.add_argument(
        "--allow",
        default=os.path.join(here, "module_cycles_allow.txt"),
        help="known cycles to tolerate (default: %(default)s)",
    )
    ap.add_argument(
        "-v", "--verbose", action="store_true", help="print allowed cycles' edges too"
    )
    ap.add_argument(
        "--suggest",
        action="store_true",
        help="print allow lines covering every uncovered edge (to review, not to paste blindly)",
    )
    ap.add_argument("crates", nargs="*", default=CRATES, help="crates to check (default: all)")
    args = ap.parse_args()
    os.chdir(args.root)
    allowed = read_allow(args.allow)
    failed, seen_graphs = False, set()
    for name in args.crates:
        for graph, edges in sorted(Crate(".", name).graphs().items()):
            seen_graphs.add(graph)
            covered = set()
            for _, mods in allowed.get(graph, []):
                covered |= {(mods[i], mods[(i + 1) % len(mods)]) for i in range(len(mods))}
            for comp in components(edges):
                if len(comp) < 2:
                    continue
                inside = sorted((a, b) for a, b in edges if a in comp and b in comp)
                new = [e for e in inside if e not in covered]
                failed |= bool(new)
                if not new and not args.verbose:
                    print("%s: allowed cycle among %s" % (graph, ", ".join(comp)))
                    continue
                state = "CYCLE" if new else "allowed cycle"
                print("%s: %s among %s" % (graph, state, ", ".join(comp)))
                for a, b in inside:
                    mark = "  " if (a, b) in covered else "* "
                    print("  %s%s -> %s   %s" % (mark, a, b, edges[(a, b)]))
                if new and args.suggest:
                    for cycle in covering_cycles(comp, edges, covered):
                        print("  suggest: %s: %s" % (graph, " -> ".join(cycle)))
            for n, mods in allowed.get(graph, []):
                steps = [(mods[i], mods[(i + 1) % len(mods)]) for i in range(len(mods))]
                if not all(s in edges for s in steps):
                    print(
                        "%s:%d: %s: %s is no longer a cycle: remove the line"
                        % (os.path.relpath(args.allow), n, graph, " -> ".join(mods))
                    )
    for graph in sorted(set(allowed) - seen_graphs):
        if graph.split("/")[0] in args.crates:
            print("%s: the allow list names %s, which has no module edges" % (args.allow, graph))
    if failed:
        print("module cycles: FAILED (edges marked * are on no allowed cycle)")
        return 1
    print("module cycles: none beyond the allow list")
    return 0


if __name__ == "__main__":
    sys.exit(main())
