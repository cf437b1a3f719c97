"""Structural primitives (transpose, broadcast, reductions, reshapes, slices, stacking and
tiling, windows, sorting, reversal, FFTs, updates, identities): how each moves or keeps the batch axis. Only a parameter
joined to batched values (a class token) is a site."""

from __future__ import annotations

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax._core.jaxcompat import shape
from gradclip_jax.per_example.ghost.rules._registry import (
    CONST,
    RowCtx,
    Rule,
    Site,
    State,
    Use,
    axis0_only,
    leading_batch,
    register,
)


def _removed(c: RowCtx, dims: tuple[int, ...]) -> list[State]:
    """The batch axis after removing ``dims`` (mixed if it is one of them)."""
    k0 = c.k0
    if k0 is None or k0 in dims:
        return c.mixed()
    return c.res_at(k0 - sum(a < k0 for a in dims))


def _removed_or_kept(c: RowCtx, axes: tuple[int, ...]) -> list[State]:
    """The batch axis where it was, unless the operation works along it (then mixed)."""
    k0 = c.k0
    return c.mixed() if k0 is None or k0 in axes else c.res_at(k0)


class Transpose(Rule):
    primitives = ("transpose",)

    def row(self, c: RowCtx) -> list[State]:
        k0 = c.k0
        return c.mixed() if k0 is None else c.res_at(tuple(c.param("permutation")).index(k0))


class BroadcastInDim(Rule):
    primitives = ("broadcast_in_dim",)

    def row(self, c: RowCtx) -> list[State]:
        k0 = c.k0
        if k0 is None or c.states[0] != k0:
            return c.mixed()
        return c.res_at(tuple(c.param("broadcast_dimensions"))[k0])


class Reduce(Rule):
    primitives = (
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
    )

    def row(self, c: RowCtx) -> list[State]:
        return _removed(c, tuple(c.param("axes")))

    def crosses(self, c: RowCtx) -> bool:
        return c.k0 is not None and c.k0 in tuple(c.param("axes"))


class Squeeze(Rule):
    primitives = ("squeeze",)

    def row(self, c: RowCtx) -> list[State]:
        return _removed(c, tuple(c.param("dimensions")))


class Cumulative(Rule):
    primitives = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")

    def row(self, c: RowCtx) -> list[State]:
        k0 = c.k0
        return c.mixed() if k0 is None or c.param("axis") == k0 else c.res_at(k0)

    def crosses(self, c: RowCtx) -> bool:
        return c.k0 is not None and c.param("axis") == c.k0


class Axis0(Rule):
    """Rules that only follow the batch on axis 0: ``ok(c)`` says the op keeps examples apart."""

    def ok(self, c: RowCtx) -> bool:
        return False

    def row(self, c: RowCtx) -> list[State]:
        return c.res(self.ok(c)) if axis0_only(c) else c.mixed()


class Reshape(Rule):
    """A reshape keeping the batch leading: to ``(B, ...)``, or merged with each example's
    positions (``(B, T, V)`` to ``(B * T, V)``)."""

    primitives = ("reshape",)

    def row(self, c: RowCtx) -> list[State]:
        if not axis0_only(c) or c.param("dimensions", None) is not None or not c.outs[0]:
            return c.mixed()
        return [leading_batch(c.outs[0][0], c.bsize)]


class Concatenate(Rule):
    """Joining along any axis but the batch's (a fused qkv's outputs, stacked layer outputs).

    A parameter broadcast over the batch and joined to batched values (a ViT's class
    token put before the patches) is a ``concatenate`` site: each example's gradient
    is its slice of the output cotangent, formed for that (small) leaf alone.
    """

    primitives = ("concatenate",)
    kind = "concatenate"

    def row(self, c: RowCtx) -> list[State]:
        k0 = c.k0
        return c.mixed() if k0 is None or c.param("dimension") == k0 else c.res_at(k0)

    def classify(self, use: Use) -> Site | None:
        rows = use.row_operands()
        out = shape(use.eqn.outvars[0])
        if (
            not rows
            or 0 not in use.batch_axes
            or jc.param(use.eqn, "dimension") == 0
            or shape(use.eqn.invars[use.pos])[:1] != out[:1]
        ):
            return None
        return self.site(use, rows)


