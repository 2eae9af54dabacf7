"""Shared pytest fixtures for the kvengine Python package's tests.

The recorded data under ../shared/data (hash vectors, vLLM/SGLang msgpack fixtures) lives
outside the product: tests that need it skip with the reason where it is absent, unless
KVENGINE_PY_REQUIRED=1 (CI), where a skip is a failure.
"""

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
REQUIRED = os.environ.get("KVENGINE_PY_REQUIRED") == "1"


def need(condition: bool, reason: str) -> None:
    """Skips the test with `reason` unless `condition`; fails instead in CI."""
    if condition:
        return
    if REQUIRED:
        pytest.fail(f"{reason} (KVENGINE_PY_REQUIRED=1)")
    pytest.skip(reason)


@pytest.fixture
def kv_events_dir() -> pathlib.Path:
    """../shared/data/kv_events: hash vectors and msgpack fixtures."""
    d = SHARED_DATA / "kv_events"
    need((d / "fixtures.json").is_file(), f"{d} is absent")
    return d
