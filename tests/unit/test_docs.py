"""The docs: the site builds in strict mode (a broken link or anchor fails), the generated pages
equal what their generators make now, the README stays short and its links resolve, every repo
path the docs name exists, and the benchmarks tool records and renders a bench end to end."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from experiments import docsgen
from experiments import spec as experiment_spec
from experiments.bench import publish
from faults.fault import fault_kinds
from harness import config as job_config
from harness.config import JobConfig, TimeoutConfig

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 250
#: Top-level folders of the repository: a code span starting with one of these names a path.
REPO_DIRS = ("runtime", "harness", "faults", "experiments", "dashboards", "tests", "bin", "docs")


def _prose(text: str) -> str:
    """Markdown without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_site_builds_strict(tmp_path: Path) -> None:
    # mkdocs is in the dev extra, which bin/setup installs: missing, this fails rather than skips
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
         "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=90, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()
    assert (tmp_path / "site" / "BENCHMARKS" / "index.html").exists()


@pytest.mark.parametrize("page", sorted(str(p.relative_to(ROOT)) for p in docsgen.generated()))
def test_generated_page_is_current(page: str) -> None:
    make = {str(p.relative_to(ROOT)): f for p, f in docsgen.generated().items()}[page]
    assert (ROOT / page).read_text(encoding="utf-8") == make(), (
        f"{page} is out of date: run `python -m experiments.docsgen`"
    )


def test_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES
    links = re.findall(r"\]\(([^)\s]+)\)", _prose(text))
    local = [t for t in links if not re.match(r"[a-z]+:|#", t)]
    assert local, "the README links into docs/"
    missing = [t for t in local if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_readme_keeps_the_two_commands_ci_runs() -> None:
    text = README.read_text(encoding="utf-8")
    assert "bin/setup && .venv/bin/ftharness chaos experiments/quickstart.toml" in text
    test_command = "bin/setup && .venv/bin/python -m pytest"
    assert test_command in text
    assert test_command in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_repo_paths_named_in_the_docs_exist() -> None:
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for span in re.findall(r"`([^`\s]+)`", _prose(page.read_text(encoding="utf-8"))):
            path = span.rstrip(".,:;")
            placeholder = any(c in path for c in "*<>{}$")  # a pattern, not a path
            if "/" not in path or path.split("/", 1)[0] not in REPO_DIRS or placeholder:
                continue
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def _job_keys(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        out += _job_keys(tp, f"{prefix}{f.name}.") if dataclasses.is_dataclass(tp) else []
        out += [] if dataclasses.is_dataclass(tp) else [prefix + f.name]
    return out


def test_configuration_reference_covers_every_key() -> None:
    page = docsgen.config_reference()
    keys = [
        *_job_keys(JobConfig),
        *experiment_spec.TOP_KEYS,
        *(f"schedule.{k}" for k in experiment_spec.SCHEDULE_KEYS),
        *(f"targets.{k}" for k in experiment_spec.TARGETS_KEYS),
        *(f"hypotheses.{k}" for k in experiment_spec.BOOL_HYPOTHESES),
        *(f"hypotheses.{k}" for k in experiment_spec.THRESHOLD_HYPOTHESES),
        *(f"faults.options.{k}.hold_s" for k in fault_kinds() if not k.startswith("test_")),
    ]
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing, f"keys missing from the configuration reference: {missing}"
    for module in (job_config, experiment_spec):  # each module's docstring, whole
        assert docsgen.rst_to_md(inspect.getdoc(module) or "").strip() in page


def test_field_docs_come_from_the_source() -> None:
    assert docsgen.field_comments(JobConfig)["launcher"].startswith("Where hosts come from")
    assert "silent this long" in docsgen.field_comments(TimeoutConfig)["host_timeout"]
    md = docsgen.rst_to_md("A ``x <\n y`` and :class:`Z`, then::\n\n    code = 1\n\nafter")
    assert md == "A `x <\n y` and `Z`, then:\n\n```\ncode = 1\n```\n\nafter\n"


def _stand_in(result: object, rc: int = 0, noise: str = "measuring...") -> list[str]:
    """A bench stand-in: prints noise, then ``result`` as its last line, exits ``rc``."""
    script = f"import json, sys; print({noise!r}); print(json.dumps({result!r})); sys.exit({rc})"
    return [sys.executable, "-c", script]


def test_publish_records_and_renders(tmp_path: Path) -> None:
    result = {
        "reps": 3,
        "rows": {"tiny": {"in_place": {"stall_s": {"median": 0.05, "min": 0.04, "max": 0.08},
                                       "weights_match": True}}},
        "sizes": [{"bytes": 1024, "shm": 7.5}, {"bytes": 2048, "shm": 8.0}],
    }  # fmt: skip
    shown: list[str] = []
    path = publish.record(
        "telemetry", ["--quick"], docs=tmp_path, argv=_stand_in(result), out=shown.append
    )
    assert "measuring...\n" in shown
    saved = json.loads(path.read_text())
    assert path == tmp_path / "benchmarks" / "telemetry.json"
    assert saved["command"] == "ftharness bench telemetry --quick"
    assert saved["result"] == result
    assert {"cores", "memory_gib", "cpu", "python", "torch", "gpus"} <= set(saved["machine"])
    assert set(saved["loadavg"]) == {"before", "after"} and saved["date"]
    page = publish.render(tmp_path)
    assert "## telemetry" in page and "`ftharness bench telemetry --quick`" in page
    assert "| `in_place` | 0.05 (0.04\u20130.08) | yes |" in page
    assert "| 1024 | 7.5 |" in page
    assert "What the telemetry sink costs a training step." in page

    # a second saved run of the same bench (--as): its own section, the bench's summary
    again = publish.record(
        "telemetry", ["--only", "x"], docs=tmp_path, argv=_stand_in(result),
        out=lambda _: None, save_as="telemetry_full",
    )  # fmt: skip
    assert again == tmp_path / "benchmarks" / "telemetry_full.json" and path.exists()
    page = publish.render(tmp_path)
    assert "## telemetry_full" in page and "## telemetry\n" in page
    assert "`ftharness bench telemetry --only x`" in page
    assert page.count("What the telemetry sink costs a training step.") == 2
    assert page.count("docstring of `experiments/bench/telemetry.py`") == 2
    with pytest.raises(publish.RecordError, match="letters, digits"):
        publish.record("telemetry", [], docs=tmp_path, argv=_stand_in(result), save_as="../x")


@pytest.mark.parametrize(
    ("argv", "why"),
    [(_stand_in({"a": 1}, rc=1), "exited with 1"), (_stand_in([1, 2]), "not a JSON object")],
)
def test_publish_refuses_a_failed_bench(tmp_path: Path, argv: list[str], why: str) -> None:
    with pytest.raises(publish.RecordError, match=why):
        publish.record("telemetry", [], docs=tmp_path, argv=argv, out=lambda _: None)
    assert not (tmp_path / "benchmarks").exists()


def test_every_module_is_in_the_module_index_with_its_own_description() -> None:
    from experiments import module_index

    page = (ROOT / "docs" / module_index.PAGE).read_text()
    every = sorted(p for pkg in module_index.PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert every
    for p in every:
        rel = p.relative_to(ROOT)
        assert f"| `{rel}` |" in page, f"{rel} is not in {module_index.PAGE}"
        assert module_index.summary(p), f"{rel} has no module docstring"
