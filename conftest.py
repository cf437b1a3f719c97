"""Test configuration (repo root, so it runs before anything imports jax).

Sets 8 simulated CPU devices for the sharding tests.

XLA reads the device count once, when jax is first imported, so it is set here,
before any test module imports jax.

The suite runs on the CPU unless ``JAX_PLATFORMS`` names another backend
(``JAX_PLATFORMS=cuda``). There (see ``tests/_backend.py``):

* float32 products run at full precision: ``jax_default_matmul_precision`` is
  set to ``'float32'`` for the session (NVIDIA GPUs otherwise multiply float32 in
  TF32, TPUs in bfloat16 passes), so the comparisons with float32 tolerances
  mean what they mean on a CPU. A precision given in ``JAX_DEFAULT_MATMUL_PRECISION``
  is kept. Tests of what a user's step gets at the backend's default precision
  say so (``tests._backend.backend_default_precision``).
* tests marked ``cpu_only(reason=...)`` (XLA:CPU's compiled programs) are skipped
  with their reason.
* each process allocates GPU memory as it needs it
  (``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless set), so ``-n N`` workers
  share one GPU.

``GRADCLIP_TEST_PRETEND_BACKEND=gpu`` (on a CPU only) makes ``jax.default_backend()``
answer ``'gpu'``: the library then takes the choices it makes for that backend
when it traces (its per-backend tables, the ``ghost_sum='backward'`` rule) and the
suite runs as on a GPU (full-precision products, ``cpu_only`` tests skipped), while
the arithmetic and the compiled programs stay the CPU's. It checks the suite's
backend logic without a GPU, not the GPU's numerics.
"""

import importlib.util
import os

# XLA:CPU aborts the whole process when a participant of a collective (an all-reduce
# across the simulated devices) waits 40 s for the others: on a loaded 2-core machine (two
# xdist workers, or two CI runs at once) a descheduled device can take that long, and the
# abort takes down the worker and every test it had left. A stuck collective is still
# reported (after 60 s), and still ends the process, after 10 minutes.
_FLAGS = {
    "--xla_force_host_platform_device_count": "8",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds": "60",
    "--xla_cpu_collective_call_terminate_timeout_seconds": "600",
}
# The suite compiles thousands of small programs and runs each a few times: on the CPU, LLVM's
# most expensive passes cost more than they save (the eager norm tests' CPU time: -13%). No HLO
# pass changes, so compiled memory, costs and names are those a user's program gets, and the
# results stay within the suite's tolerances (LLVM's -O0, a further 15%, is not taken: it
# moves some float32 results by up to 5e-4 relative). GRADCLIP_TEST_XLA_OPT=1 keeps XLA's
# defaults. The benchmarks, docs and notebooks do not read this file.
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and not os.environ.get("GRADCLIP_TEST_XLA_OPT"):
    _FLAGS["--xla_llvm_disable_expensive_passes"] = "true"
for _name, _value in _FLAGS.items():
    if _name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_name}={_value}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import hypothesis  # noqa: E402
import pytest  # noqa: E402

hypothesis.settings.register_profile(
    "default", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.register_profile("thorough", max_examples=400, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

PRETEND = "GRADCLIP_TEST_PRETEND_BACKEND"


def _xdist_controller(config: pytest.Config) -> bool:
    """An xdist controller runs no test: it must not start a backend (a GPU's memory)."""
    return not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no"


def pytest_configure(config: pytest.Config) -> None:
    if _xdist_controller(config):
        return
    import jax

    pretend = os.environ.get(PRETEND)
    if pretend:
        real = jax.default_backend()
        if real != "cpu":
            raise pytest.UsageError(
                f"{PRETEND}={pretend} is for a CPU run; this one runs on {real!r}"
            )
        jax.default_backend = lambda: (
            pretend
        )  # read by the library and the tests, not by jax itself
    if jax.default_backend() != "cpu" and jax.config.jax_default_matmul_precision is None:
        jax.config.update("jax_default_matmul_precision", "float32")
    if jax.default_backend() != "cpu":
        # the norms' products on the unrounded operands too (the library's GPU default rounds
        # them to TF32): tests of that default say so (tests._backend.library_default_products)
        from gradclip_jax.per_example import PRODUCT_PRECISION

        PRODUCT_PRECISION[jax.default_backend()] = "highest"


@pytest.fixture(autouse=True)
def _compiled_names_in_cache_key(request: pytest.FixtureRequest):
    """A test marked ``reads_compiled_names`` gets programs carrying its own names and sources.

    JAX's persistent cache key leaves out names and source locations, so a program read back
    from the cache carries those of whichever test compiled the same program first (CI stores
    every program). Such a test's programs are keyed with them included: it still reads back
    its own programs from an earlier run, not another test's.
    """
    if request.node.get_closest_marker("reads_compiled_names") is None:
        yield
        return
    import jax

    before = jax.config.jax_compilation_cache_include_metadata_in_key
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_include_metadata_in_key", before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests marked heavy (over ~25 s on 2 cores) run first, the rest keep their order: under
    # -n 2 --dist loadgroup (groups of several tests first, then single tests in this order) a
    # worker that draws a heavy test last leaves the other idle for that long.
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
    import jax

    backend = jax.default_backend()
    for item in items:
        mark = item.get_closest_marker("cpu_only")
        if mark is None:
            continue
        reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else None)
        if not reason:
            raise pytest.UsageError(
                f"{item.nodeid}: cpu_only needs a reason (what is CPU-specific)"
            )
        if backend != "cpu":
            item.add_marker(pytest.mark.skip(reason=f"CPU only ({backend} backend): {reason}"))


# gradclip_jax.interop (jax_privacy, correlated_noise) and the bound of gradclip_jax.dp.audit need
# the jax-privacy extra: without it, their doctests are not collected (tests/interop and
# tests/dp/test_audit.py skip themselves); find_spec does not import it.
# The deprecation shims of moved modules hold no doctest, and collecting one would read (and
# warn about) each of its old names.
collect_ignore = [
    "gradclip_jax/ghost.py",
    "gradclip_jax/privacy.py",
    "gradclip_jax/dp/batch_selection.py",
    "gradclip_jax/dp/user_sampling.py",
]
if importlib.util.find_spec("jax_privacy") is None:
    collect_ignore += [
        "gradclip_jax/interop/jax_privacy",
        "gradclip_jax/interop/correlated_noise.py",
        "gradclip_jax/dp/audit.py",
    ]
