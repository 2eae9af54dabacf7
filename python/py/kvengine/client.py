"""A client for a running kvengine router's HTTP API (docs/api.md), standard library only.

```python
from kvengine.client import Client, ApiError

c = Client("http://127.0.0.1:8000")
c.add_worker(1, url="http://10.0.0.5:8000")
d = c.route(prompt_token_ids, request_id="req-1")   # {"worker_id": 1, "dp_rank": 0, ...}
... send the request to worker d["worker_id"] ...
c.prefilled("req-1")                                 # first token streamed
c.free("req-1")                                      # finished or cancelled
```

Every JSON endpoint returns the server's JSON answer parsed (a `dict`); `metrics()` returns
the Prometheus text. A non-2xx answer raises `ApiError` with the server's error `code` and
`message`; a server that cannot be reached raises `ConnectionError`, one that does not
answer within `timeout` seconds `TimeoutError`. Each call opens its own connection, so a
`Client` may be shared between threads.
"""

from __future__ import annotations

import json
import operator
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["Client", "ApiError"]

JsonDict = Dict[str, Any]

_USER_AGENT = "kvengine-python-client"


class ApiError(Exception):
    """A non-2xx answer from the router.

    Attributes:
        status: the HTTP status (e.g. 404).
        message: the server's `error.message` (or the raw body / reason when the answer is
            not a kvengine JSON error).
        body: the answer's body, parsed from JSON when it is JSON, else as text.
    """

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(status, message, body)
        self.status: int = status
        self.message: str = message
        self.body: Any = body

    @property
    def code(self) -> Optional[str]:
        """The server's stable snake_case `error.code` (e.g. `unknown_request`), if any."""
        err = self.body.get("error") if isinstance(self.body, dict) else None
        code = err.get("code") if isinstance(err, dict) else None
        return code if isinstance(code, str) else None

    @property
    def rejected_reasons(self) -> List[JsonDict]:
        """Per-event refusals of a `nothing_applied` answer of `POST /v1/events` (else [])."""
        err = self.body.get("error") if isinstance(self.body, dict) else None
        reasons = err.get("rejected_reasons") if isinstance(err, dict) else None
        return list(reasons) if isinstance(reasons, list) else []

    def __str__(self) -> str:
        code = self.code
        return f"HTTP {self.status}{' ' + code if code else ''}: {self.message}"

    def __repr__(self) -> str:
        return f"ApiError(status={self.status!r}, message={self.message!r}, code={self.code!r})"


def _token_list(token_ids: Iterable[Any]) -> List[int]:
    """`token_ids` as a list of Python ints (numpy integers are fine); TypeError otherwise.

    Range checks (0 <= id < 2**32) are the server's: it answers 400 `malformed_json`.
    """
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise TypeError(f"token_ids must be a sequence of ints, not {type(token_ids).__name__}")
    try:
        items = list(token_ids)
    except TypeError:
        raise TypeError(
            f"token_ids must be a sequence of ints, not {type(token_ids).__name__}"
        ) from None
    out: List[int] = []
    for i, t in enumerate(items):
        if isinstance(t, bool):
            raise TypeError(f"token_ids[{i}] must be an int, not bool")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise TypeError(
                f"token_ids[{i}] must be an int, not {type(t).__name__} ({t!r})"
            ) from None
    return out


