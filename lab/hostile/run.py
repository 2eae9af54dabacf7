#!/usr/bin/env python3
"""Issue 29's hostile-client figures for one kvengine binary, so two binaries can be
compared side by side on the same day (A B A B):

    python3 lab/hostile/run.py BIN [BIN ...] --runs 5

For each run of each binary (interleaved), a fresh router (`--cores 2 --no-pin
--sim-workers 2`) is started on a free port and, in order:

* flood: one client (bound to 127.0.0.2) sends 9,000 `POST /v1/route` and frees none;
  reported: how many were granted, then whether another client (127.0.0.3) still gets a
  route and a chat completion (HTTP status of each);
* slowloris: 400 connections send half a request header; reported: how long `/ready`
  takes meanwhile, and how many of them the router has closed 15 s later;
* giant prompt (first): a 3,000,000-word text prompt to `/v1/completions`; reported: its
  status and the router's peak resident set (VmHWM) after it; then 3,000,000 token ids,
  the same.

Prints one line per run and min / median / max per binary and figure. Linux only (127/8
source addresses, /proc).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start(binary):
    port = free_port()
    env = dict(os.environ, KVENGINE_LOG="error")
    p = subprocess.Popen(
        [binary, "--cores", "2", "--no-pin", "--http-host", "127.0.0.1", "--http-port",
         str(port), "--sim-workers", "2", "--sim-speedup", "100"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    for line in p.stdout:
        if "Ctrl-C stops" in line:
            break
    else:
        raise SystemExit(f"{binary} exited early")
    return p, port


def request(port, method, path, body=None, source="127.0.0.1", sock=None, timeout=60):
    """One HTTP/1.1 request (keep-alive on `sock` if given); (status, body)."""
    own = sock is None
    if own:
        sock = socket.socket()
        sock.bind((source, 0))
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", port))
    data = (body or "").encode()
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    status = int(head[9:12])
    length = None
    chunked = False
    for line in head.decode().split("\r\n")[1:]:
        k, _, v = line.partition(":")
        if k.lower() == "content-length":
            length = int(v)
        if k.lower() == "transfer-encoding" and "chunked" in v.lower():
            chunked = True
    if chunked:
        while not rest.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    else:
        while len(rest) < (length or 0):
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    if own:
        sock.close()
    return status, rest.decode(errors="replace")


def peak_rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def chat():
    return json.dumps({"model": "kvengine-sim", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "what is a kv cache"}]})


def one_run(binary):
    p, port = start(binary)
    out = {}
    try:
        # Giant prompt (first: nothing else has grown the router yet).
        prompt = "ab " * 3_000_000
        status, _ = request(port, "POST", "/v1/completions",
                            json.dumps({"model": "kvengine-sim", "prompt": prompt}), timeout=300)
        out["giant_text_status"] = status
        out["peak_rss_mb_after_giant_text"] = peak_rss_mb(p.pid)
        ids = ",".join(str(i % 9) for i in range(3_000_000))
        status, _ = request(port, "POST", "/v1/completions",
                            f'{{"model": "kvengine-sim", "prompt": [{ids}]}}', timeout=300)
        out["giant_ids_status"] = status
        out["peak_rss_mb_after_giant_ids"] = peak_rss_mb(p.pid)
        # Flood.
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.settimeout(60)
        s.connect(("127.0.0.1", port))
        body = json.dumps({"token_ids": list(range(64))})
        granted = 0
        for _ in range(9000):
            status, _ = request(port, "POST", "/v1/route", body, sock=s)
            granted += status == 200
        s.close()
        out["flood_granted"] = granted
        out["other_route_status"] = request(port, "POST", "/v1/route", body, "127.0.0.3")[0]
        out["other_chat_status"] = request(port, "POST", "/v1/chat/completions", chat(),
                                           "127.0.0.3")[0]
        # Slowloris.
        held = []
        for _ in range(400):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Le")
            held.append(c)
        t = time.monotonic()
        request(port, "GET", "/ready")
        out["ready_ms_during_slowloris"] = (time.monotonic() - t) * 1e3
        time.sleep(15)
        closed = 0
        for c in held:
            c.setblocking(False)
            try:
                closed += c.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
            c.close()
        out["slowloris_closed_after_15s"] = closed
    finally:
        p.terminate()
        p.wait()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    results = {b: [] for b in args.binaries}
    for i in range(args.runs):
        for b in args.binaries:
            r = one_run(b)
            results[b].append(r)
            print(f"run {i + 1} {b}: {json.dumps(r)}", flush=True)
    for b, runs in results.items():
        print(f"\n{b}")
        for k in runs[0]:
            vals = [r[k] for r in runs]
            print(f"  {k}: min {min(vals):.1f} / median {statistics.median(vals):.1f} / "
                  f"max {max(vals):.1f}")


if __name__ == "__main__":
    sys.exit(main())
