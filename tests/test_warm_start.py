"""JAX's persistent compilation cache in the documented loop and the notebooks: the setup keeps a
``JAX_COMPILATION_CACHE_DIR`` from the environment, every notebook has the DP guide's lines, and a
DP step started warm from the cache computes what the cold-compiled one did, to the bit."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guides" / "dp-sgd.md"


def cache_lines(text: str) -> str:
    """The two ``jax.config.update`` calls that turn the cache on, as the text has them."""
    m = re.search(
        r'^jax\.config\.update\("jax_compilation_cache_dir",\n.*?'
        r'^jax\.config\.update\("jax_persistent_cache_min_compile_time_secs", [\d.]+\)\n',
        text,
        flags=re.S | re.M,
    )
    assert m, "no compilation cache setup"
    return m.group(0)


def _configured(env: dict[str, str]) -> dict:
    """The cache folder and threshold after the guide's lines run in a fresh process under ``env``."""
    code = (
        "import json, pathlib, jax\n"
        + cache_lines(GUIDE.read_text())
        + "print(json.dumps([jax.config.jax_compilation_cache_dir, "
        "jax.config.jax_persistent_cache_min_compile_time_secs]))"
    )
    base = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_guides_cache_setup_keeps_the_environments_folder(tmp_path):
    ci = str(tmp_path / "ci-cache")
    assert _configured({"JAX_COMPILATION_CACHE_DIR": ci}) == [ci, 0.1]
    home = tmp_path / "home"
    assert _configured({"HOME": str(home)}) == [str(home / ".cache" / "jax"), 0.1]


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_every_notebook_turns_the_cache_on_as_the_guide_does(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    setup = "".join(cells[1]["source"])  # the cell after the install cell, before any computation
    assert "import pathlib" in setup
    assert cache_lines(setup) == cache_lines(GUIDE.read_text())


@pytest.mark.slow
def test_a_warm_started_dp_step_is_read_from_the_cache_and_equals_the_cold_one():
    """Two processes share a cache folder: the second reads the DP step back (no cache miss: the
    step called directly has no host callback, which JAX never caches) and its first step's
    parameters and optimizer state are the first's, to the bit. (Cache events, not timings: a
    timing passed by noise when the step was not cached at all.)"""
    from benchmarks import warm_start

    r = warm_start.measure(quick=True)
    assert r["cold"]["misses"] >= 1 and r["entries"] >= 1
    assert (r["warm"]["hits"], r["warm"]["misses"]) == (1, 0)
    assert r["warm"]["digest"] == r["cold"]["digest"]


_DEMO_RUN = """
import json, sys, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
events = []
jax.monitoring.register_event_listener(lambda name, **_: events.append(name))
jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **_: events.append(name))
from gradclip_jax import demo
demo.run(methods=("dp-sgd",), steps=4, progress=False)
names = ["/jax/compilation_cache/cache_hits", "/jax/core/compile/backend_compile_duration"]
print(json.dumps([events.count(n) for n in names]))
"""


@pytest.mark.slow
def test_the_dp_notebooks_run_again_compiles_nothing(tmp_path):
    """The DP notebook's run (the demo's ``'dp-sgd'`` run, which calls ``priv.step`` directly)
    in a second fresh process with the same cache folder reads every program back and compiles
    none (the step jitted around ``priv.step`` carried the release log's host callback: JAX
    neither reads nor writes such a program, and compiled it in every process)."""
    env = {
        **{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"},
        "JAX_PLATFORMS": "cpu",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }

    def run() -> list[int]:
        out = subprocess.run(
            [sys.executable, "-c", _DEMO_RUN, str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    # (JAX times a program read back as a compile too: the ones compiled anew are the difference)
    hits, compiles = run()
    assert hits == 0 and compiles >= 1
    assert run() == [compiles, compiles]  # every program read back, none compiled anew
