""".ci/stages.sh: the stage table .ci/run prints at its end, a failing stage included."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
STAGES = ROOT / ".ci" / "stages.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(body: str, tmp_path: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "ci"
    script.write_text(f"set -euo pipefail\nsource {STAGES}\n{body}\n")
    return subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **env},
    )


def _rows(out: str) -> dict[str, str]:
    table = out.split("== CI stages\n", 1)[1].splitlines()[1:]
    return {line[:44].strip(): line[44:] for line in table if line.strip()}


def test_each_stage_gets_a_row_with_its_time_and_budget(tmp_path):
    proc = _run('stage "lint" 1\nsleep 2\nstage "tests" 60\ntrue\nend_stage ok', tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "== lint\n== tests\n" in proc.stdout
    rows = _rows(proc.stdout)
    assert list(rows) == ["lint", "tests", "total"]
    assert rows["lint"].split()[:4] == ["2", "s", "1", "s"] and rows["lint"].endswith(
        "ok  over budget"
    )
    assert rows["tests"].split()[2:5] == ["60", "s", "ok"] and "over budget" not in rows["tests"]
    assert "WARNING" not in proc.stdout


def test_a_failing_stage_is_named_and_its_exit_code_kept(tmp_path):
    proc = _run('stage "lint" 10\ntrue\nstage "tests" 10\nexit 3\nstage "docs" 10', tmp_path)
    assert proc.returncode == 3
    rows = _rows(proc.stdout)
    assert list(rows) == ["lint", "tests", "total"]  # the stage after the failure never started
    assert rows["tests"].endswith("FAILED (exit 3)")
    assert rows["lint"].endswith("ok")


def test_a_run_over_the_whole_budget_warns_and_counts_the_cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "jit_f-cache").write_bytes(b"x")
    proc = _run(
        'stage "slow" 100\nsleep 2\nend_stage ok',
        tmp_path,
        BUDGET_TOTAL="1",
        JAX_COMPILATION_CACHE_DIR=str(cache),
    )
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: this run took" in proc.stdout and "over its 1 s budget" in proc.stdout
    assert "compilation cache: 1 programs" in proc.stdout