def _int(name: str, value: Any) -> int:
    """`value` as an int (numpy integers are fine); TypeError naming `name` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})") from None


def _put(body: JsonDict, key: str, value: Any) -> None:
    """Sets an optional field only when given (absent and null mean the same to the server)."""
    if value is not None:
        body[key] = value


class Client:
    """A client for one kvengine router's HTTP API (see docs/api.md)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        timeout: float = 10.0,
        api_key: Optional[str] = None,
    ) -> None:
        """A client of the router at `base_url`; `timeout` (seconds) bounds every call;
        `api_key`, when set, is sent as `Authorization: Bearer <api_key>` (the router's
        `--admin-token`, needed for control calls from other hosts)."""
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"base_url must be an http:// or https:// URL, not {base_url!r}")
        if parsed.query or parsed.fragment:
            raise ValueError(f"base_url must have no query or fragment: {base_url!r}")
        self.base_url: str = base_url.rstrip("/")
        self.timeout: float = float(timeout)
        self.api_key: Optional[str] = api_key

    def __repr__(self) -> str:
        return f"Client({self.base_url!r}, timeout={self.timeout!r})"

    # ------------------------------------------------------------------ transport

    def _request(self, method: str, path: str, body: Optional[JsonDict] = None) -> bytes:
        """Sends one request; returns the body of a 2xx answer, raises otherwise."""
        url = self.base_url + path
        headers = {"Accept": "application/json", "User-Agent": _USER_AGENT}
        data: Optional[bytes] = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")
            headers["Content-Type"] = "application/json"
        elif method == "POST":
            data = b""
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw: bytes = resp.read()
                return raw
        except urllib.error.HTTPError as e:
            raise self._api_error(e) from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise TimeoutError(
                    f"{method} {url}: no answer within {self.timeout} s"
                ) from None
            raise ConnectionError(f"{method} {url}: cannot reach the router: {reason}") from e
        except (socket.timeout, TimeoutError):
            raise TimeoutError(f"{method} {url}: no answer within {self.timeout} s") from None
        except (ConnectionError, OSError) as e:
            # A connection reset or closed mid-answer (http.client raises these bare).
            raise ConnectionError(f"{method} {url}: connection failed: {e}") from e

    @staticmethod
    def _api_error(e: urllib.error.HTTPError) -> ApiError:
        """An ApiError from an HTTP error answer, with the server's message when it has one."""
        try:
            raw = e.read()
        except Exception:  # noqa: BLE001 - the status alone still makes a useful error
            raw = b""
        finally:
            e.close()
        text = raw.decode("utf-8", errors="replace")
        body: Any = text
        message = text.strip() or str(e.reason or f"HTTP {e.code}")
        try:
            body = json.loads(text)
        except ValueError:
            pass
        else:
            err = body.get("error") if isinstance(body, dict) else None
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                message = err["message"]
        return ApiError(int(e.code), message, body)

    def _json(self, method: str, path: str, body: Optional[JsonDict] = None) -> JsonDict:
        raw = self._request(method, path, body)
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            url = self.base_url + path
            raise ApiError(
                200, f"{method} {url}: the answer is not JSON: {raw[:200]!r}", raw
            ) from None

    # ------------------------------------------------------------------ endpoints

    def health(self) -> JsonDict:
        """Router liveness and registered worker count (`GET /healthz`), e.g.
        `{"status": "ok", "workers": 2}`."""
        return self._json("GET", "/healthz")

    def overlap(
        self,
        token_ids: Sequence[int],
        lora_name: Optional[str] = None,
        model: Optional[str] = None,
    ) -> JsonDict:
        """Cached leading blocks of a prompt per worker rank, changing nothing
        (`POST /v1/overlap`): `{"block_size", "blocks", "scores": [{"worker_id", "dp_rank",
        "overlap_blocks"}]}`, best first, ranks with no overlap left out. `model` scores
        that served model's workers only, at its block size."""
        body: JsonDict = {"token_ids": _token_list(token_ids)}
        _put(body, "lora_name", lora_name)
        _put(body, "model", model)
        return self._json("POST", "/v1/overlap", body)

    def route(
        self,
        token_ids: Sequence[int],
        request_id: Optional[str] = None,
        lora_name: Optional[str] = None,
        mode: Optional[str] = None,
        worker_id: Optional[int] = None,
        overlap_weight: Optional[float] = None,
        temperature: Optional[float] = None,
        pool: Optional[str] = None,
        model: Optional[str] = None,
    ) -> JsonDict:
        """Choose a worker rank for a prompt and record the request as active on it
        (`POST /v1/route`).

        `mode` is `kv`, `round-robin`, `random` or `direct` (a `worker_id` alone implies
        `direct`); `pool` is `whole`, `prefill` or `decode`; `overlap_weight` and
        `temperature` override the router's for this call; `model` chooses among that
        served model's workers (404 `model_not_found` if none serves it). Without
        `request_id` the router makes one up (returned as `request_id`). Returns the decision: `request_id`,
        `worker_id`, `dp_rank`, `mode`, `pool`, `blocks`, `overlap_blocks`,
        `best_available_overlap_blocks`, `busy_skipped`, `candidates`. Free the request with
        `free()` when it ends.
        """
        body: JsonDict = {"token_ids": _token_list(token_ids)}
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, not {type(request_id).__name__}")
        _put(body, "request_id", request_id)
        _put(body, "lora_name", lora_name)
        _put(body, "mode", mode)
        _put(body, "worker_id", None if worker_id is None else _int("worker_id", worker_id))
        _put(body, "overlap_weight", None if overlap_weight is None else float(overlap_weight))
        _put(body, "temperature", None if temperature is None else float(temperature))
        _put(body, "pool", pool)
        _put(body, "model", model)
        return self._json("POST", "/v1/route", body)

    def prefilled(self, request_id: str) -> JsonDict:
        """Mark a routed request prefilled, its first token streamed
        (`POST /v1/requests/{id}/prefilled`); 404 `unknown_request` if it is not active."""
        return self._json("POST", f"/v1/requests/{_quote_id(request_id)}/prefilled")

    def free(self, request_id: str) -> JsonDict:
        """Free a routed request, finished or cancelled (`DELETE /v1/requests/{id}`);
        404 `unknown_request` if it is not active."""
        return self._json("DELETE", f"/v1/requests/{_quote_id(request_id)}")

    def apply_events(
        self,
        worker_id: int,
        events: Sequence[Dict[str, Any]],
        dp_rank: Optional[int] = None,
        seq: Optional[int] = None,
    ) -> JsonDict:
        """Apply a batch of KV events of one worker rank, synchronously (`POST /v1/events`).

        Each event is a dict as in docs/api.md: `{"type": "stored", "parent_hash": h | None,
        "blocks": [{"block_hash": h, "token_ids": [...block_size ids]}], "lora_name": ...}`,
        `{"type": "removed", "block_hashes": [...]}` or `{"type": "cleared"}`. `seq` fences
        the batch per rank. Returns `{"applied", "rejected", ...}` (with `rejected_reasons`,
        `skipped`, `fence` when relevant); a batch of which nothing applied raises ApiError
        400 `nothing_applied` (see `ApiError.rejected_reasons`).
        """
        if isinstance(events, Mapping):
            raise TypeError("events must be a list of event dicts, not one dict")
        body: JsonDict = {"worker_id": _int("worker_id", worker_id), "events": list(events)}
        _put(body, "dp_rank", None if dp_rank is None else _int("dp_rank", dp_rank))
        _put(body, "seq", None if seq is None else _int("seq", seq))
        return self._json("POST", "/v1/events", body)

    def workers(self) -> JsonDict:
        """The registered workers with their ranks, addresses, health and loads
        (`GET /v1/workers`): `{"workers": [{"worker_id", "dp_ranks", "url", ...}]}`."""
        return self._json("GET", "/v1/workers")

    def add_worker(
        self,
        worker_id: int,
        url: Optional[str] = None,
        zmq: Optional[str] = None,
        replay: Optional[str] = None,
        dp_ranks: Optional[Sequence[int]] = None,
        role: Optional[str] = None,
        bootstrap_port: Optional[int] = None,
        api_key: Optional[str] = None,
        model: Optional[str] = None,
    ) -> JsonDict:
        """Register a worker, or add ranks and addresses to a registered one
        (`POST /v1/workers`); returns the worker object as `workers()` lists it.

        `url` is its HTTP base URL (health-checked at `{url}/health`), `zmq` / `replay` its
        KV-event publisher and replay endpoints, `dp_ranks` its data-parallel ranks (default
        `[0]`), `role` `aggregated`, `prefill` or `decode`, `bootstrap_port` an SGLang
        prefill worker's bootstrap port, `api_key` the worker's own API key (sent to it on
        forwarded OpenAI requests; never shown back), `model` the model it serves (its
        requests route among that model's workers). Fields left out keep their stored
        values.
        """
        body: JsonDict = {"worker_id": _int("worker_id", worker_id)}
        _put(body, "url", url)
        _put(body, "zmq", zmq)
        _put(body, "replay", replay)
        if dp_ranks is not None:
            if isinstance(dp_ranks, (str, bytes)) or not isinstance(dp_ranks, Iterable):
                raise TypeError("dp_ranks must be a sequence of ints")
            body["dp_ranks"] = [_int(f"dp_ranks[{i}]", r) for i, r in enumerate(dp_ranks)]
        _put(body, "role", role)
        _put(body, "api_key", api_key)
        _put(body, "model", model)
        _put(
            body,
            "bootstrap_port",
            None if bootstrap_port is None else _int("bootstrap_port", bootstrap_port),
        )
        return self._json("POST", "/v1/workers", body)

    def remove_worker(self, worker_id: int) -> JsonDict:
        """Drop a worker with all its ranks, blocks and active requests
        (`DELETE /v1/workers/{id}`): `{"removed": True}`; 404 `unknown_worker` if unknown."""
        return self._json("DELETE", f"/v1/workers/{_int('worker_id', worker_id)}")

    def report_load(
        self,
        worker_id: int,
        num_requests_waiting: int,
        kv_usage: float,
        dp_rank: Optional[int] = None,
    ) -> JsonDict:
        """Report a worker rank's own load, for the busy thresholds (`POST /v1/load`):
        its queued requests and KV usage (0..1)."""
        body: JsonDict = {
            "worker_id": _int("worker_id", worker_id),
            "num_requests_waiting": _int("num_requests_waiting", num_requests_waiting),
            "kv_usage": float(kv_usage),
        }
        _put(body, "dp_rank", None if dp_rank is None else _int("dp_rank", dp_rank))
        return self._json("POST", "/v1/load", body)

    def metrics(self) -> str:
        """The router's Prometheus / OpenMetrics text (`GET /metrics`)."""
        return self._request("GET", "/metrics").decode("utf-8", errors="replace")


def _quote_id(request_id: Any) -> str:
    """A request id percent-encoded as one path segment (`/`, `?`, `#`, `%` included)."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, not {type(request_id).__name__}")
    if not request_id:
        raise ValueError("request_id must not be empty")
    return urllib.parse.quote(request_id, safe="")
