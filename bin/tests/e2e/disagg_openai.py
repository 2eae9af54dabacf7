"""End to end: the official `openai` client -> kvengine -> simulated prefill + decode workers.

    python3 disagg_openai.py KVENGINE_BINARY vllm|sglang|trtllm

Starts two simulated prefill workers (one process each, so one can be killed) and two decode
workers as `kvengine sim` processes, and a router that disaggregates with the given protocol.
Checks, through the openai client: chat and completions, streamed and not, come back whole
with the prefill side's cached_tokens; the prefill worker is the one holding the prompt's
prefix; a prefill worker killed mid-request costs the client nothing (the router retries on
the other prefill worker, then prefills on the decode worker). Exits non-zero on a failure.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import openai

BIN, PROTOCOL = sys.argv[1], sys.argv[2]
MODEL = "kvengine-sim"
PROCS = []


def start(args, ready):
    """Starts a kvengine process and returns (process, stdout lines up to the ready line)."""
    # Each process's log goes to the test's stderr, to read when a check fails.
    p = subprocess.Popen([BIN, *args], stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    PROCS.append(p)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if ready in line:
            break
    else:
        raise RuntimeError(f"{args} exited early: {''.join(lines)}")
    threading.Thread(target=p.stdout.read, daemon=True).start()
    return p, lines


def sim(role, first_id, workers, speedup):
    p, lines = start(
        ["sim", "--workers", str(workers), "--port", "0", "--role", role,
         "--speedup", str(speedup), "--first-worker-id", str(first_id)],
        "Ctrl-C stops",
    )
    found = []
    for line in lines:
        m = re.search(r"worker (\d+): (http://\S+)\s+--zmq-worker \d+=(tcp://[^,]+),replay=(\S+)", line)
        if m:
            found.append({"id": int(m[1]), "url": m[2], "zmq": m[3], "replay": m[4]})
    assert len(found) == workers, lines
    return p, found


def http(method, url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
        return json.loads(text) if text.startswith(("{", "[")) else text


def words(prefix, n):
    return " ".join(f"{prefix}{i}" for i in range(n))


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    # Prefill workers run slowly (half real time) so a long prefill can be interrupted.
    p1, [w1] = sim("prefill", 1, 1, 0.5)
    p2, [w2] = sim("prefill", 2, 1, 0.5)
    _, decoders = sim("decode", 3, 2, 20)
    _, lines = start(
        ["--cores", os.environ.get("KVENGINE_TEST_CORES", "1"), "--no-pin", "--http-host", "127.0.0.1", "--http-port", "0",
         "--disagg-protocol", PROTOCOL, "--disagg-min-prefill-tokens", "32",
         "--health-interval-secs", "0.5", "--health-failures", "3"],
        "Ctrl-C stops",
    )
    base = "http://" + next(l.split("HTTP on http://")[1].split()[0] for l in lines if "HTTP on http://" in l)
    for w, role in [(w1, "prefill"), (w2, "prefill"), (decoders[0], "decode"), (decoders[1], "decode")]:
        port = int(w["url"].rsplit(":", 1)[1])
        http("POST", base + "/v1/workers", {
            "worker_id": w["id"], "url": w["url"], "zmq": w["zmq"], "replay": w["replay"],
            "role": role, "bootstrap_port": port})
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

    # 1. The prefill worker is chosen by KV overlap: warm each prefill worker with its own
    #    prompt directly, then route continuations of each through kvengine.
    prompts = {1: words("alpha", 300), 2: words("beta", 300)}
    for wid, prompt in prompts.items():
        url = (w1 if wid == 1 else w2)["url"]
        http("POST", url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    time.sleep(1.0)  # the workers' KV events reach the router's index
    # Each continuation is new past the prefix (the decode worker that received an earlier
    # one caches it, and would rightly prefill a repeat locally).
    for k, wid in enumerate([2, 1, 2, 1]):
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompts[wid] + " " + words(f"tail{k}_", 40), max_tokens=4)
        check(raw.headers.get("x-kvengine-prefill-worker-id") == str(wid),
              f"prompt cached on prefill worker {wid} went to {dict(raw.headers)}")
        answer = raw.parse()
        check(answer.usage.completion_tokens == 4, answer)
        cached = answer.usage.prompt_tokens_details.cached_tokens
        check(cached >= 288, f"prefill side cached {cached} of the 300-word prefix")
        check(raw.headers.get("x-kvengine-worker-id") in {"3", "4"}, raw.headers)

    # 2. Chat and completions, streamed and not: whole answers through both workers.
    for stream in (False, True):
        for api in ("chat", "completions"):
            system = words(f"system{api}{stream}_", 120)
            kwargs = dict(model=MODEL, max_tokens=6)
            if api == "chat":
                kwargs["messages"] = [{"role": "system", "content": system},
                                      {"role": "user", "content": f"question {api} {stream}"}]
                create = client.chat.completions.with_raw_response.create
            else:
                kwargs["prompt"] = system + f" question {api} {stream}"
                create = client.completions.with_raw_response.create
            if stream:
                kwargs["stream"] = True
                kwargs["stream_options"] = {"include_usage": True}
            raw = create(**kwargs)
            check(raw.headers.get("x-kvengine-prefill-worker-id") in {"1", "2"},
                  f"{api} stream={stream}: not disaggregated: {raw.headers}")
            if stream:
                pieces, usage = [], None
                for chunk in raw.parse():
                    if chunk.usage:
                        usage = chunk.usage
                    for c in chunk.choices:
                        pieces.append(c.delta.content if api == "chat" else c.text)
                check(usage is not None and usage.completion_tokens == 6, f"{api} stream usage {usage}")
                check(len([p for p in pieces if p]) == 6, f"{api} stream pieces {pieces}")
            else:
                answer = raw.parse()
                usage = answer.usage
                check(usage.completion_tokens == 6, answer)
                text = answer.choices[0].message.content if api == "chat" else answer.choices[0].text
                check(len(text.split()) == 6, text)

    # 2b. Conditional disaggregation: a prompt the decode worker already holds but for a few
    #     tokens is prefilled there, not sent to a prefill worker.
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=system + " question completions True again", max_tokens=3)
    check(raw.headers.get("x-kvengine-prefill-worker-id") is None,
          f"a nearly cached prompt went to a prefill worker: {raw.headers}")
    check(raw.parse().usage.completion_tokens == 3, "local prefill answer")

    # 3. A prefill worker dies mid-request (twice: the second time none is left).
    killed = set()
    for stream in (False, True):
        result = {}
        prompt = words(f"long{stream}", 8000)

        def ask():
            try:
                if stream:
                    raw = client.completions.with_raw_response.create(
                        model=MODEL, prompt=prompt, max_tokens=5, stream=True,
                        stream_options={"include_usage": True})
                    texts = [c.choices[0].text for c in raw.parse() if c.choices and c.choices[0].text]
                    result["tokens"] = len(texts)
                else:
                    raw = client.completions.with_raw_response.create(
                        model=MODEL, prompt=prompt, max_tokens=5)
                    result["tokens"] = raw.parse().usage.completion_tokens
                result["prefill"] = raw.headers.get("x-kvengine-prefill-worker-id")
            except Exception as e:  # noqa: BLE001: reported below
                result["error"] = repr(e)

        t = threading.Thread(target=ask)
        t.start()
        victim = None
        deadline = time.time() + 20
        while victim is None and time.time() < deadline:
            for w in http("GET", base + "/v1/workers")["workers"]:
                if w["role"] == "prefill" and w["worker_id"] not in killed and any(
                        l["active_requests"] > 0 for l in w["loads"]):
                    victim = w["worker_id"]
            time.sleep(0.02)
        check(victim is not None, "no prefill worker took the long request")
        (p1 if victim == 1 else p2).kill()
        killed.add(victim)
        t.join(120)
        check("error" not in result, f"stream={stream}: the client saw {result.get('error')}")
        check(result.get("tokens") == 5, f"stream={stream}: {result}")
        check(result.get("prefill") != str(victim), f"stream={stream}: served by the dead worker {result}")
    metrics = http("GET", base + "/metrics")
    fallbacks = int(re.search(r"^kvengine_disagg_fallbacks_total (\d+)", metrics, re.M)[1])
    check(fallbacks >= 2, f"fallbacks {fallbacks}")
    # Every routed request was freed in the load tracker.
    time.sleep(0.3)
    active = sum(l["active_requests"] for w in http("GET", base + "/v1/workers")["workers"] for l in w["loads"])
    check(active == 0, f"{active} requests still active after every answer ended")
    print(f"disagg e2e {PROTOCOL}: ok")


try:
    main()
finally:
    for p in PROCS:
        p.kill()