class Split(Rule):
    """``jnp.split`` along any axis but the batch's (a fused qkv projection)."""

    primitives = ("split",)

    def row(self, c: RowCtx) -> list[State]:
        k0 = c.k0
        return c.mixed() if k0 is None or c.param("axis") == k0 else c.res_at(k0)


class Slice(Rule):
    """A static slice that keeps the whole batch axis (any other axis may be cut)."""

    primitives = ("slice",)

    def row(self, c: RowCtx) -> list[State]:
        k0 = c.k0
        if k0 is None:
            return c.mixed()
        strides = c.param("strides", None)
        whole = (
            c.param("start_indices")[k0] == 0
            and c.param("limit_indices")[k0] == c.bsize
            and (strides is None or strides[k0] == 1)
        )
        return c.res_at(k0) if whole else c.mixed()


class Pad(Axis0):
    primitives = ("pad",)

    def ok(self, c: RowCtx) -> bool:
        return c.states[0] == 0 and tuple(c.param("padding_config")[0]) == (0, 0, 0)


class DynamicSlice(Axis0):
    primitives = ("dynamic_slice",)

    def ok(self, c: RowCtx) -> bool:
        return bool(
            c.states[0] == 0
            and all(s == CONST for s in c.states[1:])
            and c.param("slice_sizes")[0] == c.bsize
        )


class ReduceWindow(Axis0):
    primitives = ("reduce_window", "reduce_window_sum", "reduce_window_max", "reduce_window_min")

    def ok(self, c: RowCtx) -> bool:
        return bool(
            c.param("window_dimensions")[0] == 1
            and c.param("window_strides")[0] == 1
            and tuple(c.param("padding")[0]) == (0, 0)
        )


class Sort(Axis0):
    """Sorting along one axis; along the batch axis every output row reads every example."""

    primitives = ("sort",)

    def ok(self, c: RowCtx) -> bool:
        return bool(c.param("dimension") != 0)

    def crosses(self, c: RowCtx) -> bool:
        return c.k0 is not None and c.param("dimension") == c.k0


class TopK(Axis0):
    """The top values along the last axis; the batch's (``top_k(h.T)``) ranks examples."""

    primitives = ("top_k",)

    def ok(self, c: RowCtx) -> bool:
        return len(c.ins[0]) >= 2

    def crosses(self, c: RowCtx) -> bool:
        return c.k0 is not None and c.k0 == len(c.ins[0]) - 1


class AlongAxes(Rule):
    """Operations working along some axes of each operand and keeping its shape's rank: row-wise
    when the batch axis is not one of them, certainly combining examples when it is."""

    def axes(self, c: RowCtx) -> tuple[int, ...]:
        return ()

    def row(self, c: RowCtx) -> list[State]:
        return _removed_or_kept(c, self.axes(c))

    def crosses(self, c: RowCtx) -> bool:
        return c.k0 is not None and c.k0 in self.axes(c)


class Rev(AlongAxes):
    """Reversing axes other than the batch's (``jnp.flip`` of features); reversing the batch
    axis pairs example ``i`` with example ``B - 1 - i``."""

    primitives = ("rev",)

    def axes(self, c: RowCtx) -> tuple[int, ...]:
        return tuple(c.param("dimensions"))


class FFT(AlongAxes):
    """``jnp.fft``: a transform over the trailing ``len(fft_lengths)`` axes of each example."""

    primitives = ("fft",)

    def axes(self, c: RowCtx) -> tuple[int, ...]:
        n = len(c.ins[0])
        return tuple(range(n - len(c.param("fft_lengths")), n))


