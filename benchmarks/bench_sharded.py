"""Benchmark: the Llama decoder's DP steps sharded FSDP-style on 8 simulated CPU devices (compiled, not run).

The model is :func:`benchmarks.models.llama` (2 layers of width 128, 4 heads, 2 kv-heads,
vocabulary 256; blocks under ``nnx.remat`` in an ``nnx.scan``), B=8 at T=512 (``--quick``:
T=128), full fine-tuning. On each mesh ``(data, fsdp)`` of 8x1, 2x4 and 1x8 devices, every
parameter and its adamw moments are sharded over ``fsdp`` on their largest axis that it divides
(FSDP), and the batch over both axes. The steps are those of :mod:`benchmarks.cost_llama`
(``nonprivate``, ``ghost``, ``vmap``: noise, adamw, state donated; ``nonprivate_noise``, the
non-private step with the same noise, says what the noise alone costs), jitted with the shardings
read from their inputs. Rows: each DP step's per-device temporaries
(``memory_analysis()`` of the SPMD program) against the non-private step's, and the all-gathers
in its compiled HLO against the non-private step's. On the 2x4 mesh the model runs twice more
with its residual stream placed over both axes, by ``gcx.with_sharding_constraint`` and by
``jax.lax.with_sharding_constraint`` (rows ``2x4 gcx-annotated`` and ``2x4 lax-annotated``, each
against the non-private step with the same annotation): jax's shards the vmap path's batch of one.

The devices are simulated (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), which must be
set before JAX starts: with fewer devices :func:`run` measures in a process of its own.
Run alone: ``python -m benchmarks.bench_sharded [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any

DEVICES = 8
MESHES = ((8, 1), (2, 4), (1, 8))  # (data, fsdp)
# nonprivate_noise: the non-private step with the DP steps' noise, the share of the noise alone
STEPS = ("nonprivate", "ghost", "vmap", "nonprivate_noise")
GROUP = "sharded"
BATCH = 8
_ALL_GATHER = re.compile(r"\ball-gather(?:-start)?\(")
# The model's residual stream placed by gcx.with_sharding_constraint or by jax.lax's: the rows
# "2x4 gcx-annotated" / "2x4 lax-annotated" (jax.lax's shards the vmap path's batch of one).
ANNOTATIONS = ("gcx", "lax")


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> Any:
    """The leaf's PartitionSpec: its largest axis that ``fsdp`` divides over ``'fsdp'``, else replicated."""
    from jax.sharding import PartitionSpec as P

    axes = [
        i
        for i in sorted(range(len(shape)), key=lambda i: -shape[i])
        if shape[i] % fsdp == 0 and shape[i] > 1
    ]
    if fsdp == 1 or not axes:
        return P()
    return P(*["fsdp" if i == axes[0] else None for i in range(len(shape))])


def place(state: Any, data: Any, mesh: Any) -> tuple[Any, Any]:
    """``state`` sharded FSDP-style and ``data`` over both mesh axes, on ``mesh``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    fsdp = mesh.shape["fsdp"]
    state = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, fsdp_spec(x.shape, fsdp))), state
    )
    data = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp")))), data)
    return state, data


def annotation(kind: str, mesh: Any) -> Any:
    """The residual stream ``(B, T, d)`` placed over both mesh axes by ``gcx.with_sharding_constraint``
    (``kind`` ``'gcx'``) or by ``jax.lax.with_sharding_constraint`` (``'lax'``)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import gradclip_jax as gcx

    rows = NamedSharding(mesh, P(("data", "fsdp"), None, None))
    constrain = {"gcx": gcx.with_sharding_constraint, "lax": jax.lax.with_sharding_constraint}[kind]
    return lambda h: constrain(h, rows)


def measure_mesh(
    shape: tuple[int, int], seq: int, cfg: Any = None, annotate: str | None = None
) -> dict[str, dict[str, float]]:
    """Per step: per-device temporaries (MiB), all-gathers and all-reduces of the program compiled
    on the mesh (``cfg``: a :class:`~benchmarks.models.LlamaConfig`, by default the suite's at ``seq``;
    ``annotate``: the model's residual stream placed, see :func:`annotation`)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from benchmarks.models import LlamaConfig, llama
    from benchmarks.steps import fresh_state
    from benchmarks.variants import make_steps

    mesh = Mesh(np.asarray(jax.devices()[:DEVICES]).reshape(shape), ("data", "fsdp"))
    cfg = LlamaConfig(seq=seq) if cfg is None else cfg
    if annotate is not None:
        cfg = cfg._replace(activations=annotation(annotate, mesh))
    losses, params, data = llama(0, BATCH, cfg)
    out = {}
    for name, step in make_steps(losses, BATCH, STEPS).items():
        state, batch = place(fresh_state(params, 0), data, mesh)
        compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
        text = compiled.as_text()
        out[name] = {
            "temporaries": compiled.memory_analysis().temp_size_in_bytes / 2**20,
            "all_gathers": len(_ALL_GATHER.findall(text)),
            "all_reduces": len(re.findall(r"\ball-reduce(?:-start)?\(", text)),
        }
    return out


def rows_of(results: dict[str, dict[str, dict[str, float]]], seq: int) -> list[dict]:
    """Rows of :func:`measure_mesh` per mesh: temporaries and all-gathers, each DP step vs non-private."""
    from benchmarks.common import row

    rows = []
    for mesh, res in results.items():
        base = res["nonprivate"]
        note = (
            f"Llama nnx 2x128, T={seq}, B={BATCH}, full, scan+remat, float32, FSDP params on {mesh} "
            f"(data x fsdp) of {DEVICES} simulated CPU devices; all-reduces: "
            + ", ".join(f"{k} {v['all_reduces']}" for k, v in res.items())
        )
        for step in [s for s in res if s != "nonprivate"]:
            for key, title, unit in (
                ("temporaries", "per-device temporaries", "MiB"),
                ("all_gathers", "all-gathers in the compiled HLO", "count"),
            ):
                rows.append(
                    row(
                        GROUP,
                        f"llama sharded {mesh} {step} DP step vs non-private step: {title} "
                        f"({unit}, in the ms columns)",
                        res[step][key],
                        base[key],
                        note,
                        unit=unit,
                        measure=key,
                        step=step,
                        mesh=mesh,
                    )
                )
    return rows


def measure(quick: bool) -> tuple[dict[str, Any], int]:
    """Every mesh's results (needs :data:`DEVICES` devices in this process) and the sequence length."""
    seq = 128 if quick else 512
    res = {f"{d}x{f}": measure_mesh((d, f), seq) for d, f in MESHES}
    for kind in ANNOTATIONS:  # one mesh with FSDP and data axes is enough to show the difference
        res[f"2x4 {kind}-annotated"] = measure_mesh((2, 4), seq, annotate=kind)
    return res, seq


def run(quick: bool = False) -> list[dict]:
    """The rows, measured here when this process has 8 devices, else in a process of its own."""
    import jax

    if jax.device_count() >= DEVICES and jax.default_backend() == "cpu":
        return rows_of(*measure(quick))
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}",
    )
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_sharded",
        "--json",
        *(["--quick"] if quick else []),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return rows_of(*json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="T=128")
    parser.add_argument(
        "--json", action="store_true", help="print the measurements as one JSON line"
    )
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.quick)))
        return
    for r in run(quick=args.quick):
        print(f"{r['name']}: {r['ours_ms']:.4g} vs {r['baseline_ms']:.4g} = {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
