"""The deployment files in deploy/ (Dockerfile, Kubernetes manifests, Helm chart) agree with
the binary.

They are parsed (PyYAML), and every setting they name is checked against what `kvengine
--help` accepts, every probe and port against what the router serves: a renamed flag or
endpoint breaks this test instead of a deployment. The Helm chart is rendered by a small
renderer of the Go-template subset it uses (there is no `helm` binary here), and its config
file is loaded by the router itself.
"""

import base64
import json
import pathlib
import secrets
import string
import re
import subprocess
import tempfile
import urllib.error
import urllib.request

import pytest

from conftest import need
from server import _binary, start_router

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "kvengine"


def _yaml():
    try:
        import yaml
    except ImportError:
        need(False, "PyYAML is not installed")
    return yaml


def manifests():
    docs = list(_yaml().safe_load_all((DEPLOY / "k8s" / "kvengine.yaml").read_text()))
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


# --------------------------------------------------------------------------- the Helm chart
#
# There is no `helm` here: `Chart` renders the Go-template subset deploy/helm/kvengine uses,
# `{{ .Values.a.b }}`, `$`, `.Release.*`, `.Chart.*`, "strings" and numbers, pipelines of
# include / toYaml / nindent / quote / default / or / not / index / randAlphaNum / b64enc,
# `(sub expressions)`, `lookup` (empty, as under `helm template`), `if`/`with` (with `else`)
# / `end`, `define`, `{{/* comments */}}` and `{{-`/`-}}` trimming. Anything else (range, a
# function it does not know, a value values.yaml does not declare) fails the test: keep the
# chart within it.

ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def _tokens(text):
    """("text", s) and ("action", s) in order, with `{{-` / `-}}` trimming applied."""
    out, pos, trim = [], 0, False
    for m in ACTION.finditer(text):
        before = text[pos:m.start()]
        before = before.lstrip() if trim else before
        out += [("text", before.rstrip() if m.group(1) else before), ("action", m.group(2))]
        trim, pos = bool(m.group(3)), m.end()
    out.append(("text", text[pos:].lstrip() if trim else text[pos:]))
    return out


def _parse(tokens, i=0):
    """(nodes, next token, "end"/"else"/None): text is a str, actions are 4-tuples."""
    nodes = []
    while i < len(tokens):
        kind, s = tokens[i]
        i += 1
        word, _, rest = s.partition(" ")
        if kind == "text":
            nodes.append(s)
        elif s.startswith("/*"):
            continue
        elif word in ("end", "else"):
            return nodes, i, word
        elif word in ("if", "with", "define"):
            body, i, stop = _parse(tokens, i)
            other = []
            if stop == "else":
                other, i, stop = _parse(tokens, i)
            assert stop == "end", f"{{{{ {s} }}}} has no end"
            nodes.append((word, rest, body, other))
        else:
            nodes.append(("print", s, [], []))
    return nodes, i, None


def _text(v):
    """A value as a template prints it."""
    if isinstance(v, bool):
        return str(v).lower()
    assert isinstance(v, (str, int, float)), f"the template prints {v!r}"
    return str(v)


def _merge(base, over):
    out = dict(base)
    for k, v in over.items():
        both = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = _merge(out[k], v) if both else v
    return out


FUNCS = {
    "include": lambda chart, name, ctx: chart.run(chart.defines[name], ctx),
    "toYaml": lambda chart, v: _yaml().safe_dump(v, default_flow_style=False).rstrip("\n"),
    "nindent": lambda chart, n, s: "\n" + "\n".join(" " * n + line for line in s.split("\n")),
    "quote": lambda chart, v: json.dumps(_text(v)),
    "default": lambda chart, fallback, v=None: v if v else fallback,
    "or": lambda chart, *a: next((x for x in a if x), a[-1]),
    "not": lambda chart, v: not v,
    "index": lambda chart, m, k: m[k],
    # `helm template` and a first install see no Secret in the cluster.
    "lookup": lambda chart, *a: {},
    "randAlphaNum": lambda chart, n: "".join(
        secrets.choice(string.ascii_letters + string.digits) for _ in range(n)),
    "b64enc": lambda chart, v: base64.b64encode(v.encode()).decode(),
}


