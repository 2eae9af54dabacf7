"""Tests of `kvengine.client` against a real `kvengine` router process.

The router binary is `$KVENGINE_BIN`, else `target/debug/kvengine`, else
`target/release/kvengine` (build it with `cargo build -p kvengine`). Without one the tests
that need it are skipped, unless `KVENGINE_PY_REQUIRED=1`, which makes that a failure.

The router is started once per module, on 127.0.0.1 with a free port (`--http-port 0`,
read back from its start-up line), one core, no pinning and no workers; each test
registers its own workers under ids no other test uses.
"""

from __future__ import annotations

import http.server
import importlib.util
import itertools
import json
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
CLIENT_PY = REPO / "python" / "py" / "kvengine" / "client.py"

try:
    from kvengine.client import ApiError, Client
except ImportError:
    # `kvengine/__init__.py` imports the compiled `kvengine._kvengine`; without it (or
    # without the package installed) load the pure-Python client straight from its file.
    _spec = importlib.util.spec_from_file_location("_kvengine_client_under_test", CLIENT_PY)
    assert _spec is not None and _spec.loader is not None, CLIENT_PY
    _client = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _client
    _spec.loader.exec_module(_client)
    ApiError = _client.ApiError  # type: ignore[misc]
    Client = _client.Client  # type: ignore[misc]

from server import BLOCK, Router, start_router  # noqa: E402


@pytest.fixture(scope="module")
def router() -> Iterator[Router]:
    r = start_router()
    try:
        yield r
    finally:
        r.stop()
        code = r.proc.returncode
        assert code in (0, -15), f"router exited with {code}\n{r.output()}"


@pytest.fixture
def client(router: Router) -> Client:
    return Client(router.url, timeout=10.0)


_ids = itertools.count(1000)


@pytest.fixture
def wid() -> int:
    """A worker id no other test uses (so tests do not see each other's workers)."""
    return next(_ids)


def tokens_for(worker: int, n: int, salt: int = 0) -> List[int]:
    """`n` token ids no other test's prompts share a block with."""
    base = ((worker - 999) * 10 + salt) * 10_000  # well inside u32
    return list(range(base, base + n))


