"""The pure parts of ``bench overhead``: summarizing runs and the break-even model."""

from __future__ import annotations

import pytest

from experiments.bench.overhead import break_even, summarize, time_lost


def _run(gaps: list[float], ctl: float = 0.0) -> dict:
    return {
        "gaps": gaps,
        "tokens_per_s": 100.0,
        "cpu_controller": ctl,
        "cpu_agent_max": 0.0,
        "cpu_worker_mean": 0.5,
        "rss_mb": 300.0,
        "processes": 4,
        "cpu_ms_per_step": sum(gaps),
    }


def test_ratio_is_per_repetition_against_plain_of_the_same_repetition() -> None:
    runs = {
        "plain": [_run([1.0, 1.0, 1.0]), _run([2.0, 2.0, 2.0])],
        "ftharness": [_run([1.1, 1.1, 1.1], 0.01), _run([2.4, 2.4, 2.4], 0.03)],
    }
    rows = summarize(runs)
    assert rows["plain"]["ratio_to_plain"] == 1.0
    assert rows["ftharness"]["ratio_per_rep"] == [1.1, 1.2]
    assert rows["ftharness"]["ratio_to_plain"] == pytest.approx(1.15)
    assert rows["ftharness"]["cpu"]["controller"] == pytest.approx(0.02)
    assert rows["ftharness"]["step_ms"] == {"median": 1750.0, "p95": 2400.0}
    assert rows["ftharness"]["cpu_ratio_to_plain"] == pytest.approx(1.15)
    assert rows["ftharness"]["ratio_to_torchft"] is None  # no torchft runs to compare with


def test_ratio_to_torchft_and_controller_cost_per_step() -> None:
    def run(gaps: list[float], ctl_ms: float = 0.0) -> dict:
        return {**_run(gaps), "controller_ms_per_step": ctl_ms}

    runs = {
        "plain": [run([1.0] * 3), run([1.0] * 3)],
        "torchft": [run([1.0] * 3), run([2.0] * 3)],
        "ftharness": [run([1.1] * 3, 0.4), run([2.4] * 3, 0.6)],
    }
    rows = summarize(runs)
    assert rows["ftharness"]["ratio_to_torchft"] == pytest.approx(1.15)  # 1.1 and 1.2
    assert rows["torchft"]["ratio_to_torchft"] == 1.0
    assert rows["ftharness"]["controller_ms_per_step"] == pytest.approx(0.5)


def test_break_even_model() -> None:
    assert time_lost(overhead=0.1, per_failure_s=60, mtbf_min=10) == pytest.approx(0.2)
    got = break_even(
        groups=4,
        in_place_overhead=0.05,
        stall_s=1.0,
        back_s=4.0,
        restart_overhead=0.01,
        restart_s=20.0,
        steps_lost=10,
        step_s=1.0,
        mtbf_min=[1.0],
    )
    # per failure: in place 1 + 4/4 = 2 s, restart 20 + 10 = 30 s; break even at 28 s / 0.04
    assert got["per_failure_s"] == {"in_place": 2.0, "restart": 30.0}
    assert got["break_even_mtbf_min"] == pytest.approx(28 / 0.04 / 60, abs=0.05)
    row = got["rows"][0]
    assert row["in_place"] == pytest.approx(0.05 + 2 / 60, abs=1e-4)
    assert row["restart"] == pytest.approx(0.01 + 30 / 60, abs=1e-4)
    cheaper = break_even(**{**_args(), "in_place_overhead": 0.0})
    assert cheaper["break_even_mtbf_min"] is None


def _args() -> dict:
    return {
        "groups": 2,
        "in_place_overhead": 0.1,
        "stall_s": 1.0,
        "back_s": 1.0,
        "restart_overhead": 0.01,
        "restart_s": 5.0,
        "steps_lost": 1,
        "step_s": 1.0,
        "mtbf_min": [10.0],
    }


def test_the_token_file_is_compared_with_the_synthetic_stream_at_its_vocabulary() -> None:
    runs = {
        "plain": [_run([1.0] * 3), _run([1.0] * 3)],
        "ftharness_vocab2048": [_run([2.0] * 3), _run([4.0] * 3)],
        "ftharness_tokens": [_run([2.02] * 3), _run([4.0] * 3)],
    }
    rows = summarize(runs)
    # per repetition: 1.01 and 1.0; the larger output layer (2.0 vs plain's 1.0) is not counted
    assert rows["ftharness_tokens"]["ratio_to_synthetic"] == pytest.approx(1.005)
    assert "ratio_to_synthetic" not in rows["ftharness_vocab2048"]


def test_only_runs_the_named_configurations_and_their_floors() -> None:
    from experiments.bench.overhead import CONFIGS, chosen

    assert chosen(None) == CONFIGS
    assert chosen("ftharness_fsdp") == ["plain", "ftharness_fsdp", "plain_hsdp"]
    assert chosen("torchft, ftharness") == ["plain", "torchft", "ftharness"]


def test_only_refuses_an_unknown_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.bench.overhead import chosen

    with pytest.raises(SystemExit) as exc:
        chosen("ftharness,fsdp")
    assert exc.value.code == 2
    assert "unknown ['fsdp']" in capsys.readouterr().err
