"""Experiment files are validated before launch; a malformed one is rejected with a message that
names the file, the key and what is allowed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from experiments.spec import ExperimentError, load_experiment

ROOT = Path(__file__).resolve().parents[2]

GOOD = """\
name = "t"
seed = 3
duration_s = 60
policies = ["in_place", "full_restart"]

[job]
replicas = 3
ranks = 1
hosts = 2

[schedule]
kind = "interval"
interval_s = 10
start_s = 5

[faults]
mix = { kill = 2, segfault = 1, host_eviction = 1 }

[targets]
keep_alive = { replicas = [0] }

[hypotheses]
loss_finite = true
goodput_min = { in_place = 0.5 }
recovery_p95_max_s = 10
"""


def write(tmp_path: Path, text: str, name: str = "exp.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


@pytest.mark.parametrize("name", ["quickstart.toml", "monarch_case_study.toml"])
def test_shipped_experiments_load(name):
    spec = load_experiment(ROOT / "experiments" / name)
    # both policies, measured against a fault-free control run (its goodput's yardstick)
    assert [p for p in spec.policies if p != "control"] == ["in_place", "full_restart"]
    assert spec.policies[0] == "control" and spec.control_runs == 2
    assert spec.plan() == spec.plan()
    assert spec.plan(), "the plan fires at least one fault"


def test_monarch_case_study_matches_the_story():
    spec = load_experiment(ROOT / "experiments" / "monarch_case_study.toml")
    kinds = {"segfault", "kill", "collective_abort", "host_eviction", "gil_deadlock"}
    assert set(spec.faults.weights) == kinds
    assert kinds == {f.kind for f in spec.plan()}  # every kind actually fires
    assert spec.schedule.interval_s == 20 and spec.schedule.jitter_s == 10
    assert spec.topology.replicas >= 3 and len(spec.topology.hosts) >= 2


def test_a_good_file(tmp_path):
    spec = load_experiment(write(tmp_path, GOOD))
    assert spec.name == "t" and spec.seed == 3 and spec.duration_s == 60
    assert spec.faults.weights == {"kill": 2.0, "segfault": 1.0, "host_eviction": 1.0}
    assert spec.targets.keep_alive.replicas == {0}
    assert spec.hypotheses.loss_finite
    assert spec.hypotheses.bound("goodput_min", "in_place") == 0.5
    assert spec.hypotheses.bound("goodput_min", "full_restart") is None
    assert spec.hypotheses.bound("recovery_p95_max_s", "full_restart") == 10
    assert spec.job_overrides("full_restart")[-1] == "recovery.policy=full_restart"
    assert all(f.target.replica != 0 for f in spec.plan())


def test_job_path_is_relative_to_the_experiment_file(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "small.toml").write_text("replicas = 4\nhosts = 2\n")
    text = GOOD.replace("[job]\nreplicas = 3\nranks = 1\nhosts = 2\n", "")
    text = 'job = "jobs/small.toml"\n' + text
    spec = load_experiment(write(tmp_path, text))
    assert spec.job_path == tmp_path / "jobs" / "small.toml"
    assert spec.topology.replicas == 4


def _replace(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new)


BAD = [
    # (what is wrong, the file text, words the message must contain)
    ("unknown top-level key", "colour = 1\n" + GOOD, ["colour", "unknown key", "allowed:"]),
    (
        "unknown fault kind",
        _replace("segfault = 1", "oom = 1"),
        ["faults.mix.oom", "unknown fault kind", "allowed:", "segfault"],
    ),
    (
        "negative interval",
        _replace("interval_s = 10", "interval_s = -5"),
        ["schedule.interval_s", "-5", "> 0"],
    ),
    (
        "impossible target",
        _replace("keep_alive = { replicas = [0] }", "replicas = [5]"),
        ["targets.replicas", "replica 5 of 3", "0..2"],
    ),
    (
        "empty fault mix",
        _replace("mix = { kill = 2, segfault = 1, host_eviction = 1 }", "mix = {}"),
        ["faults.mix", "non-empty", "kinds:"],
    ),
    (
        "unknown schedule kind",
        _replace('kind = "interval"', 'kind = "sometimes"'),
        ["schedule.kind", "'sometimes'", "poisson"],
    ),
    (
        "unknown policy",
        _replace('"full_restart"]', '"reboot"]'),
        ["policies", "'reboot'", "in_place, full_restart"],
    ),
    (
        "unknown hypothesis",
        _replace("loss_finite = true", "loss_small = true"),
        ["hypotheses.loss_small", "unknown key", "goodput_min"],
    ),
    (
        "unknown fault option",
        GOOD + "[faults.options.kill]\nsignal = 9\n",
        ["faults.options.kill", "no option 'signal'", "hold_s"],
    ),
    ("no duration", _replace("duration_s = 60\n", ""), ["duration_s", "steps"]),
    (
        "keep-alive leaves nothing to evict",
        _replace("keep_alive = { replicas = [0] }", "keep_alive = { replicas = [0, 1] }"),
        ["targets", "no host can be evicted"],
    ),
    ("bad job config", _replace("replicas = 3", "replicas = 0"), ["job", "replicas"]),
    (
        "missing job file",
        _replace("[job]\nreplicas = 3\nranks = 1\nhosts = 2\n", "").replace(
            'name = "t"', 'name = "t"\njob = "nope.toml"'
        ),
        ["job", "nope.toml", "no such file"],
    ),
    ("negative weight", _replace("kill = 2", "kill = -2"), ["faults.mix.kill", "> 0"]),
    # Non-finite numbers: an infinite duration never ends, a NaN compares false to everything.
    (
        "infinite duration",
        _replace("duration_s = 60", "duration_s = inf"),
        ["duration_s", "got inf; must be a finite number"],
    ),
    (
        "NaN duration",
        _replace("duration_s = 60", "duration_s = nan"),
        ["duration_s", "got nan; must be a finite number"],
    ),
    (
        "a duration longer than a week",
        _replace("duration_s = 60", "duration_s = 1e12"),
        ["duration_s", "must be <= 604800 seconds"],
    ),
    (
        "NaN interval",
        _replace("interval_s = 10", "interval_s = nan"),
        ["schedule.interval_s", "got nan; must be a finite number"],
    ),
    ("NaN weight", _replace("kill = 2", "kill = nan"), ["faults.mix.kill", "finite"]),
    ("NaN threshold", _replace("recovery_p95_max_s = 10", "recovery_p95_max_s = nan"), ["finite"]),
    (
        "infinite fault time",
        _replace('kind = "interval"\ninterval_s = 10', 'kind = "at_times"\nat_times = [1, inf]'),
        ["schedule.at_times", "got inf"],
    ),
    (
        "NaN in the job",
        _replace("hosts = 2\n", "hosts = 2\n[job.optim]\nlr = nan\n"),
        ["job", "optim.lr = nan: must be a finite number"],
    ),
    # The name becomes runs/NAME, and the chaos runner writes under it: no escaping it.
    ("name with ..", _replace('name = "t"', 'name = "../../etc"'), ["name", "'../../etc'"]),
    ("name with /", _replace('name = "t"', 'name = "a/b"'), ["name", "runs/NAME"]),
    ("name ..", _replace('name = "t"', 'name = ".."'), ["name", "starting with a letter"]),
]


@pytest.mark.parametrize(("case", "text", "words"), BAD, ids=[b[0] for b in BAD])
def test_malformed_files_are_rejected_clearly(tmp_path, case, text, words):
    path = write(tmp_path, text, name="broken.toml")
    with pytest.raises(ExperimentError) as err:
        load_experiment(path)
    message = str(err.value)
    assert message.startswith(str(path.resolve())), message  # names the file
    for w in words:
        assert w in message, f"{case}: {w!r} not in {message!r}"


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(ExperimentError, match="not valid TOML"):
        load_experiment(write(tmp_path, "name = \n"))
    with pytest.raises(ExperimentError, match="no such experiment file"):
        load_experiment(tmp_path / "absent.toml")


SOAK_HYPOTHESES = ("every_fault_recovered", "journal_complete", "no_orphans", "no_shm_left")


@pytest.mark.parametrize(("name", "faults"), [("soak.toml", 100), ("soak_ci.toml", 12)])
def test_the_soaks_fire_every_kind_in_place_and_claim_nothing_is_lost(name, faults):
    from faults.fault import fault_class, fault_kinds

    # every kind a job on local hosts can take (network faults need hosts with their own link)
    # (and of the catalogue: other tests register kinds of their own)
    local = {
        k
        for k in fault_kinds()
        if fault_class(k).__module__.startswith("faults.")
        and not getattr(fault_class(k), "needs_network", False)
        and not getattr(fault_class(k), "needs_launcher", None)  # SLURM faults: launcher slurm
        # the soaks keep group 0 alive, and torchft heals a group from the lowest up-to-date
        # one, and the group at participating rank 0 writes the checkpoints: group 0, nearly
        # always (experiments/sharded.toml kills heal sources, test_fsdp_groups.py writers)
        and k not in ("heal_source_kill", "checkpoint_kill")
        # bad data fails whichever group reads it, group 0 too (experiments/poison.toml)
        and k != "poison_data"
        # a broken device drops its group: a failure that recurs, not one to ride through
        and not getattr(fault_class(k), "recurs", False)
    }
    spec = load_experiment(ROOT / "experiments" / name)
    plan = spec.plan()
    assert len(plan) >= faults
    assert {f.kind for f in plan} == local and len(local) >= 8
    # the soak's goodput is against a fault-free control; its CI version saves the time
    assert spec.policies == (("control", "in_place") if name == "soak.toml" else ("in_place",))
    assert spec.job_overrides("in_place")[-1] == "recovery.policy=in_place"
    h = spec.hypotheses
    assert h.replicas_equal_after_heal and all(getattr(h, k) for k in SOAK_HYPOTHESES)
    # every fault is planned early enough to recover before the run ends
    assert max(f.at_s for f in plan) <= spec.duration_s - 30


@pytest.mark.parametrize("key", SOAK_HYPOTHESES)
def test_a_soak_hypothesis_must_be_a_boolean(tmp_path, key):
    p = write(tmp_path, GOOD + f'{key} = "yes"\n')
    with pytest.raises(ExperimentError, match=f"hypotheses.{key}: must be true or false"):
        load_experiment(p)
    p = write(tmp_path, GOOD + f"{key} = true\n")
    assert getattr(load_experiment(p).hypotheses, key)


def test_the_control_runs_in_pieces_between_the_policies(tmp_path):
    text = _replace(
        'policies = ["in_place", "full_restart"]',
        'policies = ["control", "in_place", "full_restart"]\ncontrol_runs = 3',
    )
    spec = load_experiment(write(tmp_path, text))
    order = [(r.folder, r.duration_s, r.control_run) for r in spec.runs()]
    assert order == [
        ("control-1", 20.0, 1),
        ("in_place", 60.0, None),
        ("control-2", 20.0, 2),
        ("full_restart", 60.0, None),
        ("control-3", 20.0, 3),
    ]
    assert spec.job_overrides("control")[-1] == "recovery.policy=in_place"
    # Without a control: one run per policy, in order.
    plain = load_experiment(write(tmp_path, GOOD, "plain.toml"))
    assert [r.folder for r in plain.runs()] == ["in_place", "full_restart"]


@pytest.mark.parametrize(
    ("policies", "extra", "words"),
    [
        ('["control"]', "", ["policies", "baseline", "in_place"]),
        ('["control", "in_place"]', "control_runs = 0", ["control_runs", "1..16"]),
        ('["control", "in_place"]', 'control_runs = "2"', ["control_runs", "'2'"]),
    ],
)
def test_a_bad_control_is_refused(tmp_path, policies, extra, words):
    text = _replace('policies = ["in_place", "full_restart"]', f"policies = {policies}\n{extra}")
    with pytest.raises(ExperimentError) as e:
        load_experiment(write(tmp_path, text))
    for w in words:
        assert w in str(e.value)
