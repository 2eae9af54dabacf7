"""Issue 11's end-to-end check: kvengine started from a config file serving two models, each
on its own simulated vLLM worker process (`kvengine sim`), one of them requiring an API key,
and the official `openai` client getting correct answers from both through the front door.

Checked on the way: `/v1/models` lists both models, an unknown model is OpenAI's 404
`model_not_found`, each request goes to its model's worker (never the other's), the worker
with `--api-key` gets its key from the config while the client's own key never reaches it,
a model's index uses its own block size (the second model's workers hash 32-token blocks),
and `/ready` reports every model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from conftest import need
from server import _binary, start_router, stop_process

API_KEY = "beta-worker-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Sim:
    """A `kvengine sim` process: one simulated vLLM worker."""

    def __init__(self, args: List[str]) -> None:
        binary = _binary()
        need(binary is not None and binary.is_file(), "no kvengine binary")
        assert binary is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVENGINE_")}
        self.http = free_port()
        self.zmq = free_port()
        self.proc = subprocess.Popen(
            [str(binary), "sim", "--port", str(self.http), "--zmq-port", str(self.zmq),
             "--speedup", "50", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )
        self.lines: List[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(30) or self.proc.poll() is not None:
            self.stop()
            pytest.fail("kvengine sim did not start:\n" + "\n".join(self.lines))
        self.url = f"http://127.0.0.1:{self.http}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.lines.append(line)
            if "Ctrl-C stops" in line:
                self.ready.set()
        self.ready.set()

    def stop(self) -> None:
        stop_process(self.proc)


def get(url: str) -> Tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: dict) -> Tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def cluster() -> Iterator[Tuple[str, Sim, Sim]]:
    alpha = Sim(["--model", "alpha", "--first-worker-id", "1"])
    beta = Sim(["--model", "beta", "--first-worker-id", "2", "--block-size", "32",
                "--api-key", API_KEY])
    # beta is wired the way a vLLM operator copies it: the worker's --kv-events-config as is.
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{beta.zmq}",
                         "replay_endpoint": f"tcp://*:{beta.zmq + 1}", "topic": ""})
    config = f"""
router-mode = "kv"
tokenizer = "stand-in"
health-interval-secs = 0.2

[[models]]
name = "alpha"

[[models]]
name = "beta"
block_size = 32

[[workers]]
id = 1
url = "{alpha.url}"
zmq = "tcp://127.0.0.1:{alpha.zmq}"
replay = "tcp://127.0.0.1:{alpha.zmq + 1}"
model = "alpha"

[[workers]]
id = 2
url = "{beta.url}"
kv_events_config = '{events}'
model = "beta"
api_key = "{API_KEY}"
"""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kvengine.toml"
        path.write_text(config)
        router = start_router(["--config", str(path)])
        try:
            yield router.url, alpha, beta
        finally:
            router.stop()
            alpha.stop()
            beta.stop()


def wait_ready(url: str) -> dict:
    deadline = time.monotonic() + 20
    while True:
        status, body = get(url + "/ready")
        if status == 200 or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def test_two_models_through_the_official_openai_client(cluster: Tuple[str, Sim, Sim]) -> None:
    try:
        import openai
    except ImportError:
        need(False, "the openai package is not installed (pip install openai)")
    url, alpha, beta = cluster
    ready = wait_ready(url)
    assert ready["ready"], ready
    assert {m["name"]: m["ready"] for m in ready["models"]} == {"alpha": True, "beta": True}

    client = openai.OpenAI(base_url=url + "/v1", api_key="the-clients-own-key", max_retries=0)
    assert sorted(m.id for m in client.models.list()) == ["alpha", "beta"]

    prompt = "the quick brown fox jumps over the lazy dog " * 12  # > 3 blocks of 32
    for model, worker in (("alpha", "1"), ("beta", "2")):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=8)
        assert raw.headers["x-kvengine-worker-id"] == worker, model
        chat = raw.parse()
        assert chat.model == model
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 8

        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=5,
            stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text, model

        raw_c = client.completions.with_raw_response.create(
            model=model, prompt=prompt, max_tokens=4)
        assert raw_c.headers["x-kvengine-worker-id"] == worker
        done = raw_c.parse()
        assert done.model == model and done.choices[0].text

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"

    # The beta worker requires its key: the router sent it (the answers above), and the
    # client's key alone is refused by the worker itself.
    req = urllib.request.Request(
        beta.url + "/v1/completions",
        data=json.dumps({"model": "beta", "prompt": "x", "max_tokens": 1}).encode(),
        headers={"Content-Type": "application/json",
                 "Authorization": "Bearer the-clients-own-key"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 401

    # Each model's index holds its own worker's blocks at its own block size: a prompt of
    # token ids sent to both models overlaps 32-token blocks on beta's worker, 16-token
    # blocks on alpha's, and neither model sees the other's worker.
    ids = list(range(1000, 1128))
    for model in ("alpha", "beta"):
        client.completions.create(model=model, prompt=ids, max_tokens=2)
    overlaps = {}
    for model in ("alpha", "beta"):
        deadline = time.monotonic() + 10
        while True:
            status, body = post(url + "/v1/overlap", {"model": model, "token_ids": ids})
            if status != 200 or body["scores"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 200, body
        overlaps[model] = body
    assert overlaps["alpha"]["block_size"] == 16 and overlaps["beta"]["block_size"] == 32
    assert [(s["worker_id"], s["overlap_blocks"]) for s in overlaps["alpha"]["scores"]] == [(1, 8)]
    assert [(s["worker_id"], s["overlap_blocks"]) for s in overlaps["beta"]["scores"]] == [(2, 4)]
    status, err = post(url + "/v1/overlap", {"model": "nope", "token_ids": [1, 2, 3]})
    assert status == 404 and err["error"]["code"] == "model_not_found"