def _split(expr, sep):
    """`expr` split at `sep` (a space: any whitespace) outside quotes and parentheses."""
    out, cur, depth, quoted = [], "", 0, False
    for ch in expr:
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch == "(":
            depth += 1
        elif not quoted and ch == ")":
            depth -= 1
        at_sep = ch.isspace() if sep == " " else ch == sep
        if at_sep and depth == 0 and not quoted:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [w.strip() for w in out if w.strip()]


class Chart:
    """deploy/helm/kvengine with values.yaml merged with `overrides`, as `helm template`."""

    def __init__(self, overrides=None):
        yaml = _yaml()
        meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
        values = _merge(yaml.safe_load((CHART / "values.yaml").read_text()), overrides or {})
        self.root = {
            "Values": values,
            "Chart": {k[0].upper() + k[1:]: v for k, v in meta.items()},
            "Release": {"Name": "kvengine", "Namespace": "default", "Service": "Helm"},
        }
        self.defines = {}
        self.render("_helpers.tpl")  # collects its named templates

    def render(self, name):
        nodes, _, stop = _parse(_tokens((CHART / "templates" / name).read_text()))
        assert stop is None, f"{name}: an unmatched {{{{ {stop} }}}}"
        return self.run(nodes, self.root)

    def run(self, nodes, dot):
        out = []
        for node in nodes:
            if isinstance(node, str):
                out.append(node)
                continue
            word, expr, body, other = node
            if word == "define":
                self.defines[json.loads(expr)] = body
            elif word == "print":
                out.append(_text(self.pipe(expr, dot)))
            else:
                v = self.pipe(expr, dot)
                out.append(self.run(body, v if word == "with" else dot) if v
                           else self.run(other, dot))
        return "".join(out)

    def pipe(self, expr, dot):
        value, piped = None, False
        for stage in _split(expr, "|"):
            words = _split(stage, " ")
            args = [self.arg(w, dot) for w in words[1:]] + ([value] if piped else [])
            if words[0] in FUNCS:
                value = FUNCS[words[0]](self, *args)
            else:
                assert not args, f"{words[0]!r} in {expr!r} is not a function the test knows"
                value = self.arg(words[0], dot)
            piped = True
        return value

    def arg(self, word, dot):
        if word.startswith("("):
            return self.pipe(word[1:-1], dot)
        if word.startswith('"'):
            return json.loads(word)
        if word.isdigit():
            return int(word)
        assert word[0] in ".$", f"the test's renderer does not know {word!r}"
        value = self.root if word[0] == "$" else dot
        for key in filter(None, word.lstrip("$").split(".")):
            assert isinstance(value, dict) and key in value, f"{word}: no {key!r}"
            value = value[key]
        return value


def render_chart(overrides=None):
    """({kind: object} of the rendered templates, the rendered NOTES.txt)."""
    chart = Chart(overrides)
    objects = {}
    for path in sorted((CHART / "templates").glob("*.yaml")):
        for doc in _yaml().safe_load_all(chart.render(path.name)):
            if doc:
                assert doc["kind"] not in objects, f"two {doc['kind']}s"
                objects[doc["kind"]] = doc
    return objects, chart.render("NOTES.txt")


ENABLED = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "adminToken": {"existingSecret": "kvengine-admin"},
    "image": {"repository": "registry.example/kvengine", "tag": "v9"},
    "env": [{"name": "KVENGINE_LOG", "value": "info,transport=debug"}],
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
}


def flag_envs():
    """Each long flag of `kvengine --help` -> its KVENGINE_* variable (None without one)."""
    out, flag = {}, None
    for line in help_text().splitlines():
        m = re.match(r"\s{1,8}(?:-\w, )?--([a-z0-9-]+)", line)
        if m:
            flag = m.group(1)
            out[flag] = None
        m = re.search(r"\[env: (KVENGINE_[A-Z0-9_]+)", line)
        if m and flag:
            out[flag] = m.group(1)
    return out


def chart_config(objects):
    """The ConfigMap's kvengine.toml, parsed."""
    try:
        import tomllib
    except ImportError:
        need(False, "tomllib needs Python >= 3.11")
    return tomllib.loads(objects["ConfigMap"]["data"]["kvengine.toml"])


