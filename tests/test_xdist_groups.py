"""The tests of an ``xdist_group`` run on one worker under ``-n 2 --dist loadgroup``, so a
module-scoped fixture they share is built once (the DP and LM guides' runs, shared noise plans).
pytest 9.2 with pytest-xdist 3.8 loses the groups (pytest-dev/pytest-xdist#1386): this test fails
there, which is why pyproject.toml keeps pytest below 9.2."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

TOY = """
import os, pytest

@pytest.fixture(scope="module")
def built():
    with open("builds.txt", "a") as f:
        f.write(f"{os.getpid()}\\n")

@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("i", range(4))
def test_grouped(built, i):
    pass

@pytest.mark.parametrize("i", range(4))
def test_free(i):
    pass
"""


@pytest.mark.slow  # a harness check (about 9 s): it runs pytest itself
def test_a_group_runs_on_one_worker_and_builds_its_module_fixture_once(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "test_toy.py").write_text(TOY)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "test_toy.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test_grouped[0]@shared" in proc.stdout  # the id the scheduler groups by
    assert len((tmp_path / "builds.txt").read_text().split()) == 1, proc.stdout


class _Item:
    """What the collection hook reads of a test item: its markers."""

    def __init__(self, name: str, *markers: str):
        self.name, self.markers = name, markers

    def get_closest_marker(self, name: str) -> object | None:
        return pytest.mark.heavy if name in self.markers else None


def test_heavy_tests_are_collected_first_the_rest_in_order():
    import conftest

    items = [_Item("a"), _Item("long1", "heavy"), _Item("b"), _Item("c"), _Item("long2", "heavy")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["long1", "long2", "a", "b", "c"]