def stored(tokens: List[int], first_hash: int, parent: Optional[int] = None,
           lora_name: Optional[str] = None) -> Dict[str, Any]:
    """A `stored` event of the full blocks of `tokens`, hashed first_hash, first_hash+1, ..."""
    blocks = [
        {"block_hash": first_hash + i, "token_ids": tokens[i * BLOCK:(i + 1) * BLOCK]}
        for i in range(len(tokens) // BLOCK)
    ]
    ev: Dict[str, Any] = {"type": "stored", "parent_hash": parent, "blocks": blocks}
    if lora_name is not None:
        ev["lora_name"] = lora_name
    return ev


def worker_entry(client: Client, worker: int) -> Optional[Dict[str, Any]]:
    return next((w for w in client.workers()["workers"] if w["worker_id"] == worker), None)


def score_of(answer: Dict[str, Any], worker: int, rank: int = 0) -> int:
    for s in answer["scores"]:
        if s["worker_id"] == worker and s["dp_rank"] == rank:
            return s["overlap_blocks"]
    return 0


# --------------------------------------------------------------------------- tests


def test_health(client: Client) -> None:
    h = client.health()
    assert h["status"] == "ok"
    assert isinstance(h["workers"], int)


def test_add_list_update_remove_worker(client: Client, wid: int) -> None:
    before = client.health()["workers"]
    w = client.add_worker(wid, zmq="tcp://127.0.0.1:1", replay="tcp://127.0.0.1:2",
                          dp_ranks=[0, 1], role="decode")
    assert w["worker_id"] == wid
    assert w["dp_ranks"] == [0, 1]
    assert w["zmq"] == "tcp://127.0.0.1:1" and w["replay"] == "tcp://127.0.0.1:2"
    assert w["role"] == "decode" and w["url"] is None and w["healthy"] is True
    assert [load["dp_rank"] for load in w["loads"]] == [0, 1]
    assert client.health()["workers"] == before + 1

    listed = worker_entry(client, wid)
    assert listed is not None and listed["role"] == "decode" and listed["dp_ranks"] == [0, 1]

    # An update changes the fields given and keeps the others.
    w = client.add_worker(wid, role="prefill", bootstrap_port=9001)
    assert w["role"] == "prefill" and w["bootstrap_port"] == 9001
    assert w["zmq"] == "tcp://127.0.0.1:1" and w["dp_ranks"] == [0, 1]
    assert client.health()["workers"] == before + 1
    # A worker's API key is taken, never shown.
    assert w["api_key"] is False
    w = client.add_worker(wid, api_key="sk-worker")
    assert w["api_key"] is True and "sk-worker" not in json.dumps(client.workers())
    with pytest.raises(ApiError) as e:
        client.add_worker(wid, api_key="has space")
    assert e.value.status == 400 and e.value.code == "invalid_argument"

    assert client.remove_worker(wid) == {"removed": True}
    assert worker_entry(client, wid) is None
    assert client.health()["workers"] == before
    with pytest.raises(ApiError) as e:
        client.remove_worker(wid)
    assert e.value.status == 404 and e.value.code == "unknown_worker"
    assert str(wid) in e.value.message


def test_add_worker_refuses_bad_values(client: Client, wid: int) -> None:
    with pytest.raises(ApiError) as e:
        client.add_worker(wid, url="ftp://10.0.0.5")
    assert e.value.status == 400 and e.value.code == "invalid_argument"
    assert "invalid url" in e.value.message
    with pytest.raises(ApiError) as e:
        client.add_worker(wid, role="janitor")
    assert e.value.status == 400 and e.value.code == "invalid_argument"
    assert worker_entry(client, wid) is None
    with pytest.raises(TypeError, match="worker_id"):
        client.add_worker("1")  # type: ignore[arg-type]


def test_stored_event_shows_in_overlap_and_route(client: Client, wid: int) -> None:
    other = next(_ids)
    client.add_worker(wid)
    client.add_worker(other)
    prompt = tokens_for(wid, 3 * BLOCK + 5)

    # Nothing cached yet.
    o = client.overlap(prompt)
    assert o["block_size"] == BLOCK and o["blocks"] == 3
    assert score_of(o, wid) == 0 and score_of(o, other) == 0

    r = client.apply_events(wid, [stored(prompt[: 2 * BLOCK], first_hash=11)], dp_rank=0)
    assert r["applied"] == 1 and r["rejected"] == 0
    r = client.apply_events(wid, [stored(prompt[2 * BLOCK: 3 * BLOCK], 13, parent=12)])
    assert r["applied"] == 1

    o = client.overlap(prompt)
    assert score_of(o, wid) == 3 and score_of(o, other) == 0
    assert o["scores"][0] == {"worker_id": wid, "dp_rank": 0, "overlap_blocks": 3}
    # A prompt that shares only the first block.
    o = client.overlap(prompt[:BLOCK] + tokens_for(other, BLOCK))
    assert score_of(o, wid) == 1

    rid = f"route-{wid}"
    d = client.route(prompt, request_id=rid)
    assert d["request_id"] == rid
    assert d["worker_id"] == wid and d["dp_rank"] == 0
    assert d["mode"] == "kv" and d["pool"] == "whole"
    assert d["blocks"] == 3 and d["overlap_blocks"] == 3
    assert d["best_available_overlap_blocks"] == 3
    cand = {c["worker_id"]: c for c in d["candidates"]}
    assert cand[wid]["overlap_blocks"] == 3 and cand[other]["overlap_blocks"] == 0
    assert cand[wid]["logit"] < cand[other]["logit"]

    load = worker_entry(client, wid)["loads"][0]  # type: ignore[index]
    assert load["active_requests"] == 1 and load["active_prefill_tokens"] > 0
    assert client.prefilled(rid) == {}
    load = worker_entry(client, wid)["loads"][0]  # type: ignore[index]
    assert load["active_requests"] == 1 and load["active_prefill_tokens"] == 0
    assert client.free(rid) == {}
    assert worker_entry(client, wid)["loads"][0]["active_requests"] == 0  # type: ignore[index]

    # The blocks leave the index with the worker.
    client.remove_worker(wid)
    client.remove_worker(other)
    assert score_of(client.overlap(prompt), wid) == 0


def test_route_modes_and_overrides(client: Client, wid: int) -> None:
    client.add_worker(wid, dp_ranks=[0, 1])
    prompt = tokens_for(wid, 2 * BLOCK)
    d = client.route(prompt, worker_id=wid)  # worker_id alone means direct
    assert d["mode"] == "direct" and d["worker_id"] == wid
    assert d["request_id"]  # made up by the router
    client.free(d["request_id"])

    d = client.route(prompt, request_id=f"w-{wid}", mode="direct", worker_id=wid,
                     overlap_weight=2.0, temperature=0.0)
    assert d["worker_id"] == wid and d["request_id"] == f"w-{wid}"
    client.free(d["request_id"])

    with pytest.raises(ApiError) as e:
        client.route(prompt, mode="fastest")
    assert e.value.status == 400 and e.value.code == "invalid_argument"
    assert "fastest" in e.value.message
    with pytest.raises(ApiError) as e:
        client.route(prompt, temperature=-1.0)
    assert e.value.status == 400 and e.value.code == "invalid_argument"
    with pytest.raises(ApiError) as e:
        client.route(prompt, pool="everything")
    assert e.value.status == 400 and e.value.code == "invalid_argument"
    with pytest.raises(ApiError) as e:
        client.route(prompt, worker_id=wid + 500_000)
    assert e.value.status == 404 and e.value.code == "unknown_worker"
    client.remove_worker(wid)


def test_lora_blocks_match_only_the_same_adapter(client: Client, wid: int) -> None:
    client.add_worker(wid)
    prompt = tokens_for(wid, 2 * BLOCK)
    client.apply_events(wid, [stored(prompt, 1, lora_name="adapter-a")])
    assert score_of(client.overlap(prompt, lora_name="adapter-a"), wid) == 2
    assert score_of(client.overlap(prompt), wid) == 0
    assert score_of(client.overlap(prompt, lora_name="adapter-b"), wid) == 0
    d = client.route(prompt, lora_name="adapter-a", mode="direct", worker_id=wid)
    assert d["overlap_blocks"] == 2
    client.free(d["request_id"])
    client.remove_worker(wid)


def test_duplicate_request_id_is_409(client: Client, wid: int) -> None:
    client.add_worker(wid)
    prompt = tokens_for(wid, BLOCK)
    rid = f"dup-{wid}"
    client.route(prompt, request_id=rid, worker_id=wid)
    with pytest.raises(ApiError) as e:
        client.route(prompt, request_id=rid, worker_id=wid)
    err = e.value
    assert err.status == 409 and err.code == "duplicate_request"
    assert err.message == f'request "{rid}" is already active'
    assert err.body == {"error": {"code": "duplicate_request", "message": err.message,
                                  "type": "invalid_request_error", "param": None}}
    assert "409" in str(err) and rid in str(err)
    client.free(rid)
    # Once freed, the id may be used again.
    assert client.route(prompt, request_id=rid, worker_id=wid)["request_id"] == rid
    client.free(rid)
    client.remove_worker(wid)


def test_unknown_request_is_404(client: Client) -> None:
    for call in (client.free, client.prefilled):
        with pytest.raises(ApiError) as e:
            call("never-routed")
        assert e.value.status == 404 and e.value.code == "unknown_request"
        assert e.value.message == 'no active request "never-routed"'


def test_request_ids_are_quoted_in_paths(client: Client, wid: int) -> None:
    client.add_worker(wid)
    rid = f"a/b c?d#e%f&g+é-{wid}"
    d = client.route(tokens_for(wid, BLOCK), request_id=rid, worker_id=wid)
    assert d["request_id"] == rid
    assert client.prefilled(rid) == {}
    assert client.free(rid) == {}
    with pytest.raises(ApiError) as e:
        client.free(rid)
    assert e.value.status == 404 and rid in e.value.message
    client.remove_worker(wid)


def test_bad_token_ids(client: Client) -> None:
    # Not ints: refused before anything is sent, naming the culprit.
    with pytest.raises(TypeError, match=r"token_ids\[1\] must be an int, not str"):
        client.overlap([1, "2", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"token_ids\[0\] must be an int, not float"):
        client.route([1.5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="token_ids must be a sequence of ints"):
        client.overlap("1 2 3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token_ids must be a sequence of ints"):
        client.overlap(7)  # type: ignore[arg-type]
    # Ints out of u32 range: the server's schema error.
    for bad in ([1, -1], [2**32]):
        with pytest.raises(ApiError) as e:
            client.overlap(bad)
        assert e.value.status == 400 and e.value.code == "malformed_json"
        assert "u32" in e.value.message
    # Any iterable of ints will do.
    assert client.overlap(range(5)) == {"block_size": BLOCK, "blocks": 0, "scores": []}
    assert client.overlap([]) == {"block_size": BLOCK, "blocks": 0, "scores": []}


def test_apply_events_outcomes(client: Client, wid: int) -> None:
    ev = stored(tokens_for(wid, BLOCK), 1)
    with pytest.raises(ApiError) as e:
        client.apply_events(wid, [ev])  # not registered yet
    assert e.value.status == 404 and e.value.code == "unknown_worker"

    client.add_worker(wid)
    short = {"type": "stored", "parent_hash": None,
             "blocks": [{"block_hash": 99, "token_ids": [1, 2, 3]}]}
    with pytest.raises(ApiError) as e:
        client.apply_events(wid, [short])
    assert e.value.status == 400 and e.value.code == "nothing_applied"
    assert [r["reason"] for r in e.value.rejected_reasons] == ["token_count_mismatch"]

    r = client.apply_events(wid, [ev, short, {"type": "removed", "block_hashes": [1]},
                                  {"type": "cleared"}])
    assert r["applied"] == 3 and r["rejected"] == 1
    assert r["rejected_reasons"][0]["index"] == 1

    orphan = stored(tokens_for(wid, BLOCK, salt=1), 50, parent=12345)
    with pytest.raises(ApiError) as e:
        client.apply_events(wid, [orphan])
    assert e.value.rejected_reasons[0]["reason"] == "unknown_parent"

    assert client.apply_events(wid, []) == {"applied": 0, "rejected": 0}

    with pytest.raises(ApiError) as e:
        client.apply_events(wid, [{"type": "teleported"}])
    assert e.value.status == 400 and e.value.code == "malformed_json"

    # Fencing: a new rank registers itself; the same batch again is a duplicate.
    batch = [stored(tokens_for(wid, BLOCK, salt=2), 70)]
    assert client.apply_events(wid, batch, dp_rank=1, seq=0)["fence"] == "in_order"
    again = client.apply_events(wid, batch, dp_rank=1, seq=0)
    assert again["fence"] == "duplicate" and again["skipped"] == 1
    assert 1 in worker_entry(client, wid)["dp_ranks"]  # type: ignore[index]
    assert client.apply_events(wid, [], dp_rank=1, seq=1)["fence"] == "in_order"
    with pytest.raises(TypeError):
        client.apply_events(wid, ev)  # type: ignore[arg-type]
    client.remove_worker(wid)


def test_report_load(client: Client, wid: int) -> None:
    client.add_worker(wid)
    assert worker_entry(client, wid)["loads"][0]["kv_usage"] is None  # type: ignore[index]
    assert client.report_load(wid, num_requests_waiting=3, kv_usage=0.25) == {}
    load = worker_entry(client, wid)["loads"][0]  # type: ignore[index]
    assert load["num_requests_waiting"] == 3 and load["kv_usage"] == 0.25
    # A load report never creates a rank (a routing candidate); registration does.
    with pytest.raises(ApiError) as e:
        client.report_load(wid, 0, 0.5, dp_rank=2)
    assert e.value.status == 404 and e.value.code == "unknown_rank"
    w = worker_entry(client, wid)
    assert w is not None and w["dp_ranks"] == [0]
    client.add_worker(wid, dp_ranks=[0, 2])
    assert client.report_load(wid, 0, 0.5, dp_rank=2) == {}
    with pytest.raises(ApiError) as e:
        client.report_load(wid, 1, 1.5)
    assert e.value.status == 400 and e.value.code == "invalid_argument"
    assert "kv_usage" in e.value.message
    client.remove_worker(wid)
    with pytest.raises(ApiError) as e:
        client.report_load(wid, 1, 0.5)
    assert e.value.status == 404


def test_metrics(client: Client, wid: int) -> None:
    client.add_worker(wid)
    client.apply_events(wid, [stored(tokens_for(wid, BLOCK), 1)])
    d = client.route(tokens_for(wid, BLOCK), worker_id=wid)
    text = client.metrics()
    client.free(d["request_id"])
    client.remove_worker(wid)
    assert isinstance(text, str)
    assert "kvengine_events_applied_total" in text
    assert re.search(r'^kvengine_decisions_total\{mode="direct"\} [1-9]', text, re.M), text
    assert f'kvengine_worker_active_requests{{worker_id="{wid}",dp_rank="0"}} 1' in text


def test_connection_refused_is_connection_error() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ConnectionError, match=re.escape(url)):
        Client(url, timeout=2).health()
    with pytest.raises(ConnectionError, match=re.escape(url + "/v1/route")):
        Client(url + "/", timeout=2).route([1, 2, 3])


def test_bad_base_url() -> None:
    with pytest.raises(ValueError):
        Client("localhost:8000")


# ------------------------------------------- a stand-in server, for what kvengine never does


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: List[Dict[str, Any]] = []
    delay = 0.0

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        type(self).seen.append({"method": self.command, "path": self.path,
                                "headers": dict(self.headers), "body": body})
        time.sleep(type(self).delay)
        if self.path.startswith("/broken"):
            payload, status, ctype = b"upstream exploded", 502, "text/plain"
        else:
            payload, status, ctype = b'{"status":"ok","workers":0}', 200, "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[str]:
    _Recorder.seen = []
    _Recorder.delay = 0.0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_api_key_and_body_are_sent(stand_in: str) -> None:
    Client(stand_in, api_key="s3cret").overlap([1, 2], lora_name="x")
    req = _Recorder.seen[-1]
    assert req["method"] == "POST" and req["path"] == "/v1/overlap"
    assert req["headers"]["Authorization"] == "Bearer s3cret"
    assert req["headers"]["Content-Type"] == "application/json"
    assert json.loads(req["body"]) == {"token_ids": [1, 2], "lora_name": "x"}
    Client(stand_in).health()
    assert "Authorization" not in _Recorder.seen[-1]["headers"]
    # Optional fields left out are not sent (null would mean the same to the server).
    Client(stand_in).route([1], request_id="r")
    assert json.loads(_Recorder.seen[-1]["body"]) == {"token_ids": [1], "request_id": "r"}


def test_non_json_error_body(stand_in: str) -> None:
    with pytest.raises(ApiError) as e:
        Client(stand_in + "/broken").health()
    assert e.value.status == 502 and e.value.code is None
    assert e.value.message == "upstream exploded" and e.value.body == "upstream exploded"


def test_timeout(stand_in: str) -> None:
    _Recorder.delay = 1.0
    with pytest.raises(TimeoutError, match=re.escape(stand_in)):
        Client(stand_in, timeout=0.2).health()


def test_models_route_among_their_own_workers() -> None:
    """`model` on add_worker, route and overlap: each model's requests go to its workers,
    an unknown model is 404 `model_not_found` (a router of its own: named models change how
    the other tests' unnamed requests resolve)."""
    r = start_router()
    try:
        c = Client(r.url, timeout=10.0)
        assert c.add_worker(1, model="alpha")["model"] == "alpha"
        c.add_worker(2, model="beta")
        prompt = list(range(50_000, 50_000 + 2 * BLOCK))
        c.apply_events(1, [stored(prompt, first_hash=1)])
        c.apply_events(2, [stored(prompt, first_hash=100)])
        for model, worker in (("alpha", 1), ("beta", 2)):
            o = c.overlap(prompt, model=model)
            assert [(s["worker_id"], s["overlap_blocks"]) for s in o["scores"]] == [(worker, 2)]
            d = c.route(prompt, model=model)
            assert d["worker_id"] == worker
            assert [x["worker_id"] for x in d["candidates"]] == [worker]
            c.free(d["request_id"])
        with pytest.raises(ApiError) as e:
            c.route(prompt, model="gamma")
        assert e.value.status == 404 and "model_not_found" in str(e.value)
        with pytest.raises(ApiError) as e:
            c.route(prompt)  # two models, none named
        assert e.value.status == 400
    finally:
        r.stop()
