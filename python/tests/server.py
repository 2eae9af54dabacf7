"""A `kvengine` router process for the Python tests (test_client.py, test_zmq.py).

The binary is `$KVENGINE_BIN`, else `target/debug/kvengine`, else `target/release/kvengine`
(build it with `cargo build -p kvengine`). `start_router` skips the test without one, unless
`KVENGINE_PY_REQUIRED=1`, which makes that a failure.
"""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import List, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16  # the router's --kv-cache-block-size
STARTUP_TIMEOUT = 30.0

# --------------------------------------------------------------------------- the router


def _binary() -> Optional[Path]:
    env = os.environ.get("KVENGINE_BIN")
    if env:
        return Path(env)
    for profile in ("debug", "release"):
        p = REPO / "target" / profile / "kvengine"
        if p.is_file():
            return p
    return None


class Router:
    """A `kvengine` router process and its base URL."""

    def __init__(self, binary: Path, extra: Sequence[str] = ()) -> None:
        # Flags win over KVENGINE_* variables, but a stray one (e.g. KVENGINE_SIM_WORKERS)
        # could still add workers or change defaults: start from a clean slate.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVENGINE_")}
        env["KVENGINE_LOG"] = "warn"
        self.args = [
            str(binary),
            "--http-host", "127.0.0.1",
            "--http-port", "0",
            "--cores", "1",
            "--no-pin",
            "--kv-cache-block-size", str(BLOCK),
            *extra,
        ]
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
        )
        self.lines: List[str] = []
        self._url: Optional[str] = None
        self._have_url = threading.Event()
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        self.url = self._wait_ready()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.lines.append(line)
            m = re.search(r"HTTP on (https?://[^\s]+)", line)
            if m and self._url is None:
                self._url = m.group(1)
                self._have_url.set()
        self._have_url.set()  # the process ended

    def output(self) -> str:
        self.stderr.seek(0)
        err = self.stderr.read().decode("utf-8", errors="replace")
        return "stdout:\n" + "\n".join(self.lines) + "\nstderr:\n" + err[-4000:]

    def _fail(self, why: str) -> None:
        self.stop()
        pytest.fail(f"kvengine router ({' '.join(self.args)}) {why}\n{self.output()}")

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        self._have_url.wait(STARTUP_TIMEOUT)
        if self._url is None:
            code = self.proc.poll()
            exited = "" if code is None else f" and exited with {code}"
            self._fail(f"printed no 'HTTP on http://...' line{exited}")
        url = self._url
        assert url is not None
        while True:
            if self.proc.poll() is not None:
                self._fail(f"exited with {self.proc.returncode}")
            try:
                # An HTTPS router (--tls-cert) is up before its certificate is checked.
                ctx = ssl._create_unverified_context() if url.startswith("https") else None
                with urllib.request.urlopen(url + "/healthz", timeout=2, context=ctx) as r:
                    if r.status == 200:
                        return url
            except OSError:
                pass
            if time.monotonic() > deadline:
                self._fail(f"did not answer {url}/healthz within {STARTUP_TIMEOUT} s")
            time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.proc)
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()



def stop_process(proc: "subprocess.Popen[bytes]") -> None:
    """SIGTERM, then SIGKILL after 10 s; waits for the process to end."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start_router(extra: Sequence[str] = ()) -> Router:
    """Starts a router with `extra` flags, or skips (fails in CI) without a binary."""
    binary = _binary()
    if binary is None or not binary.is_file():
        why = (
            f"no kvengine binary (KVENGINE_BIN={os.environ.get('KVENGINE_BIN', '')!r}, "
            f"{REPO / 'target/debug/kvengine'}, {REPO / 'target/release/kvengine'}): "
            "build it with `cargo build -p kvengine`"
        )
        if os.environ.get("KVENGINE_PY_REQUIRED") == "1":
            pytest.fail(why + " (KVENGINE_PY_REQUIRED=1)")
        print(f"skipping: {why}")
        pytest.skip(why)
    return Router(binary, extra)