def container_of(objects):
    return objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def chart_settings(objects):
    """KVENGINE_* variable -> value, for everything the rendered chart sets: the config
    file's settings, the container's flags and environment, and the image's ENV."""
    envs = flag_envs()
    out = {}
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("ENV "):
            out.update(kv.split("=", 1) for kv in line[4:].split())
    for key, v in chart_config(objects).items():
        if key not in ("workers", "models"):
            out[envs[key.replace("_", "-")]] = (
                ";".join(map(str, v)) if isinstance(v, list) else _text(v))
    container = container_of(objects)
    args = container["args"]
    for i, a in enumerate(args):
        if a.startswith("--"):
            flag, eq, v = a[2:].partition("=")
            nxt = args[i + 1] if i + 1 < len(args) else "--"
            out[envs[flag]] = v if eq else ("true" if nxt.startswith("--") else nxt)
    out.update((e["name"], e.get("value")) for e in container["env"])
    return out


def test_the_chart_is_versioned_with_the_workspace():
    meta = _yaml().safe_load((CHART / "Chart.yaml").read_text())
    cargo = (REPO / "Cargo.toml").read_text()
    workspace = re.search(r'^\[workspace\.package\]\n(?:[^\[].*\n)*?version = "([^"]+)"',
                          cargo, re.M).group(1)
    assert (meta["apiVersion"], meta["name"], meta["version"]) == ("v2", "kvengine", "0.1.0")
    assert meta["appVersion"] == workspace


