"""make_private's hardened option: its checks, the sampler's seed from the OS's entropy (or the
caller's generator), and the step functions of the integer grid with discrete Gaussian noise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradclip_jax.dp import hardened
from gradclip_jax.dp.accounting import PoissonSampledDiscreteGaussianEvent
from gradclip_jax.dp.hardened import (
    BitGenerator,
    add_discrete_gaussian_noise,
    add_sum_of_normals_noise,
    from_grid,
    grid_clipped_sum,
    os_seed,
)
from gradclip_jax.dp.hardened._entropy import check_generator
from gradclip_jax.dp.hardened._integer_grid import check_grid_scale
from gradclip_jax.dp.sampling.poisson import PoissonSampler
from gradclip_jax.per_example.api import ClippedGradInfo

# hardened= spellings: True is the sum of normals (any clipping method, any accountant)
_MODES = {True: "sum_of_normals", "sum_of_normals": "sum_of_normals", "discrete": "discrete"}


class Hardening(NamedTuple):
    """What ``hardened=`` decided: the mode (``None``: off), the generator, the grid."""

    mode: str | None
    rng: BitGenerator | None
    grid_scale: float | None


def hardening(fn: str, a: dict[str, Any]) -> Hardening:
    """``hardened``, ``rng``, ``grid_scale`` checked against the other arguments ``a`` of make_private.

    Raises:
      ValueError: naming the argument: an unknown mode, a ``seed`` or ``sampler`` with hardening
        (a user's seed is what hardening removes), ``rng``/``grid_scale`` without it, ``'discrete'``
        without ``grid_scale``, with ``accountant='pld'``, ``physical_batch_size`` or a ``method``.
      TypeError: naming ``rng`` when it is not a generator.
    """
    h = a["hardened"]
    if h is False or h is None:
        for name in ("rng", "grid_scale"):
            if a[name] is not None:
                raise ValueError(
                    f"{fn}: `{name}` is for hardened runs only: pass hardened=True (or 'discrete')"
                )
        return Hardening(None, None, None)
    mode = _MODES.get(h) if h is True or isinstance(h, str) else None
    if mode is None:
        raise ValueError(
            f"{fn}: `hardened` must be False, True, 'sum_of_normals' or 'discrete', got {h!r}"
        )
    if a["seed"] is not None:
        raise ValueError(
            f"{fn}: `seed` cannot be given with hardened={h!r}: the sampler's seed is drawn from "
            "the OS's entropy (or from `rng`), never from an integer you choose"
        )
    if a["sampler"] is not None:
        raise ValueError(
            f"{fn}: `sampler` cannot be given with hardened={h!r}: its seed would be yours; "
            "pass the Poisson arguments and let make_private seed the sampler from the OS"
        )
    rng = check_generator(fn, a["rng"])
    grid = None
    if mode == "discrete":
        grid = _check_discrete(fn, a)
    elif a["grid_scale"] is not None:
        raise ValueError(f"{fn}: `grid_scale` is for hardened='discrete' only")
    return Hardening(mode, rng, grid)


def _check_discrete(fn: str, a: dict[str, Any]) -> float:
    if a["grid_scale"] is None:
        raise ValueError(
            f"{fn}: hardened='discrete' needs `grid_scale` (a power of two: the grid's step is "
            "1/grid_scale, each example's integer norm at most grid_scale * l2_clip_norm)"
        )
    if str(a["accountant"]).lower() != "rdp":
        raise ValueError(
            f"{fn}: hardened='discrete' needs accountant='rdp', got accountant={a['accountant']!r}: "
            "its steps are accounted by the RDP of the subsampled discrete Gaussian (Zhu and Wang's "
            "bound on Canonne, Kamath and Steinke's), which has no privacy loss distribution here"
        )
    if a["physical_batch_size"] is not None:
        raise ValueError(
            f"{fn}: `physical_batch_size` is not supported with hardened='discrete' (its per-example "
            "gradients are rounded one batch at a time)"
        )
    if a["method"] not in ("auto", "vmap"):
        raise ValueError(
            f"{fn}: hardened='discrete' rounds each example's gradient, so `method` must be 'auto' "
            f"or 'vmap' (ghost clipping never forms them), got {a['method']!r}"
        )
    return check_grid_scale(fn, a["grid_scale"])


def sampler_seed(h: Hardening, a: dict[str, Any]) -> Any:
    """The sampler's seed: a checkpoint's (resuming a hardened run), a fresh OS seed, or the user's (default 0)."""
    if h.mode is None:
        return 0 if a["seed"] is None else a["seed"]
    resume = a["resume_from"]
    if (
        isinstance(resume, dict)
        and isinstance(resume.get("plan"), dict)
        and "seed" in resume["plan"]
    ):
        return resume["plan"]["seed"]  # the seed the interrupted run drew from the OS
    return os_seed(h.rng)


def gaussian_noise(h: Hardening) -> Callable[..., Any] | None:
    """The float noise adder of ``h`` (``None``: the default Gaussian)."""
    return add_sum_of_normals_noise if h.mode == "sum_of_normals" else None


class DiscreteGaussianSampling:
    """A Poisson sampler whose steps are accounted as ``hardened='discrete'`` runs them.

    The batches, sizes and plan are the sampler's; each step's event is
    :class:`gradclip_jax.dp.accounting.PoissonSampledDiscreteGaussianEvent` (its
    RDP bounded for the discrete Gaussian: no continuous density is assumed),
    recorded through the sampler protocol (``accounting()`` names this sampler).
    """

    def __init__(self, poisson: PoissonSampler):
        # not truncated: make_private refuses on_overflow='truncate' without PLD, and this mode is RDP's
        self.poisson = poisson

    def __getattr__(self, name: str) -> Any:  # the batches, sizes, gather and seed: the sampler's
        return getattr(self.poisson, name)

    def dp_event(self, noise_multiplier: float) -> PoissonSampledDiscreteGaussianEvent:
        return PoissonSampledDiscreteGaussianEvent(
            float(self.poisson.sample_rate), float(noise_multiplier)
        )

    def accounting(self) -> dict[str, Any]:
        return {"sampler": self}

    def plan(self) -> dict[str, Any]:
        return {**self.poisson.plan(), "mechanism": "discrete_gaussian"}


class GridFunctions(NamedTuple):
    clipped_sum: Callable[..., tuple[Any, ClippedGradInfo]]
    noise: Callable[[Any, Any, jax.Array], Any]


def grid_functions(
    loss_fn: Callable[..., Any],
    clip: float,
    grid_scale: float,
    sensitivity: float,
    z: float,
    fn: str,
) -> GridFunctions:
    """The clipped integer sum of a batch and its discrete noise (back as float32 values).

    ``sensitivity`` is the clipped sum's under the sampler's relation (:math:`C` or :math:`2C`);
    on the grid it is ``grid_scale`` times that, and the noise's sigma is ``z`` times it.
    """
    sigma = z * grid_scale * sensitivity
    if sigma > hardened.MAX_SIGMA:
        raise ValueError(
            f"{fn}: `grid_scale`={grid_scale:g} makes the noise's sigma on the grid {sigma:.4g} "
            f"(noise multiplier {z:.4g} x grid_scale x sensitivity {sensitivity:g}), above the "
            f"sampler's {hardened.MAX_SIGMA:g}: use a coarser grid_scale"
        )

    def per_example(params: Any, batch: Any) -> tuple[Any, jax.Array]:
        def one(p: Any, ex: Any) -> jax.Array:
            return loss_fn(p, jax.tree.map(lambda x: x[None], ex))[0]

        values = loss_fn(params, batch)
        return jax.vmap(jax.grad(one), in_axes=(None, 0))(params, batch), values

    def clipped_sum(params: Any, batch: Any, mask: Any) -> tuple[Any, ClippedGradInfo]:
        grads, values = per_example(params, batch)
        sums, norms = grid_clipped_sum(grads, clip, grid_scale, mask=mask, with_norms=True)
        clipped = jnp.sum(jnp.asarray(mask) & (norms > clip), dtype=jnp.int32)
        return sums, ClippedGradInfo(num_clipped=clipped, norms=norms, values=values)

    def noise(summed: Any, stddev: Any, key: jax.Array) -> Any:
        del stddev  # the float Gaussian's; the grid's sigma is above
        # constant time: the draw's duration must not tell the noise (Jin et al. 2022's timing channel)
        return from_grid(
            add_discrete_gaussian_noise(summed, sigma, key, constant_time=True), grid_scale
        )

    return GridFunctions(clipped_sum, noise)
