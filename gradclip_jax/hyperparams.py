"""Hyperparameters: validation at construction, resolution at update time.

Every numeric hyperparameter of a gradclip_jax transform (``max_norm``, ``threshold``,
``beta``, ...) may be

* a Python number or a concrete array: checked when the transform is built, so a
  bad value raises ``ValueError`` naming the argument before any training starts;
* a traced array (for example under :func:`optax.inject_hyperparams` or when the
  transform is built inside ``jax.jit``): accepted as is, since it cannot be
  inspected;
* a schedule ``step -> value``: evaluated at the transform's own step counter.

Structural arguments (``ord``, ``dim``, ``min_size``, ``axis``) decide shapes and
which code runs, so they must be Python values. :func:`inject_hyperparams` wraps
:func:`optax.inject_hyperparams` and marks them static automatically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import optax

from gradclip_jax._core.hyperparam_rules import Hyperparam

__all__ = [
    "Hyperparam",
]


def inject_hyperparams(
    inner_factory: Callable[..., optax.GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: Any = None,
) -> Callable[..., optax.GradientTransformationExtraArgs]:
    """:func:`optax.inject_hyperparams` that knows gradclip_jax's structural args.

    optax turns every numeric argument (``ord=2``, ``min_size=1``, ...) into an
    array held in the state, but those arguments decide shapes and code paths and
    cannot be traced. This wrapper adds the factory's structural arguments
    (listed in its ``static_args`` attribute) to ``static_args``; everything else
    behaves exactly as in optax.

    Args:
      inner_factory: a gradclip_jax (or any optax) transform factory.
      static_args: further arguments to keep static.
      hyperparam_dtype: as in :func:`optax.inject_hyperparams`.

    Returns:
      A factory with the same arguments whose state exposes the numeric
      hyperparameters under ``state.hyperparams``.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.inject_hyperparams(gcx.clip_by_norm)(max_norm=1.0, ord=2)
      >>> state = tx.init({'w': jnp.ones(3)})
      >>> state.hyperparams['max_norm'] = jnp.asarray(0.5)
      >>> out, _ = tx.update({'w': jnp.ones(3)}, state)
      >>> round(float(jnp.linalg.norm(out['w'])), 4)
      0.5
    """
    extra = {static_args} if isinstance(static_args, str) else set(static_args)
    known = set(getattr(inner_factory, "static_args", ()))
    return optax.inject_hyperparams(
        inner_factory,
        static_args=tuple(sorted(extra | known)),
        hyperparam_dtype=hyperparam_dtype,
    )
