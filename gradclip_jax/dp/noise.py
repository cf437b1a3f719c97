"""Gaussian noise for DP-SGD: the one place noise is drawn and added."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core import jaxcompat, norms as _norms
from gradclip_jax._core.backend import per_backend
from gradclip_jax.dp.philox import philox_normal
from gradclip_jax.per_example.internal import explicit_spec

__all__ = [
    "NOISE_BLOCK_SIZE",
    "NOISE_STRATEGY",
    "add_gaussian_noise",
    "noised_leaves",
    "split_stored",
]

# Per backend, how :func:`add_gaussian_noise` draws the noise of a tree:
#
# * ``"leaves"``: one ``jax.random.normal`` per leaf. On GPU and TPU JAX lowers
#   threefry unrolled, so XLA fuses each leaf's draw and addition into one kernel
#   that writes the output and nothing else.
# * ``"blocks"``: one loop over fixed-size blocks of one flat draw for all leaves,
#   element ``p`` from threefry's hash of the counter ``p`` (with JAX's default
#   partitionable threefry, ``jax.random.normal(key, (n,))``'s draw), so no block
#   derives a key: each key derivation hashes another shape, a program of its own
#   (about ten kernels on the CPU, in every DP step). JAX lowers threefry on CPU as a
#   rolled loop whose state is as large as the draw: per-leaf draws compile one
#   such loop per leaf and hold two uint32 copies of every leaf, where the blocked
#   draw compiles one loop and holds the flat draw alone, at the same speed.
#   Each leaf reads its span of the draw at an offset the compiler cannot see
#   (:func:`_spans_added`), so equal-shaped leaves share their kernels, the
#   optimizer's too: the DP step of ``benchmarks/bench_compile.py`` compiles in
#   about 0.5 s less on the CPU. (Asked for on a GPU, the branch's predicate is
#   read on the host once a step.)
# * ``"shapes"``: the draws of ``"leaves"`` (the same keys and random bits), but
#   made once per distinct shape and real dtype: the keys of the leaves of one
#   shape are stacked and drawn by one vmapped ``jax.random.normal`` (each key's
#   draw under vmap is the one it gives alone). A transformer's leaves have few
#   distinct shapes, so the compiler sees fewer, larger fusions, at the price of
#   the draws being stored before they are added: each group's draw sits behind
#   a barrier, so a GPU compiles one draw kernel per group instead of copying the
#   draw's code into each leaf's kernel, and waits for its leaves
#   (:func:`_once_ready`), so the temporaries stay those of ``"leaves"``.
#   The GPU default: read as a GPU compiles it, the GPT-2 small DP step has half
#   the HLO instructions of ``"leaves"`` (1.97x the non-private step's instead of
#   4.22x), the same temporaries and about 3% more bytes accessed (the stored
#   draw's write and read; ``benchmarks/results/MEASUREMENTS.md``).
#   ``benchmarks/bench_cost.py`` counts the programs' instructions and
#   ``benchmarks/bench_ghost_gpu.py``'s ``ghost_noise_leaves`` step times the
#   per-leaf draw against it on GPUs.
# * ``"philox"``: one draw per leaf as ``"leaves"``, but a float32 leaf's bits
#   come from the Philox4x32-10 generator (:mod:`gradclip_jax.dp.philox`, keyed
#   by 64 bits of the leaf's key) instead of threefry2x32-20: about half the
#   integer work per bit, for the same statistical quality. Other dtypes draw
#   as ``"leaves"``. Opt-in, for one device: XLA:CPU (jax 0.11) fails to compile
#   its ``lax.mulhi`` in a program partitioned over several devices ("Unable to
#   convert MHLO to StableHLO"), a loud error, not a wrong draw.
#
# Whatever the strategy, each noised leaf is stored before it is used
# (:func:`_stored`): its draw runs once, not once per reader. Leaves whose
# type carries an explicit sharding are drawn one per leaf with threefry on
# every backend, so each device draws only its own shard. Backends
# not listed draw per leaf. ``benchmarks/bench_noise.py`` compares ours with
# optax's per-leaf draw; the figures are in ``benchmarks/results/MEASUREMENTS.md``.
NOISE_STRATEGY = {"cpu": "blocks", "gpu": "shapes"}
_NOISE_STRATEGIES = ("leaves", "blocks", "shapes", "philox")
# Elements per block of the blocked draw (4 bytes each in float32).
NOISE_BLOCK_SIZE = 1 << 18
# The largest flat draw whose spans are read at offsets XLA cannot see (int32 offsets).
_OFFSET_MAX = int(np.iinfo(np.int32).max)
# At most this many elements in one stored draw of the "shapes" strategy (256 MiB in float32).
_SHAPES_DRAW_MAX = 1 << 26


def _noise_strategy() -> str:
    return per_backend(
        NOISE_STRATEGY, "gradclip_jax.dp.noise.NOISE_STRATEGY", "leaves", _NOISE_STRATEGIES
    )


def add_gaussian_noise(tree: Any, stddev: Any, key: jax.Array) -> Any:
    """Adds independent :math:`\\mathcal{N}(0, \\sigma^2)` noise to every element.

    Noise is drawn and added in float32 at least (the accumulation dtype of each
    leaf), and the result keeps that dtype: round it yourself after dividing by
    the batch size. A complex leaf gets :math:`\\sigma (z_1 + i z_2)`: its real
    and imaginary parts are both coordinates the clip norm bounds, so each gets
    the full variance.

    The draw: ``k0, k1, ..., kn = jax.random.split(key, n + 1)`` for the ``n``
    leaves. Per backend (:data:`NOISE_STRATEGY`, read when the function is
    traced), leaf ``i`` gets ``jax.random.normal(k{i+1}, ...)`` (TPU: drawn
    inside the addition; GPU: the same draws, made once per distinct leaf shape
    with ``"shapes"``), or (CPU, ``"blocks"``) the leaves are laid end to end,
    grouped by real dtype in order of first appearance, and element ``p`` of that
    line gets ``jax.random.normal``'s draw from threefry's hash of the counter
    ``p`` under ``k`` (with JAX's default partitionable threefry exactly
    ``jax.random.normal(k, (N,), dtype)[p]``), where ``k`` is ``key`` itself when
    every leaf is drawn so, else ``k0``. It is drawn in blocks of
    :data:`NOISE_BLOCK_SIZE` elements: one compiled loop for any number of
    leaves, no key derived per block, and no temporaries beyond the noise. Either
    way every element gets its own standard normal draw, and the same key gives
    the same noise on the same backend. ``"shapes"`` makes the per-leaf draws
    (the same bits) once per distinct leaf shape. With ``"philox"``, a float32 leaf ``i``
    gets ``philox_normal(k{i+1}, ...)`` (:mod:`gradclip_jax.dp.philox`): the same
    distribution from the Philox4x32-10 generator, cheaper to draw.
    An explicitly sharded leaf is always drawn on its own with threefry, so each
    device draws only its shard. Each noised leaf is returned behind an
    optimization barrier: the compiler stores it once rather than repeating its
    draw in every kernel that reads it (an optimizer such as adamw reads its
    gradient in several).

    Args:
      tree: a pytree of floating-point arrays (e.g. the sum from ``clipped_grad``).
      stddev: :math:`\\sigma \\ge 0`.
      key: a ``jax.random`` key.

    Returns:
      The noised tree.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradclip_jax.dp.noise import add_gaussian_noise
      >>> noisy = add_gaussian_noise({'w': jnp.zeros(3)}, 1.0, jax.random.key(0))
      >>> noisy['w'].shape
      (3,)
    """
    flat = _norms.flatten(tree, "add_gaussian_noise")
    arrays = [x.astype(_norms.sum_dtype(x.dtype)) for x in flat.arrays]
    if not arrays:
        return tree
    check_key_varies(
        "add_gaussian_noise",
        arrays,
        key,
        [jax.tree_util.keystr(flat.paths[i]) for i in flat.active],
    )
    strategy = _noise_strategy()
    blocked = strategy == "blocks"
    philox = strategy == "philox"
    out: list[Any] = [None] * len(arrays)
    by_dtype: dict[np.dtype, list[int]] = {}
    single: list[int] = []
    for i, x in enumerate(arrays):
        if blocked and explicit_spec(x) is None:
            by_dtype.setdefault(_real(x.dtype), []).append(i)
        else:
            single.append(i)
    # the leaves' keys k1..kn only where some leaf is drawn on its own: each hash of another shape
    # is a dozen kernels of its own on the CPU, and the blocks hash counters under the key itself
    keys: list[jax.Array] = []
    block_key = key
    if single:
        block_key, *keys = split_stored(key, len(arrays) + 1)
    if strategy == "shapes":
        for i, y in _noised_by_shape(arrays, keys, single, stddev).items():
            out[i] = y
        single = [i for i in single if out[i] is None]
    drawn = noised_leaves(
        [arrays[i] for i in single], [keys[i] for i in single], stddev, philox=philox
    )
    for i, y in zip(single, drawn, strict=True):
        out[i] = y
    start = 0  # each real dtype's leaves take the next span of the counters
    for dtype, idx in by_dtype.items():
        group = [arrays[i] for i in idx]
        for i, y in zip(idx, _blocked_noise(group, block_key, stddev, dtype, start), strict=True):
            out[i] = y
        start += sum(map(_draws, group))
    return flat.rebuild(out)


def check_key_varies(
    fn: str, arrays: Sequence[Any], key: Any, paths: Sequence[str] | None = None
) -> None:
    """Raises when a leaf is a per-device shard (inside ``shard_map``) and the key is the same on every device.

    Every device would then draw the same noise for its own shard: the shards'
    noise would be one draw repeated, and the difference of two shards would
    carry none, so the Gaussian mechanism's guarantee would not hold.
    """
    keyed = jaxcompat.varying_axes(key)
    for i, x in enumerate(arrays):
        extra = jaxcompat.varying_axes(x) - keyed
        if extra:
            axes = tuple(sorted(extra))
            where = f"leaf {paths[i]}" if paths is not None else f"leaf {i}"
            raise ValueError(
                f"{fn}: {where} differs across the manual mesh axes {axes} (a shard inside shard_map) but "
                "the noise key does not, so every device would add the same noise to its shard and the "
                "differences between shards would carry no noise. If the leaf is each device's partial "
                f"sum of a data-parallel batch, jax.lax.psum(..., {axes}) it first and add the noise once, "
                "to the total (then the same key on every device is right: one draw, replicated; noising "
                "each partial sum would add the noise once per device). If each device holds its own part "
                f"of the leaf, give each device its own key, e.g. key = jax.random.fold_in(key, "
                f"jax.lax.axis_index({axes[0]!r})). Or add the noise outside shard_map (under jax.jit on "
                "the global array)"
            )


def _real(dtype: Any) -> np.dtype:
    """The real dtype of ``dtype`` (``complex64 -> float32``; real dtypes unchanged)."""
    return np.dtype(jnp.finfo(dtype).dtype)


def _draws(x: jax.Array) -> int:
    """Real draws for ``x``: one per element, two for a complex one (real and imaginary part each
    get the full variance)."""
    return int(x.size) * (2 if jnp.iscomplexobj(x) else 1)


def _shaped(z: jax.Array, x: jax.Array) -> jax.Array:
    """``_draws(x)`` standard normal draws as an array like ``x``."""
    if jnp.iscomplexobj(x):
        z = jnp.reshape(z, (2, *x.shape))
        return lax.complex(z[0], z[1])
    return jnp.reshape(z, x.shape)


def _blocked_noise(
    arrays: Sequence[jax.Array], key: jax.Array, stddev: Any, dtype: np.dtype, start: int
) -> list[jax.Array]:
    """``x + stddev * N(0, 1)`` for ``arrays`` (all of ``dtype``) laid end to end from counter
    ``start`` on, drawn in blocks.

    One ``lax.map`` over the blocks: its state is one block, not the whole draw,
    and it compiles once however many leaves there are. A block hashes its
    counters under ``key`` itself (:func:`_counter_normals`): deriving a key per
    block would compile threefry a second time for the key's shape, about ten
    kernels on the CPU. Each leaf then reads its span of the flat draw
    (:func:`_spans_added`).
    """
    total = sum(map(_draws, arrays))
    if total == 0:
        return list(arrays)
    size = min(NOISE_BLOCK_SIZE, total)
    first = start + size * np.arange(-(-total // size), dtype=np.uint64)  # each block's counter
    words = _key_words(key)

    def block(first_counter: tuple[jax.Array, jax.Array]) -> jax.Array:
        return _counter_normals(words, *first_counter, size, dtype)

    hi, lo = (first >> np.uint64(32)).astype(np.uint32), first.astype(np.uint32)
    z = jnp.reshape(lax.map(block, (jnp.asarray(hi), jnp.asarray(lo))), (-1,))
    return [_stored(y) for y in _spans_added(arrays, z, jnp.asarray(stddev, dtype))]


def _key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two uint32 words of a threefry ``key`` (typed, or raw under JAX's default
    implementation); another implementation's key gives two words of its own random bits."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if str(jax.random.key_impl(key)) == "threefry2x32":
        data = jax.random.key_data(key)
    else:
        data = jax.random.bits(key, (2,), jnp.uint32)
    return data[..., 0], data[..., 1]


def _counter_normals(
    key: tuple[jax.Array, jax.Array], hi: jax.Array, lo: jax.Array, size: int, dtype: np.dtype
) -> jax.Array:
    """Standard normals for the ``size`` 64-bit counters from ``(hi, lo)`` on: element ``i`` is
    ``jax.random.normal``'s transform of threefry's hash of counter ``hi * 2**32 + lo + i`` under
    ``key``, as JAX's partitionable threefry draws element ``i`` of a flat array (its bits: the
    hash's two words xor-ed for 32-bit floats, joined for 64-bit ones; then a uniform in
    ``[nextafter(-1, 0), 1)`` and ``sqrt(2) * erfinv``)."""
    low = lo + lax.iota(jnp.uint32, size)
    words = jaxcompat.threefry2x32(key, (hi + (low < lo).astype(jnp.uint32), low))
    info = jnp.finfo(dtype)
    if info.bits == 64:
        bits = lax.shift_left(words[0].astype(jnp.uint64), jnp.uint64(32)) | words[1]
    else:
        bits = words[0] ^ words[1]
    one = jnp.asarray(np.array(1.0, dtype).view(bits.dtype))
    mantissa = lax.shift_right_logical(bits, jnp.asarray(info.bits - info.nmant, bits.dtype))
    unit = lax.bitcast_convert_type(mantissa | one, dtype) - np.array(1.0, dtype)
    floor = np.nextafter(np.array(-1.0, dtype), np.array(0.0, dtype))
    uniform = lax.max(floor, unit * (np.array(1.0, dtype) - floor) + floor)
    return lax.mul(jnp.asarray(np.sqrt(2), dtype), lax.erf_inv(uniform))


def _spans_added(arrays: Sequence[jax.Array], z: jax.Array, std: jax.Array) -> list[jax.Array]:
    """``x + std * z[start:start + n]`` for each of ``arrays`` laid end to end in the flat ``z``,
    each span read at an offset the compiler cannot see.

    XLA compiles one kernel for each distinct fused computation and reuses it for
    equal ones: compile time follows the distinct kernels. A span read at a
    constant offset makes each leaf's addition a kernel of its own, and on the
    CPU (where an optimization barrier does not hold through fusion) every
    optimizer kernel the addition is fused into too: adamw's three kernels per
    leaf, reused across equal-shaped leaves without noise, become three per leaf
    (:mod:`benchmarks.bench_compile`). So the additions run in one conditional
    branch, whose operands are values to its code: the offsets and the
    predicate pass an optimization barrier first, which XLA does not fold
    through, so the branch is kept and equal-sized leaves share one kernel; its
    results are buffers of their own, so the optimizer's kernels for
    equal-shaped leaves stay one kernel each. Both branches add the noise: the
    value does not depend on which one runs. A draw of more than ``2**31 - 1``
    elements (int32 offsets) reads its spans at constant offsets.
    """
    sizes = [_draws(x) for x in arrays]
    starts = np.cumsum([0, *sizes[:-1]])
    if int(z.shape[0]) > _OFFSET_MAX:
        return [
            x + std * _shaped(lax.slice(z, (int(s),), (int(s) + n,)), x)
            for x, s, n in zip(arrays, starts, sizes, strict=True)
        ]

    def add(xs: tuple, offsets: tuple) -> tuple:
        return tuple(
            x + std * _shaped(lax.dynamic_slice(z, (o,), (n,)), x)
            for x, o, n in zip(xs, offsets, sizes, strict=True)
        )

    taken, offsets = lax.optimization_barrier(
        (jnp.bool_(True), tuple(jnp.int32(s) for s in starts))
    )
    return list(lax.cond(taken, add, add, tuple(arrays), offsets))


def _noised_by_shape(
    arrays: Sequence[jax.Array], keys: Sequence[jax.Array], idx: Sequence[int], stddev: Any
) -> dict[int, jax.Array]:
    """``x + stddev * jax.random.normal(k, x.shape)`` for the real, unsharded leaves among ``idx``
    that share their shape and dtype with another: one vmapped draw per such group (the random
    bits of the per-leaf draw), stored, in chunks of at most :data:`_SHAPES_DRAW_MAX` elements
    (a group as large as a big model's MLP matrices would hold gigabytes at once).
    ``{index: noised leaf}``; the other leaves are left out."""
    groups: dict[tuple[tuple[int, ...], np.dtype], list[int]] = {}
    for i in idx:
        x = arrays[i]
        if not jnp.iscomplexobj(x) and explicit_spec(x) is None:
            groups.setdefault((tuple(x.shape), np.dtype(x.dtype)), []).append(i)
    out = {}
    for (shape, dtype), members in groups.items():
        if len(members) < 2:
            continue
        per = max(1, _SHAPES_DRAW_MAX // max(1, int(np.prod(shape, dtype=np.int64))))
        std = jnp.asarray(stddev, dtype)
        for c in range(0, len(members), per):
            chunk = members[c : c + per]
            # the caller checked its key against every leaf: keys split from it vary alike
            ks = _once_ready(jnp.stack([keys[i] for i in chunk]), [arrays[i] for i in chunk])
            z = jax.vmap(lambda k, shape=shape, dtype=dtype: jax.random.normal(k, shape, dtype))(ks)
            z = _stored(
                z
            )  # one kernel draws the chunk, not a copy of the draw's code in each leaf's
            out.update({i: _stored(arrays[i] + std * z[j]) for j, i in enumerate(chunk)})
    return out


def _once_ready(keys: jax.Array, leaves: Sequence[jax.Array]) -> jax.Array:
    """``keys``, available only once ``leaves`` are: a stored draw from them is then made just
    before it is added. A draw depends on its keys alone, so XLA's schedulers would otherwise
    make every group's draw early (during the backward pass) and hold them all until the
    gradients exist, holding every group's draw through the backward pass, whatever the
    chunk size (``benchmarks/results/MEASUREMENTS.md``)."""
    return lax.optimization_barrier((keys, tuple(leaves)))[0]


def noised_leaves(
    arrays: Sequence[jax.Array],
    keys: Sequence[jax.Array],
    stddev: Any,
    divisor: Any = None,
    fn: str = "add_gaussian_noise",
    philox: bool = False,
) -> list[jax.Array]:
    """``(x + stddev * N(0, 1)) / divisor`` per leaf, one key per leaf, drawn and added in ``x``'s dtype.

    The per-leaf draw (optax's: ``dp_aggregate`` uses it to give the same noise
    as ``optax.contrib.differentially_private_aggregate`` for the same seed):
    callers cast each leaf to the dtype the noise should have (the accumulation
    dtype) first. ``divisor=None`` keeps the sum; ``fn`` names the caller in
    errors (see :func:`check_key_varies`); ``philox=True`` draws float32 (and
    complex64) leaves from :func:`~gradclip_jax.dp.philox.philox_normal`. A complex leaf gets
    :math:`\\sigma (z_1 + i z_2)` with independent standard normals: both parts of
    the gradient are coordinates the clip norm bounds, so each needs the full
    variance (``jax.random.normal`` of a complex dtype gives each half).
    """
    if keys:
        check_key_varies(fn, arrays, keys[0])  # keys split from one key vary alike
    out = []
    for x, k in zip(arrays, keys, strict=True):
        real = _real(x.dtype)
        draw = (
            philox_normal
            if philox and real == np.float32
            else functools.partial(jax.random.normal, dtype=real)
        )
        # a complex leaf: not jax's complex normal, which gives each part half the variance
        z = _shaped(draw(k, (2 * x.size,)), x) if jnp.iscomplexobj(x) else draw(k, x.shape)
        noised = x + jnp.asarray(stddev, real).astype(x.dtype) * z
        out.append(_stored(noised if divisor is None else noised / jnp.asarray(divisor, x.dtype)))
    return out


def split_stored(key: jax.Array, num: int) -> list[jax.Array]:
    """``list(jax.random.split(key, num))``, the split stored (see :func:`_stored`): each leaf's
    draw reads its key instead of deriving it again inside its own fusion (threefry's unrolled
    rounds once more per leaf: a third of the HLO instructions of the 2-block GPT-2 DP step of
    ``benchmarks/bench_cost.py``, read as a GPU compiles it)."""
    return list(lax.optimization_barrier(jax.random.split(key, num)))


def _stored(noised: jax.Array) -> jax.Array:
    """``noised``, behind an optimization barrier: XLA stores it once instead of fusing its draw
    into every consumer.

    An optimizer reads its gradient more than once (adamw: the first moment, the
    second, and the update, which XLA's GPU fusion recomputes from the gradient),
    and XLA's GPU cost model, which prices threefry's integer rounds like cheap
    float work, fuses the whole draw into each reader, each fusion several times the cost
    of the non-private update (``benchmarks/results/MEASUREMENTS.md``). Behind the barrier
    the draw runs once, for one extra write and a few reads of the leaf. The GPU expands
    the barrier after scheduling, so it holds through fusion; the CPU expands it before
    fusion, where it changes nothing (its default draw is stored by its loop anyway).
    """
    return lax.optimization_barrier(noised)
