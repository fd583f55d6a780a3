"""The HTML dashboard opens offline in headless Chromium, without errors, showing its panels."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from journal_scenario import scenario

from dashboards import names as N
from dashboards.html import render_dashboard, write_dashboard
from dashboards.metrics import summarize
from runtime.journal import Journal, read_journal

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
EVIL = '<img src=x onerror="window.__pwned=1">'
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _journal(path: Path) -> list[dict]:
    """Both policies, written through a real Journal and read back as `report` would."""
    j = Journal(path, job="html-test")
    recs = scenario(job="html-test", policy="in_place", t0=1_700_000_000.0)
    recs += scenario(job="html-test", policy="full_restart", t0=1_700_000_100.0, kind=EVIL)
    for r in recs:
        j.emit(
            r["event"], t=r["t"], **{k: v for k, v in r.items() if k not in ("t", "event", "job")}
        )
    j.close()
    return read_journal(path)


@pytest.mark.timeout(120)
def test_dashboard_renders_offline_in_chromium(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed")
    records = _journal(tmp_path / "journal.jsonl")
    summary = summarize(records)
    path = write_dashboard(tmp_path / "report", records, summary)
    assert path == tmp_path / "report" / "dashboard.html"
    html_text = path.read_text()
    assert EVIL not in html_text and "http://" not in html_text and "https://" not in html_text

    problems: list[str] = []
    requests: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(path.as_uri(), wait_until="load")
            panels = page.eval_on_selector_all(
                "[data-panel]",
                "els => els.map(e => [e.id, e.dataset.panel, e.dataset.policy || null])",
            )
            kinds = {kind for _, kind, _ in panels}
            assert {
                "goodput",
                "comparison",
                "timeline",
                "step-rate",
                "participants",
                "recovery-distribution",
                "recoveries",
            } <= kinds
            assert {pol for _, kind, pol in panels if kind == "timeline"} == {
                "in_place",
                "full_restart",
            }
            # the goodput cards show summarize()'s figures
            for policy in ("in_place", "full_restart"):
                shown = page.inner_text(
                    f'#panel-goodput .card[data-policy="{policy}"] [data-value=goodput]'
                )
                assert shown == f"{100 * summary['policies'][policy]['goodput']:.1f}%"
            # each timeline draws the fault, the phases of its recovery and the survivors' stall
            timeline = page.locator("#panel-timeline-full_restart")
            assert timeline.locator("[data-fault]").count() == 1
            drawn = set(
                timeline.locator("rect.phase").evaluate_all("els => els.map(e => e.dataset.phase)")
            )
            assert drawn == {"detection", "restart", "rejoin", "stall"}
            assert page.locator("#panel-step-rate polyline.series").count() == 2
            assert page.locator("#panel-participants polyline.series").count() == 2
            assert page.locator("#panel-recovery-distribution circle.dot").count() >= 6
            rows = page.locator("#panel-recoveries tr[data-policy]")
            assert rows.count() == 2
            ratios = page.locator("#panel-comparison [data-ratio]").all_inner_texts()
            assert any("full_restart / in_place" in r for r in ratios)
            # journal text is shown as text, never interpreted as markup
            assert page.locator("#panel-recoveries").inner_text().count(EVIL) == 1
            assert (
                f"{EVIL} · detection"
                in page.locator("#panel-recovery-distribution title").all_text_contents()
            )
            assert page.locator("img").count() == 0
            assert page.evaluate("window.__pwned") is None
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "html_dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert problems == []
    assert requests == [path.as_uri()]  # nothing but the file itself: no CDN, no network


@pytest.mark.timeout(60)
def test_timelines_draw_the_summarys_survivor_stall():
    """The stall bars are summarize()'s survivor stall (one per survivor that stalled), not
    another interval under the same name."""
    records = scenario(policy="in_place") + scenario(policy="full_restart", t0=1_700_000_100.0)
    summary = summarize(records)
    page = render_dashboard(records, summary)
    drawn = re.findall(
        r'data-phase="stall" data-recovery="([^"]*)".*?<title>group (\S+): '
        + re.escape(N.SURVIVOR_STALL.label)
        + r" ([0-9.]+) s",
        page,
    )
    expected = [
        (r["recovery_id"], str(g["replica"]), f"{g['stall_s']:.2f}")
        for policy in ("in_place", "full_restart")
        for r in summary["policies"][policy]["recoveries"]
        for g in r["survivor_gaps"]
        if g["stall_s"] > 0
    ]
    assert drawn == expected and len(drawn) == 2
    for policy in ("in_place", "full_restart"):
        (rec,) = summary["policies"][policy]["recoveries"]
        assert f"{rec['stall_s']:.2f}" in {s for _, _, s in drawn}
