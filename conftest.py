"""Test configuration (repo root, so it runs before anything imports jax).

Sets 8 simulated CPU devices for the sharding tests.

XLA reads the device count once, when jax is first imported, so it is set here,
before any test module imports jax.
"""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "default", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.register_profile("thorough", max_examples=400, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
