"""The persistent compilation cache CI shares between its stages (``.ci/run``: every program
stored) and the tests that read names or sources from a compiled program.

JAX's cache key leaves out names and source locations, so a program read back from the cache
carries those of whichever caller compiled the same program first. Tests marked
``reads_compiled_names`` key their programs with them (``conftest.py``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The same program (and module name) compiled from two functions whose argument names differ.
_READ_BACK = """
import json, sys, jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
first = lambda alpha: jnp.sin(alpha) * 2
second = lambda beta: jnp.sin(beta) * 2
third = lambda gamma: jnp.sin(gamma) * 2
x = jnp.ones(8)
jax.jit(first).lower(x).compile()
read_back = jax.jit(second).lower(x).compile().as_text()
jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
keyed = jax.jit(third).lower(x).compile().as_text()
print(json.dumps([[n for n in ("alpha", "beta") if n in read_back], [n for n in ("alpha", "gamma") if n in keyed]]))
"""


def test_a_program_read_back_carries_the_first_compilers_names_unless_they_are_keyed(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _READ_BACK, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    read_back, keyed = json.loads(proc.stdout.splitlines()[-1])
    assert read_back == ["alpha"]  # why the marker exists: the second caller's names are lost
    assert keyed == ["gamma"]


@pytest.mark.reads_compiled_names
def test_the_marker_puts_names_in_the_key_for_the_test_only():
    assert jax.config.jax_compilation_cache_include_metadata_in_key


@pytest.mark.skipif(
    "JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY" in os.environ, reason="set for the run"
)
def test_unmarked_tests_share_programs_whatever_their_names():
    assert not jax.config.jax_compilation_cache_include_metadata_in_key


# What reads names or sources from a compiled program: the HLO readers of benchmarks/ and
# the tests' own parsers of parameter names and stack frames.
_READS_NAMES = re.compile(
    r"\b(hlo_program|hlo_hints|hlo_phases|instructions_by_source|rng_loops|"
    r"compiled_summary|cost_report|stack_frame_id|_entry_reads)\b"
)


def test_every_test_module_that_reads_compiled_names_is_marked():
    unmarked = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "tests").rglob("test_*.py"))
        if p.name != pathlib.Path(__file__).name
        and _READS_NAMES.search(p.read_text())
        and "reads_compiled_names" not in p.read_text()
    ]
    assert unmarked == []
