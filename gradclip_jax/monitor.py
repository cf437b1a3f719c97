"""Reading what the transforms measured out of an optimizer state, for logging.

Every norm-based transform records the pre-clip norm under the state field
``norm`` (and the adaptive ones the threshold under ``clip_norm`` and the event
under ``clipped``). :func:`norms_from_state` collects such a field from
anywhere in an optimizer state (an ``optax.chain`` with several clippers,
``optax.multi_transform``, ``optax.masked``, ``inject_hyperparams``, a flax
``nnx.Optimizer``'s ``opt_state`` or its ``nnx.State``), keyed by where it was found, so it works
where ``optax.tree_utils.tree_get(state, 'norm')`` raises because the name
occurs more than once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from gradclip_jax._core.state_registry import STATE_CLASSES

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


def _is_variable(x: Any) -> bool:
    """A flax ``nnx.Variable`` (``OptArray``/``OptState`` in ``nnx.Optimizer.opt_state``)."""
    return type(x).__module__.startswith("flax.") and (
        hasattr(x, "get_value") or hasattr(type(x), "value")
    )


def _unwrap(x: Any) -> Any:
    if not _is_variable(x):
        return x
    return x.get_value() if hasattr(x, "get_value") else x.value


def _state_field_sets(field: str) -> list[frozenset[str]]:
    """The field names of every registered gradclip_jax state class that has ``field``."""
    return [frozenset(cls._fields) for cls in STATE_CLASSES if field in cls._fields]  # type: ignore[attr-defined]


def _is_state_mapping(x: Any, field: str, known: list[frozenset[str]]) -> bool:
    """A mapping that stands for one of our states: what flax ``nnx.State`` makes of a NamedTuple.

    ``nnx.state(optimizer)`` and ``nnx.split`` turn each NamedTuple state into a
    mapping from field name to value (dropping fields that hold ``None``). A
    mapping holding ``field`` (and the step ``count``, never ``None``) whose
    keys all belong to one gradclip_jax state is taken for that state; a
    parameter-shaped tree (adam's ``mu`` of a model with a layer named
    ``norm``) has other keys and is not.
    """
    if not isinstance(x, Mapping) or field not in x:
        return False
    keys = set(x.keys())
    return all(isinstance(k, str) for k in keys) and any(
        keys <= fields and ("count" in keys or "count" not in fields) for fields in known
    )


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

    Under flax NNX the state can come in two forms. ``optimizer.opt_state``
    keeps optax's NamedTuples: keys as above (``'0/norm'``). ``nnx.state(optimizer)``,
    ``nnx.state(optimizer, nnx.OptState)`` and ``nnx.split(optimizer)[1]`` are
    ``nnx.State`` objects, in which every NamedTuple has become a mapping from
    field name to value, under the optimizer's attribute ``opt_state``: there a
    mapping whose keys are the fields of a gradclip_jax state (those that do
    not hold ``None``) counts as that state, and the keys carry the
    ``opt_state`` prefix (``'opt_state/0/norm'``,
    ``'opt_state/1/norm/kernel'``). The states of other libraries are found
    only in the NamedTuple form.

    Args:
      state: an optimizer state, a flax ``nnx.Optimizer``'s ``opt_state``, or
        an ``nnx.State`` of the optimizer.
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
    known = _state_field_sets(field)

    def stop(x: Any) -> bool:
        return _is_variable(x) or _has_field(x, field) or _is_state_mapping(x, field, known)

    def visit(node: Any, prefix: tuple) -> None:
        pairs, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=stop)
        for path, leaf in pairs:
            full = prefix + tuple(path)
            if _has_field(leaf, field):
                names, get, key = (
                    leaf._fields,
                    lambda n, s=leaf: getattr(s, n),
                    jax.tree_util.GetAttrKey,
                )
            elif _is_state_mapping(leaf, field, known):
                names, get, key = tuple(leaf.keys()), lambda n, s=leaf: s[n], jax.tree_util.DictKey
            else:
                continue
            inner, _ = jax.tree_util.tree_flatten_with_path(get(field), is_leaf=_is_variable)
            base = (*full, key(field))
            for p, value in inner:
                out[jax.tree_util.keystr(base + tuple(p), simple=True, separator="/")] = _unwrap(
                    value
                )
            # other fields (an inner_state) may hold further recorded norms
            for name in names:
                if name != field:
                    visit(get(name), (*full, key(name)))

    visit(state, ())
    return out
