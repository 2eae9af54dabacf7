"""The examples in python/examples run as documented and finish with their own checks."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"custom_router.py", "indexer_quickstart.py"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example):
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{example.name} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{example.name} printed nothing"
