"""`--tls-cert` / `--tls-key`: the HTTP edge serves HTTPS (the OpenAI front door, probes and
control calls alike), and plain HTTP on that port gets no answer."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from conftest import need
from server import start_router


def self_signed(d: Path) -> tuple[Path, Path]:
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True)
    return cert, key


def test_the_edge_serves_https_with_the_given_certificate() -> None:
    need(shutil.which("openssl") is not None, "the openssl command is not installed")
    with tempfile.TemporaryDirectory() as d:
        cert, key = self_signed(Path(d))
        router = start_router(["--tls-cert", str(cert), "--tls-key", str(key),
                               "--sim-workers", "1"])
        try:
            assert router.url.startswith("https://127.0.0.1:"), router.url
            trusted = ssl.create_default_context(cafile=str(cert))
            with urllib.request.urlopen(router.url + "/ready", timeout=10,
                                        context=trusted) as r:
                assert r.status == 200
            # The OpenAI front door over TLS.
            body = json.dumps({"model": "kvengine-sim", "prompt": "hello there",
                               "max_tokens": 2}).encode()
            req = urllib.request.Request(router.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=20, context=trusted) as r:
                answer = json.loads(r.read())
            assert answer["choices"][0]["text"]
            # Control calls from this host still pass the admin gate: the peer address
            # reaches it over TLS.
            req = urllib.request.Request(router.url + "/v1/workers",
                                         data=json.dumps({"worker_id": 77}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10, context=trusted) as r:
                assert r.status == 201
            # A client that does not trust the certificate is refused by its own check.
            try:
                urllib.request.urlopen(router.url + "/live", timeout=10,
                                       context=ssl.create_default_context())
                raise AssertionError("an untrusted certificate was accepted")
            except urllib.error.URLError as e:
                assert isinstance(e.reason, ssl.SSLError), e
            # Plain HTTP on the HTTPS port: no HTTP answer.
            port = int(router.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
                try:
                    got = s.recv(100)
                except (ConnectionResetError, socket.timeout):
                    got = b""
                assert not got.startswith(b"HTTP/"), got
        finally:
            router.stop()
