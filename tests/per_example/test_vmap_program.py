"""The vmap path's compiled program against a hand-written ``vmap(grad)`` + clip + sum."""

import jax
import jax.numpy as jnp
import optax
import pytest

from benchmarks.hlo_program import distinct_kernel_count
from gradclip_jax import clipped_grad


def _mlp(layers: int):
    keys = jax.random.split(jax.random.key(0), layers)
    params = {
        f"l{i}": {"w": jax.random.normal(k, (16, 16)) / 4, "b": jnp.zeros((16,))}
        for i, k in enumerate(keys)
    }

    def losses(p, b):
        h = b["x"]
        for i in range(layers):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.sum((h - b["y"]) ** 2, axis=-1)

    return losses, params, {"x": jnp.ones((4, 16)), "y": jnp.zeros((4, 16))}


def _extra_kernels(layers: int) -> int:
    """Distinct kernels (what XLA:CPU compiles) of ``clipped_grad(method='vmap')``'s clipped sum
    beyond the hand-written one's."""
    losses, params, batch = _mlp(layers)

    def hand(p, b):
        one = jax.grad(lambda q, x, y: losses(q, {"x": x[None], "y": y[None]})[0])
        leaves, treedef = jax.tree.flatten(jax.vmap(one, in_axes=(None, 0, 0))(p, b["x"], b["y"]))
        return jax.tree.unflatten(treedef, optax.per_example_global_norm_clip(leaves, 1.0)[0])

    grad_fn = clipped_grad(losses, 1.0, method="vmap")  # nan_safe: the rare path is compiled too

    def count(f):
        return distinct_kernel_count(jax.jit(f).lower(params, batch).compile().as_text())

    return count(lambda p, b: grad_fn(p, b)[0]) - count(hand)


@pytest.mark.reads_compiled_names  # the compiled program's text (hlo_program)
@pytest.mark.cpu_only(reason="counts XLA:CPU's kernels")
def test_vmap_clipped_sum_costs_a_fixed_number_of_kernels_over_a_hand_written_one():
    """The norms, the overflow guards and the NaN-safe path add kernels that do not grow with
    the number of leaves (12 equal-shaped leaves more: at most a few more distinct kernels; a
    leaf's rescue, restacked norms or product in the rare path that differed from its equals',
    by an offset say, would add one or more per leaf). 28 and 29 (42 and 36 with a fallback
    of the norm engine's per leaf and the guard's ``max |x|`` on the common path)."""
    small, large = _extra_kernels(2), _extra_kernels(8)
    assert large - small <= 2, (small, large)
    assert large <= 32, (small, large)