class ApproxTopK(AlongAxes):
    """``lax.approx_max_k`` / ``approx_min_k``: the top values along one axis of each example."""

    primitives = ("approx_top_k",)

    def axes(self, c: RowCtx) -> tuple[int, ...]:
        return (int(c.param("reduction_dimension")) % len(c.ins[0]),)


class VariadicReduce(Rule):
    """``lax.reduce`` with a computation of its own (several operands reduced together, e.g. an
    argmax written by hand): the batch axis is removed, or reduced over."""

    primitives = ("reduce",)

    def row(self, c: RowCtx) -> list[State]:
        return _removed(c, tuple(c.param("dimensions")))

    def crosses(self, c: RowCtx) -> bool:
        return c.k0 is not None and c.k0 in tuple(c.param("dimensions"))


class Stack(Rule):
    """``jnp.stack`` (a primitive since jax 0.10): operands of one shape joined along a new axis
    (rotary embeddings' rotated halves, an LSTM's gates). The batch axis ``k`` of the operands is
    axis ``k`` of the output, or ``k + 1`` when the new axis comes before it."""

    primitives = ("stack",)

    def row(self, c: RowCtx) -> list[State]:
        k0 = c.k0
        if k0 is None:
            return c.mixed()
        axis = int(c.param("axis")) % len(c.outs[0])
        return c.res_at(k0 + 1 if axis <= k0 else k0)


class Unstack(Rule):
    """``jnp.unstack`` (a primitive since jax 0.10): one operand cut into its slices along one axis.
    Along any axis but the batch's, each slice keeps the batch (one fewer axis before it when the
    cut axis comes first); along the batch axis, each output is one example."""

    primitives = ("unstack",)

    def row(self, c: RowCtx) -> list[State]:
        k0 = c.k0
        axis = int(c.param("axis")) % len(c.ins[0])
        if k0 is None or axis == k0:
            return c.mixed()
        return c.res_at(k0 - 1 if axis < k0 else k0)


class Tile(Rule):
    """``jnp.tile`` (a primitive since jax 0.10): copies along axes, the batch axis left as it is.
    (Tiles along size-1 axes were rewritten as broadcasts before the analysis.)"""

    primitives = ("tile",)

    def row(self, c: RowCtx) -> list[State]:
        k0 = c.k0
        if k0 is None or int(c.param("reps")[k0]) != 1:
            return c.mixed()
        return c.res_at(k0)


class DynamicUpdateSlice(Axis0):
    """An update written into a value at offsets known only at run time (a KV cache): row-wise
    when the offsets are the same for every example and a batched update spans the batch (its
    offset on axis 0 is then clamped to 0, so each example's row receives its own update)."""

    primitives = ("dynamic_update_slice",)

    def ok(self, c: RowCtx) -> bool:
        update = c.states[1]
        return bool(
            all(s == CONST for s in c.states[2:]) and (update == CONST or c.ins[1][0] == c.bsize)
        )


class Identity(Rule):
    """Operations returning their operands unchanged, one output per operand (an optimization
    barrier, a transfer to a device)."""

    primitives = ("optimization_barrier", "device_put")

    def row(self, c: RowCtx) -> list[State]:
        if len(c.states) != len(c.eqn.outvars):
            return c.mixed()
        return list(c.states)


class Iota(Rule):
    primitives = ("iota",)

    def row(self, c: RowCtx) -> list[State]:
        return [CONST] * len(c.eqn.outvars)


for _rule in (
    Transpose(),
    BroadcastInDim(),
    Reduce(),
    Squeeze(),
    Cumulative(),
    Reshape(),
    Concatenate(),
    Split(),
    Slice(),
    Pad(),
    DynamicSlice(),
    ReduceWindow(),
    Sort(),
    TopK(),
    Rev(),
    FFT(),
    Iota(),
    ApproxTopK(),
    VariadicReduce(),
    Stack(),
    Unstack(),
    Tile(),
    DynamicUpdateSlice(),
    Identity(),
):
    register(_rule)
