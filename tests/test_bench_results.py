"""``python -m benchmarks`` result files: an ``--only`` run replaces its groups' rows and keeps the rest."""

from __future__ import annotations

from benchmarks.__main__ import _markdown, merge_rows


def _row(group: str, name: str, ratio: float, **extra) -> dict:
    return {
        "group": group,
        "name": name,
        "ours_ms": ratio,
        "baseline_ms": 1.0,
        "ratio": ratio,
        **extra,
    }


def test_only_run_replaces_its_groups_and_keeps_the_others():
    old = [
        _row("core", "a", 1.0, date="2026-11-20"),
        _row("stateful", "b", 2.0, date="2026-11-21"),
        _row("core", "c", 3.0, date="2026-11-20"),
        _row("dp", "d", 4.0, date="2026-11-21"),
    ]
    new = [_row("core", "a", 0.9), _row("core", "e", 0.8)]
    rows = merge_rows(old, new, {"core"}, "2026-11-24")
    assert [(r["group"], r["name"], r["date"]) for r in rows] == [
        ("core", "a", "2026-11-24"),
        ("core", "e", "2026-11-24"),  # core's rows: all new, none of the old
        ("stateful", "b", "2026-11-21"),
        ("dp", "d", "2026-11-21"),
    ]
    # a suite that ran but produced no rows (e.g. skipped) drops its stale rows
    assert [r["group"] for r in merge_rows(old, [], {"dp"}, "2026-11-24")] == [
        "core",
        "core",
        "stateful",
    ]
    # a new group goes after the known ones
    assert merge_rows(old, [_row("noise", "n", 1.0)], {"noise"}, "x")[-1]["group"] == "noise"


def test_markdown_says_when_each_group_was_measured():
    rows = [
        _row("core", "a", 1.0, date="2026-11-24"),
        _row("stateful", "b", 2.0, date="2026-11-21"),
    ]
    meta = {
        "jax": "0",
        "backend": "cpu",
        "device": "cpu",
        "machine": "m",
        "quick": False,
        "date": "2026-11-24",
    }
    md = _markdown(rows, meta)
    assert "Measured (per group): core 2026-11-24; stateful 2026-11-21." in md
    assert "| stateful | b | 2.00 | 1.00 | 2.000 |" in md
