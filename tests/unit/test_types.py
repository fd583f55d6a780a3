"""runtime/ and harness/ type-check clean with mypy (its configuration: ``[tool.mypy]`` in
pyproject.toml, which says what is checked and why mypy). CI runs the README's test command,
so this test is how it runs the type checker."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# A cold run (no .mypy_cache yet) reads torch's annotations: about a minute on a busy 2-core
# machine, over the suite's default timeout. Later runs take about a second.
@pytest.mark.timeout(600)
def test_mypy_is_clean() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it is in the dev extra: pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"],  # files and options from pyproject.toml
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=590,
    )
    assert proc.returncode == 0, f"mypy found type errors:\n{proc.stdout}{proc.stderr}"
