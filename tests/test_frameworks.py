"""The examples of docs/guides/frameworks.md (flax NNX, flax Linen, Equinox), run as written.

Each ``## `` section of the guide is one program: its ``python`` code blocks run in
order in a fresh namespace. The tests then check what the program computed: the
loss went down, the norm logged from the optimizer state is the pre-clip norm of
the gradient, and the DP step's per-example norms are those of each example's
gradient taken with the framework's own tools.
"""

from __future__ import annotations

import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradclip_jax as gcx

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "frameworks.md"
SECTIONS = {
    "nnx": "Flax NNX (`nnx.Optimizer`)",
    "linen": "Flax Linen (`TrainState`)",
    "equinox": "Equinox",
    "several": "Logging norms when a chain holds several clippers",
}


def guide_sections() -> dict[str, str]:
    """``{heading: the section's python code}`` for each ``## `` section of the guide."""
    out = {}
    for part in re.split(r"^## ", GUIDE.read_text(), flags=re.M)[1:]:
        heading = part.splitlines()[0].strip()
        out[heading] = "\n".join(re.findall(r"^```python\n(.*?)^```", part, flags=re.S | re.M))
    return out


def run_section(key: str) -> dict:
    code = guide_sections()[SECTIONS[key]]
    ns: dict = {"__name__": f"frameworks_guide_{key}"}
    exec(compile(code, f"{GUIDE.name}: {SECTIONS[key]}", "exec"), ns)
    return ns


def test_guide_has_the_sections():
    sections = guide_sections()
    assert list(sections) == list(SECTIONS.values())
    assert all(code.strip() for code in sections.values())


def check_training(ns):
    losses, norms = ns["losses"], ns["norms"]
    assert all(math.isfinite(v) for v in losses + norms)
    assert losses[-1] < 0.1 * losses[0]
    assert min(norms) > 0
    assert max(norms) > 1.0  # early steps were clipped at 1.0: the clipper acted


def check_dp_norms(info, per_example_norms, clip_norm, batch_size):
    norms = np.asarray(info.norms)
    assert norms.shape == (batch_size,)
    k = len(per_example_norms)
    np.testing.assert_allclose(norms[:k], per_example_norms, rtol=1e-4)
    assert int(info.num_clipped) == int(np.sum(norms > clip_norm))


def changed(before, after):
    return any(
        not np.allclose(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))
    )


def test_flax_nnx():
    nnx = pytest.importorskip("flax.nnx")
    ns = run_section("nnx")
    check_training(ns)
    model, x, y = ns["model"], ns["x"], ns["y"]
    # the logged norm is the norm of this step's gradient, before clipping
    expected = gcx.tree_norm(nnx.grad(ns["loss_fn"])(model, x, y))
    _, logged = ns["train_step"](model, ns["optimizer"], x, y)
    np.testing.assert_allclose(logged, expected, rtol=1e-5)
    # norms_from_state reads both forms of the optimizer's state, as the guide shows
    from_opt, from_nnx = ns["from_opt_state"], ns["from_nnx_state"]
    assert list(from_opt) == ["0/norm"] and list(from_nnx) == ["opt_state/0/norm"]
    assert float(from_nnx["opt_state/0/norm"]) == float(from_opt["0/norm"]) > 0
    now = gcx.norms_from_state(nnx.state(ns["optimizer"]))
    np.testing.assert_allclose(now["opt_state/0/norm"], logged, rtol=1e-6)

    dp_model, batch = ns["dp_model"], ns["batch"]
    per_example = [
        float(gcx.tree_norm(nnx.grad(ns["loss_fn"])(dp_model, x[i : i + 1], y[i : i + 1])))
        for i in range(4)
    ]
    before = nnx.state(dp_model, nnx.Param)
    before = jax.tree.map(np.asarray, before)
    info = ns["dp_step"](dp_model, ns["dp_optimizer"], batch)
    check_dp_norms(info, per_example, ns["CLIP_NORM"], ns["BATCH_SIZE"])
    after = nnx.state(dp_model, nnx.Param)
    assert changed(before, after)
    assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(after))


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_flax_nnx_error_of_the_loss_itself_passes_through(method):
    # Updating a module created outside the loss is flax's error at any batch size, not a
    # breach of the per-example contract: the user gets flax's error, not ours.
    nnx = pytest.importorskip("flax.nnx")
    from flax.errors import TraceContextError

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)

    def losses(p, batch):
        nnx.update(model, p)  # the fix: nnx.merge(graphdef, p) (copy=True for a shared base)
        return jnp.sum(model(batch) ** 2, axis=-1)

    with pytest.raises(TraceContextError, match="different trace level"):
        jax.jit(gcx.clipped_grad(losses, 1.0, method=method))(params, jnp.ones((4, 3)))


def test_flax_linen():
    pytest.importorskip("flax.linen")
    ns = run_section("linen")
    check_training(ns)
    state, x, y, loss_fn = ns["state"], ns["x"], ns["y"], ns["loss_fn"]
    expected = gcx.tree_norm(jax.grad(loss_fn)(state.params, state.apply_fn, x, y))
    _, _, logged = ns["train_step"](state, x, y)
    np.testing.assert_allclose(logged, expected, rtol=1e-5)

    dp_state, batch = ns["dp_state"], ns["batch"]
    per_example = [
        float(
            gcx.tree_norm(
                jax.grad(loss_fn)(dp_state.params, dp_state.apply_fn, x[i : i + 1], y[i : i + 1])
            )
        )
        for i in range(4)
    ]
    new_state, info = ns["dp_step"](dp_state, batch)
    check_dp_norms(info, per_example, ns["CLIP_NORM"], ns["BATCH_SIZE"])
    assert changed(dp_state.params, new_state.params)
    assert int(new_state.step) == int(dp_state.step) + 1


def test_equinox():
    eqx = pytest.importorskip("equinox")
    ns = run_section("equinox")
    check_training(ns)
    model, x, y, loss_fn = ns["model"], ns["x"], ns["y"], ns["loss_fn"]
    expected = gcx.tree_norm(eqx.filter_grad(loss_fn)(model, x, y))
    *_, logged = ns["train_step"](model, ns["opt_state"], x, y)
    np.testing.assert_allclose(logged, expected, rtol=1e-5)

    dp_model, batch = ns["dp_model"], ns["batch"]
    per_example = [
        float(gcx.tree_norm(eqx.filter_grad(loss_fn)(dp_model, x[i : i + 1], y[i : i + 1])))
        for i in range(4)
    ]
    new_model, _, info = ns["dp_step"](dp_model, ns["dp_opt_state"], batch)
    check_dp_norms(info, per_example, ns["CLIP_NORM"], ns["BATCH_SIZE"])
    assert changed(eqx.filter(dp_model, eqx.is_array), eqx.filter(new_model, eqx.is_array))


def test_several_clippers():
    ns = run_section("several")
    state, grads = ns["state"], ns["grads"]
    with pytest.raises(KeyError):  # what the guide says tree_get does here
        optax.tree_utils.tree_get(state, "norm")
    logged = list(ns["logged"].values())
    assert len(logged) == 2
    per_leaf, global_after = logged
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), per_leaf, gcx.leaf_norms(grads)
    )
    # the global clipper sees every leaf already clipped to 0.5
    np.testing.assert_allclose(global_after, 0.5 * math.sqrt(2), rtol=1e-6)
    assert jnp.all(jnp.isfinite(gcx.tree_norm(ns["updates"])))
