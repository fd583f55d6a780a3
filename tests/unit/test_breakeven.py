"""experiments.breakeven: the break-even failure interval is where both policies lose the same."""

from __future__ import annotations

import json
import math

import pytest

from experiments.breakeven import (
    SCENARIOS,
    Scenario,
    break_even_s,
    lost_in_place,
    lost_restart,
    main,
)


@pytest.mark.parametrize("s", SCENARIOS, ids=lambda s: s.name)
def test_at_the_break_even_interval_both_lose_the_same(s):
    m = break_even_s(s)
    assert 0 < m < math.inf
    assert lost_in_place(s, m) == pytest.approx(lost_restart(s, m))
    # rarer failures: restart wins; more frequent: in place wins
    assert lost_restart(s, 2 * m) < lost_in_place(s, 2 * m)
    assert lost_in_place(s, m / 2) < lost_restart(s, m / 2)


def test_no_steady_cost_means_in_place_always_wins():
    s = Scenario("free", groups=4, step_ratio=1.0, stall_s=1, back_s=4, restart_s=60,
                 checkpoint_interval_s=600)  # fmt: skip
    assert break_even_s(s) == math.inf


def test_own_scenario_on_the_command_line(capsys):
    body = {"groups": 8, "step_ratio": 1.02, "stall_s": 1, "back_s": 30, "restart_s": 300,
            "checkpoint_interval_s": 900}  # fmt: skip
    assert main(["--json", "--scenario", "mine=" + json.dumps(body), "--mtbf-min", "60"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    mine = rows[-1]
    assert mine["name"] == "mine"
    # (300 + 450 - 1 - 30/8) / (1 - 1/1.02) s
    assert mine["break_even_min"] == pytest.approx((750 - 1 - 3.75) / (1 - 1 / 1.02) / 60, 0.01)
    assert main(["--scenario", 'bad={"groups": 8}']) == 2