@pytest.mark.parametrize("overrides", [None, ENABLED], ids=["defaults", "enabled"])
def test_the_chart_renders_a_deployment_the_binary_accepts(overrides):
    objects, notes = render_chart(overrides)
    expected = {"ConfigMap", "Deployment", "Service"} | (
        {"ServiceMonitor"} if overrides else {"Secret"})
    assert set(objects) == expected
    deployment, service, config_map = (objects[k]
                                       for k in ("Deployment", "Service", "ConfigMap"))
    pod = deployment["spec"]["template"]
    container = container_of(objects)
    dockerfile = (DEPLOY / "Dockerfile").read_text()

    # The image: the chart's appVersion unless a tag is given.
    meta = _yaml().safe_load((CHART / "Chart.yaml").read_text())
    tag = (overrides or {}).get("image", {}).get("tag") or meta["appVersion"]
    assert container["image"].rsplit(":", 1)[1] == tag

    # Non-root, as the image's user.
    uid = int(re.search(r"^USER (\d+)", dockerfile, re.M).group(1))
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == uid
    assert container["securityContext"]["allowPrivilegeEscalation"] is False

    # Every flag and variable is the binary's; the config file is the ConfigMap's.
    envs = flag_envs()
    flags = [a[2:].split("=")[0] for a in container["args"] if a.startswith("--")]
    assert set(flags) <= set(envs), f"unknown flags: {sorted(set(flags) - set(envs))}"
    # The flags' variables, and those the help names (`KVENGINE_LOG`, the level filter).
    known = known_env() | set(re.findall(r"`(KVENGINE_[A-Z0-9_]+)`", help_text()))
    named = {e["name"] for e in container["env"] if e["name"].startswith("KVENGINE_")}
    assert named <= known, f"unknown settings: {sorted(named - known)}"
    config_path = container["args"][container["args"].index("--config") + 1]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert config_path == mount["mountPath"] + "/kvengine.toml"
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert "kvengine.toml" in config_map["data"]

    # Probes on the port the router serves, which the Service exposes.
    port = int(container["args"][container["args"].index("--http-port") + 1])
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert service["spec"]["ports"] == [{"name": "http", "port": port, "targetPort": "http"}]

    # Selectors select the pods.
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert service["spec"]["selector"] == labels
    assert labels.items() <= service["metadata"]["labels"].items()

    secret = [e for e in container["env"] if e["name"] == "KVENGINE_ADMIN_TOKEN"]
    if overrides:
        assert secret == [{"name": "KVENGINE_ADMIN_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": "kvengine-admin", "key": "token"}}}]
        monitor = objects["ServiceMonitor"]
        selected = monitor["spec"]["selector"]["matchLabels"].items()
        assert selected <= service["metadata"]["labels"].items()
        assert monitor["spec"]["endpoints"] == [
            {"port": "http", "path": "/metrics", "interval": "15s"}]
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        assert pod["spec"]["nodeSelector"] == ENABLED["nodeSelector"]
        assert pod["spec"]["tolerations"] == ENABLED["tolerations"]
        assert "kvengine-admin" in notes
    else:
        # By default the chart generates the admin token and the router reads it.
        generated = objects["Secret"]
        assert secret == [{"name": "KVENGINE_ADMIN_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": generated["metadata"]["name"], "key": "token"}}}]
        token = base64.b64decode(generated["data"]["token"]).decode()
        assert len(token) >= 32 and token.isalnum(), token
        assert generated["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert generated["metadata"]["name"] in notes


def test_the_chart_warns_when_the_admin_token_is_turned_off():
    objects, notes = render_chart({"adminToken": {"generate": False}})
    assert "Secret" not in objects
    assert not [e for e in container_of(objects)["env"] if e["name"] == "KVENGINE_ADMIN_TOKEN"]
    assert "WARNING: no admin token" in notes
    objects, _ = render_chart({"routingToken": {"existingSecret": "kvengine-routing"}})
    assert {"name": "KVENGINE_ROUTING_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "kvengine-routing", "key": "token"}}} in container_of(objects)["env"]


def test_the_charts_config_file_names_real_settings_and_matches_the_manifests():
    objects, _ = render_chart()
    config = chart_config(objects)
    flags = set(flag_envs())
    keys = {k.replace("_", "-") for k in config if k not in ("workers", "models")}
    assert keys <= flags, f"unknown settings: {sorted(keys - flags)}"
    worker_keys = {"id", "url", "zmq", "replay", "kv_events_config", "dp_ranks", "role",
                   "api_key", "model", "topic"}
    assert config["workers"] and all(set(w) <= worker_keys for w in config["workers"])
    # Models are commented out until every deployed binary reads them.
    assert "models" not in config
    assert "# [[models]]" in objects["ConfigMap"]["data"]["kvengine.toml"]

    # The plain manifests' settings, as the chart sets them (workers checked below).
    settings = chart_settings(objects)
    manifest = {k: v for k, v in manifests()["ConfigMap"]["data"].items()
                if k != "KVENGINE_ZMQ_WORKERS"}
    assert {k: settings.get(k) for k in manifest} == manifest
    assert settings.get("KVENGINE_NO_PIN") == "true"


def test_the_router_starts_from_the_charts_config_with_the_manifests_workers():
    objects, _ = render_chart()
    chart_config(objects)  # skips without tomllib, like the other config checks
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "kvengine.toml"
        path.write_text(objects["ConfigMap"]["data"]["kvengine.toml"])
        # The tokenizer is the model volume's; a flag beats the file.
        r = start_router(["--config", str(path), "--tokenizer", "stand-in"])
        try:
            with urllib.request.urlopen(r.url + "/live", timeout=5) as resp:
                assert resp.status == 200
            with urllib.request.urlopen(r.url + "/v1/workers", timeout=5) as resp:
                workers = json.loads(resp.read())["workers"]
        finally:
            r.stop()
    got = {f"{w['worker_id']}={w['zmq']},replay={w['replay']}" for w in workers}
    assert got == set(manifests()["ConfigMap"]["data"]["KVENGINE_ZMQ_WORKERS"].split(";"))


def test_the_docs_helm_example_renders_with_known_settings():
    docs = (REPO / "docs" / "deploy.md").read_text()
    helm = docs[docs.index("\n## Helm\n"):]
    example = _yaml().safe_load(re.search(r"```yaml\n(.*?)```", helm, re.S).group(1))
    objects, _ = render_chart(example)
    assert set(objects) == {"ConfigMap", "Deployment", "Service", "ServiceMonitor"}
    config = chart_config(objects)
    keys = {k.replace("_", "-") for k in config if k not in ("workers", "models")}
    assert keys <= set(flag_envs()), keys
    assert [w["id"] for w in config["workers"]] == [1, 2]
    args = container_of(objects)["args"]
    assert args[args.index("--cores") + 1] == "4"
