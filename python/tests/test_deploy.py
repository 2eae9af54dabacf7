"""The deployment files in deploy/ (Dockerfile, Kubernetes manifests) agree with the binary.

They are parsed (PyYAML), and every setting they name is checked against what `kvengine
--help` accepts, every probe and port against what the router serves: a renamed flag or
endpoint breaks this test instead of a deployment.
"""

import json
import pathlib
import re
import subprocess
import urllib.error
import urllib.request

import pytest

from conftest import need
from server import _binary, start_router

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"


def manifests():
    try:
        import yaml
    except ImportError:
        need(False, "PyYAML is not installed")
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "kvengine.yaml").read_text()))
    return {d["kind"]: d for d in docs if d}


def help_text():
    binary = _binary()
    need(binary is not None and binary.is_file(), "no kvengine binary (cargo build -p kvengine)")
    return subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                          check=True).stdout


def known_env():
    return set(re.findall(r"env: (KVENGINE_[A-Z0-9_]+)", help_text()))


def test_every_setting_the_manifests_and_image_name_is_a_real_one():
    m = manifests()
    assert set(m) == {"ConfigMap", "Deployment", "Service", "ServiceMonitor"}
    known = known_env()
    container = m["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    named = set(m["ConfigMap"]["data"]) | {e["name"] for e in container["env"]}
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("ENV "):
            named |= {kv.split("=")[0] for kv in line[4:].split()}
    assert named, "no settings found"
    assert named <= known, f"unknown settings: {sorted(named - known)}"
    flags = set(re.findall(r"(--[a-z0-9-]+)", help_text()))
    assert set(container["args"]) <= flags, container["args"]


def test_ports_probes_labels_and_user_agree():
    m = manifests()
    pod = m["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    exposed = int(re.search(r"^EXPOSE (\d+)", dockerfile, re.M).group(1))
    assert ports == {"http": exposed}
    assert f"KVENGINE_HTTP_PORT={exposed}" in dockerfile
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    labels = pod["metadata"]["labels"]
    assert m["Deployment"]["spec"]["selector"]["matchLabels"] == labels
    assert m["Service"]["spec"]["selector"] == labels
    assert m["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    assert m["ServiceMonitor"]["spec"]["selector"]["matchLabels"] == m["Service"]["metadata"]["labels"]
    assert m["ServiceMonitor"]["spec"]["endpoints"][0] == {
        "port": "http", "path": "/metrics", "interval": "15s"}
    uid = int(re.search(r"^USER (\d+)", dockerfile, re.M).group(1))
    assert pod["spec"]["securityContext"]["runAsUser"] == uid
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    workers = m["ConfigMap"]["data"]["KVENGINE_ZMQ_WORKERS"].split(";")
    assert all(re.fullmatch(r"\d+=tcp://[^,]+:\d+,replay=tcp://[^,]+:\d+", w) for w in workers)
    assert "KVENGINE_TOKENIZER" in m["ConfigMap"]["data"], "real workers need a tokenizer"


def test_the_probed_endpoints_answer_as_the_manifest_expects():
    r = start_router()
    try:
        with urllib.request.urlopen(r.url + "/live", timeout=5) as resp:
            assert resp.status == 200
        # No worker yet: not ready, and the body says why.
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(r.url + "/ready", timeout=5)
        assert e.value.code == 503
        assert json.loads(e.value.read())["reasons"]
        with urllib.request.urlopen(r.url + "/metrics", timeout=5) as resp:
            assert b"kvengine_frontdoor_ttft_seconds" in resp.read()
    finally:
        r.stop()
