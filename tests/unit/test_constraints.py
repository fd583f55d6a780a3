"""CI installs exactly what constraints.txt pins (bin/setup passes it to every pip install), so
that a new release on the registry cannot turn a submission that changed nothing red. What keeps
that true as the project changes: every requirement of the project and of the extras CI installs
is pinned there, exactly, and the file's pins agree with pyproject.toml's own."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
EXTRAS = ("dev", "titan")  # what bin/setup installs


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version and " " not in line, f"constraints.txt: not name==version: {line}"
        assert canonicalize_name(name) not in pins, f"constraints.txt: {name} twice"
        pins[canonicalize_name(name)] = version
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_every_requirement_ci_installs_is_pinned_and_the_pins_satisfy_pyproject() -> None:
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, which pyproject.toml's {req} refuses"
        )


def test_bin_setup_installs_with_the_constraints_every_time() -> None:
    setup = (REPO / "bin" / "setup").read_text()
    installs = [ln for ln in setup.splitlines() if "pip install" in ln]
    assert installs and all("-c constraints.txt" in ln for ln in installs), installs
