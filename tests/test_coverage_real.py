"""tools.coverage_real: the table and JSON it writes, on a quick model and a refused one."""

from __future__ import annotations

import json

import pytest

from tools import coverage_real as cr


@pytest.mark.slow  # two models compiled twice each: about 30 s on 2 busy cores
def test_writes_the_table_and_json(tmp_path):
    pytest.importorskip("equinox")
    pytest.importorskip("flax")
    assert cr.main(["--out", str(tmp_path), "--only", "eqx-mlp,linen-batchnorm"]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "coverage.json").read_text())["rows"]}
    assert rows["eqx-mlp"]["status"] == "ok" and rows["eqx-mlp"]["fallback"] == 0
    assert (
        max(rows["eqx-mlp"]["error_rel"]["norms"], rows["eqx-mlp"]["error_rel"]["sum"])
        <= cr.TOLERANCE
    )
    # BatchNorm statistics in training: the clear error, which the model is expected to give
    assert (
        rows["linen-batchnorm"]["status"] == "expected error"
        and "GroupNorm" in rows["linen-batchnorm"]["error"]
    )
    table = (tmp_path / "coverage.md").read_text()
    assert "| eqx-mlp | equinox | 6 | 6 | 0 | 0 | ok |" in table
    assert "Leaves on the fallback: 0 of 6 (0.0%)" in table  # the refused model is not counted


def test_a_missing_library_is_skipped_and_an_unknown_name_refused():
    def missing():
        raise ImportError("No module named 'haiku'")

    row = cr.measure(cr.Model("x", "haiku", missing))
    assert row["status"] == "skipped" and "haiku" in row["error"]
    with pytest.raises(SystemExit, match="unknown model or library"):
        cr.selected("no-such-model")
    assert {m.library for m in cr.selected("haiku")} == {"haiku"}
