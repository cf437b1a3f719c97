"""The sharded tests' token model and its FSDP placement (test_sharded_vmap,
test_activation_sharding): a two-layer model whose activations, as in a language model,
outweigh its parameters, placed on a ``("data", "fsdp")`` mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

BATCH, SEQ, WIDTH, HIDDEN = 24, 32, 16, 64
ROWS = ("data", "fsdp")


def token_model(
    annotate: Callable[[jax.Array], jax.Array] = lambda h: h, nan_example: int | None = None
) -> tuple[Callable, dict, dict]:
    """``(losses, params, data)``: per-example losses (a mean over tokens) of a two-layer model
    whose hidden activation ``(B, T, HIDDEN)`` goes through ``annotate``; with ``nan_example``,
    that example has a NaN input (a non-finite gradient)."""
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (WIDTH, HIDDEN)) / 4,
        "b1": jnp.zeros((HIDDEN,)),
        "w2": jax.random.normal(k[1], (HIDDEN, WIDTH)) / 8,
    }
    x = jax.random.normal(k[2], (BATCH, SEQ, WIDTH))
    if nan_example is not None:
        x = x.at[nan_example, 3, 1].set(jnp.nan)
    data = {"x": x, "y": jax.random.normal(k[3], (BATCH, SEQ, WIDTH))}

    def losses(p, b):
        h = annotate(jnp.tanh(b["x"] @ p["w1"] + p["b1"]))
        return jnp.mean((h @ p["w2"] - b["y"]) ** 2, axis=(1, 2))

    return losses, params, data


def mesh_of(shape: tuple[int, int], axis_types: Any = None) -> Mesh:
    """A ``("data", "fsdp")`` mesh of the first devices."""
    devices = np.asarray(jax.devices()[: shape[0] * shape[1]]).reshape(shape)
    return Mesh(devices, ROWS, axis_types=axis_types)


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """The largest axis ``fsdp`` divides, over ``'fsdp'`` (else replicated)."""
    axes = [i for i in sorted(range(len(shape)), key=lambda i: -shape[i]) if shape[i] % fsdp == 0]
    if fsdp == 1 or not axes:
        return P()
    return P(*["fsdp" if i == axes[0] else None for i in range(len(shape))])


def fsdp_placed(mesh: Mesh, params: Any, data: Any) -> tuple[Any, Any]:
    """Every parameter leaf FSDP-style (:func:`fsdp_spec`), the batch over both mesh axes."""
    fsdp = mesh.shape["fsdp"]
    return (
        jax.tree.map(
            lambda x: jax.device_put(x, NamedSharding(mesh, fsdp_spec(x.shape, fsdp))), params
        ),
        jax.device_put(data, NamedSharding(mesh, P(ROWS))),
    )
