"""Reading what the transforms measured out of an optimizer state, for logging.

Every norm-based transform records the pre-clip norm under the state field
``norm`` (and the adaptive ones the threshold under ``clip_norm`` and the event
under ``clipped``). :func:`norms_from_state` collects such a field from
anywhere in an optimizer state (an ``optax.chain`` with several clippers,
``optax.multi_transform``, ``optax.masked``, ``inject_hyperparams``, a flax
``nnx.Optimizer``'s ``opt_state``), keyed by where it was found, so it works
where ``optax.tree_utils.tree_get(state, 'norm')`` raises because the name
occurs more than once.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["norms_from_state"]


def _is_variable(x: Any) -> bool:
    """A flax ``nnx.Variable`` (``OptArray``/``OptState`` in ``nnx.Optimizer.opt_state``)."""
    return type(x).__module__.startswith("flax.") and (hasattr(x, "get_value") or hasattr(type(x), "value"))


def _unwrap(x: Any) -> Any:
    if not _is_variable(x):
        return x
    return x.get_value() if hasattr(x, "get_value") else x.value


def _has_field(x: Any, field: str) -> bool:
    return isinstance(x, tuple) and field in getattr(x, "_fields", ())


def norms_from_state(state: Any, field: str = "norm") -> dict[str, jax.Array]:
    """Every ``field`` recorded in an optimizer state, keyed by its path.

    Walks ``state`` (any pytree of optax states) and returns one entry per array
    found under a state field named ``field``: a global norm gives one entry
    (``'0/norm'`` for the first transform of a chain), a per-leaf norm tree one
    entry per leaf (``'0/norm/layer/w'``). Keys are the pytree paths joined with
    ``'/'``; their order follows the state. flax ``nnx`` variables (the
    ``OptArray`` wrappers of ``nnx.Optimizer.opt_state``) are unwrapped, so the
    values are plain arrays either way. Works under ``jit``.

    Args:
      state: an optimizer state (or a flax ``nnx.Optimizer``'s ``opt_state``).
      field: the state field to collect: ``'norm'`` (default; the pre-clip
        norm), ``'clip_norm'`` (the threshold in force) or ``'clipped'``.

    Returns:
      A dict from path to array (empty when no state has the field).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import gradclip_jax as gcx
      >>> tx = optax.chain(gcx.clip_by_global_norm(1.0), gcx.zclip(), optax.sgd(0.1))
      >>> params = {'w': jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> _, state = tx.update({'w': jnp.array([3.0, 4.0])}, state, params)
      >>> {k: float(v) for k, v in gcx.norms_from_state(state).items()}
      {'0/norm': 5.0, '1/norm': 1.0}
    """
    if not isinstance(field, str):
        raise TypeError(f"norms_from_state: `field` must be a string, got {field!r}")
    out: dict[str, jax.Array] = {}

    def stop(x: Any) -> bool:
        return _is_variable(x) or _has_field(x, field)

    def visit(node: Any, prefix: tuple) -> None:
        pairs, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=stop)
        for path, leaf in pairs:
            full = prefix + tuple(path)
            if not _has_field(leaf, field):
                continue
            inner, _ = jax.tree_util.tree_flatten_with_path(getattr(leaf, field), is_leaf=_is_variable)
            base = (*full, jax.tree_util.GetAttrKey(field))
            for p, value in inner:
                out[jax.tree_util.keystr(base + tuple(p), simple=True, separator="/")] = _unwrap(value)
            # other fields (an inner_state) may hold further recorded norms
            for name in leaf._fields:
                if name != field:
                    visit(getattr(leaf, name), (*full, jax.tree_util.GetAttrKey(name)))

    visit(state, ())
    return out
