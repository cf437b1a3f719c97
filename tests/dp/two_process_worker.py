"""One process of the two-process private-step test (tests/dp/test_private_step.py).

Usage: ``python dp_two_process_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz``.
Each process runs ``jax.distributed.initialize`` on localhost (CPU collectives
through gloo, 2 CPU devices per process), takes its piece of every Poisson batch
from the shared sampler, builds the global batch with
``jax.make_array_from_process_local_data`` and runs a few jitted private steps;
each process saves its (replicated) final parameters.

Importing this module does nothing (pytest imports it for doctests): jax is
imported and configured in :func:`main` only.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"localhost:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60
    )
    # the repository root (this file is in tests/dp/), so `tests` imports as a package
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, root)
    from tests.dp.setup_two_process import STEPS, build, data, run_steps

    assert jax.process_count() == nproc and jax.device_count() == 2 * nproc
    priv = build(process_index=jax.process_index(), process_count=jax.process_count())
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    rows = NamedSharding(mesh, P("x"))

    def to_global(batch: dict, mask: np.ndarray) -> tuple:
        g = {k: jax.make_array_from_process_local_data(rows, v) for k, v in batch.items()}
        return g, jax.make_array_from_process_local_data(rows, mask)

    with jax.set_mesh(mesh):
        params = run_steps(priv, data(), to_global, STEPS, replicated=NamedSharding(mesh, P()))
    # every process holds the same (replicated) parameters: each saves its copy
    np.savez(
        out,
        **{f"{i}_{k}": np.asarray(v) for i, layer in enumerate(params) for k, v in layer.items()},
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
