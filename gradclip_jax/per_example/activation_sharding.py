"""Activation sharding annotations that suit every per-example path."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from gradclip_jax.per_example._batch import in_one_example

# batch_sharding's and with_sharding_constraint's home is gradclip_jax (CONTRIBUTING.md, "Import paths")
__all__: list[str] = []


def _drop_batch_entry(spec: PartitionSpec) -> PartitionSpec:
    """``spec`` with its first (batch) entry left to ``vmap``: ``None`` on an axis of size 1."""
    return PartitionSpec(None, *tuple(spec)[1:]) if len(spec) else spec


def _per_example(sharding: Any, name: str, fn: str) -> Any:
    """``sharding`` for a batch of one; a TypeError naming ``fn`` and ``name`` if it has no spec
    to edit."""
    if isinstance(sharding, PartitionSpec):
        return _drop_batch_entry(sharding)
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, _drop_batch_entry(sharding.spec))
    raise TypeError(
        f"{fn}: {name} is a {type(sharding).__name__}; give a "
        "jax.sharding.PartitionSpec or NamedSharding, whose first entry is the batch axis"
    )


def _fitted(shardings: Any, fn: str) -> Any:
    """``shardings`` (a pytree) with each batch entry dropped where the loss runs on one example;
    every sharding checked on every path, so that a bad one fails whichever path runs."""
    is_sharding = lambda s: isinstance(s, (PartitionSpec, jax.sharding.Sharding))  # noqa: E731
    paths, treedef = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=is_sharding)
    one_example = in_one_example()

    def placed(path: Any, sharding: Any) -> Any:
        dropped = _per_example(sharding, f"shardings{jax.tree_util.keystr(path)}", fn)
        return dropped if one_example else sharding

    return jax.tree_util.tree_unflatten(treedef, [placed(p, s) for p, s in paths])


def batch_sharding(shardings: Any) -> Any:
    """The sharding of an activation whose axis 0 is the batch, as fits where the loss runs.

    For the ``out_sharding`` of an operation (``jnp.matmul``, ``jnp.einsum``, ``jnp.zeros``)
    or :func:`jax.sharding.reshard`, which under ``Explicit`` mesh axes a model must often
    state (a contraction over a model-sharded axis is refused without one): on the whole
    batch ``(B, ...)`` (the ghost path, the non-private step) ``shardings`` is returned as
    given; where the loss runs on one example under ``jax.vmap``, as a batch of one
    ``(1, ...)`` (the vmap path, ghost's per-example fallbacks and microbatch checks, the
    jax-privacy drop-in's ``fun``), the first entry of each spec is ``None`` and ``vmap``
    places the examples' axis. The other entries apply as given. A spec naming the batch's
    mesh axes on a batch of one is an error under ``Explicit`` axes ("does not evenly
    divide the dimension size 1").

    Args:
      shardings: a :class:`jax.sharding.PartitionSpec` or
        :class:`jax.sharding.NamedSharding`, or a pytree of them.

    Returns:
      ``shardings``, each with its batch entry left to ``vmap`` where the loss runs on one
      example; as given elsewhere.

    Raises:
      TypeError: a sharding that is neither a ``PartitionSpec`` nor a ``NamedSharding``
        (checked on every path, so that a bad sharding fails whichever path runs).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
      >>> def losses(w, batch):  # w's rows (the contraction) over "model"
      ...     y = jnp.matmul(batch, w, out_sharding=gcx.batch_sharding(P("data", None)))
      ...     return jnp.sum(jnp.tanh(y) ** 2, axis=1)
      >>> with jax.set_mesh(mesh):
      ...     w = jax.device_put(jnp.ones((3, 2)) / 4, P("model", None))
      ...     batch = jax.device_put(jnp.ones((4, 3)), P("data", None))
      ...     g_ghost, _ = jax.jit(gcx.clipped_grad(losses, 1.0, method="ghost"))(w, batch)
      ...     g_vmap, _ = jax.jit(gcx.clipped_grad(losses, 1.0, method="vmap"))(w, batch)
      >>> bool(jnp.allclose(g_ghost, g_vmap))
      True
    """
    return _fitted(shardings, "batch_sharding")


def with_sharding_constraint(x: Any, shardings: Any) -> Any:
    """:func:`jax.lax.with_sharding_constraint` for activations whose axis 0 is the batch.

    Written once in a model, it suits each way :func:`~gradclip_jax.clipped_grad`
    (and :func:`~gradclip_jax.make_private`) runs the model:

    * the ghost path and the non-private step run the model on the whole batch
      ``(B, ...)``: the constraint is applied as given;
    * the vmap path (and ghost's per-example fallbacks, and the jax-privacy
      drop-in's ``fun`` with ``keep_batch_dim`` on every path) run the model under
      ``jax.vmap`` on one example at a time, as a batch of one ``(1, ...)``: there
      the first entry of each spec (the batch axis) is replaced by ``None``, and
      ``vmap`` places the examples' axis itself: over ``spmd_axis_name`` when
      one is given, else where the partitioner takes the sharded batch. The
      other entries (model axes) apply as given.

    With :func:`jax.lax.with_sharding_constraint` itself, a spec that names the
    batch's mesh axes shards the one example's axis of size 1 (padded onto
    every device: several times the temporaries, and slower), is rejected by
    ``vmap`` when ``spmd_axis_name`` names the same axes, and fails as an
    assertion under ``Explicit`` mesh axes. A constraint never changes values,
    only where they live: results are the same with it, without it, and on
    one device.

    Args:
      x: an array or pytree of arrays, each with the batch on axis 0.
      shardings: a :class:`jax.sharding.PartitionSpec` or
        :class:`jax.sharding.NamedSharding`, or a pytree of them matching ``x``
        (a ``PartitionSpec`` needs a mesh in context: ``jax.set_mesh``).

    Returns:
      ``x``, constrained.

    Raises:
      TypeError: a sharding that is neither a ``PartitionSpec`` nor a ``NamedSharding``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> from jax.sharding import PartitionSpec as P
      >>> from jax.sharding import AxisType
      >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
      >>> def losses(w, batch):
      ...     h = gcx.with_sharding_constraint(jnp.tanh(batch @ w), P("data", None))
      ...     return jnp.sum(h**2, axis=1)
      >>> w, batch = jnp.ones((3, 2)) / 4, jnp.ones((4, 3))
      >>> with jax.set_mesh(mesh):
      ...     g_ghost, _ = jax.jit(gcx.clipped_grad(losses, 1.0, method="ghost"))(w, batch)
      ...     g_vmap, _ = jax.jit(gcx.clipped_grad(losses, 1.0, method="vmap"))(w, batch)
      >>> bool(jnp.allclose(g_ghost, g_vmap))
      True
    """
    return jax.lax.with_sharding_constraint(x, _fitted(shardings, "with_sharding_constraint"))
