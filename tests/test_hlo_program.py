"""Reading a compiled program (``benchmarks/hlo_program.py``): what each instruction holds, and
which part of a DP step wrote it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import hlo_program as hp
from gradclip_jax import clipped_grad
from gradclip_jax.dp.noise import add_gaussian_noise

# reads the compiled programs' source metadata (stack frames, op names)
pytestmark = pytest.mark.reads_compiled_names

LIB = "/site-packages/gradclip_jax/"


@pytest.mark.cpu_only(
    reason="reads XLA:CPU's compiled program: on a GPU the suite runs float32 matmuls at "
    "full precision (no DEFAULT dot) and XLA turns dots into cuBLAS/Triton fusions"
)
def test_hlo_hints_read_a_compiled_program() -> None:
    def f(x: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(c: jax.Array, _: None) -> tuple[jax.Array, None]:
            return jnp.tanh(jnp.dot(c, x, precision="highest")), None

        c, _ = jax.lax.scan(body, x, None, length=3)
        y = jax.lax.conv_general_dilated(c[None, None], k, (1, 1), "SAME")
        return y, jnp.dot(x, x.T)

    x, k = jnp.ones((8, 8)), jnp.ones((1, 1, 3, 3))
    hints = hp.hlo_hints(jax.jit(f).lower(x, k).compile().as_text())
    values = set(hints.values())
    assert "while" in values
    assert "dot highest in_while" in values  # the loop's matmul, wherever XLA fused it
    assert "dot default" in values
    assert any(v.startswith("convolution") for v in values)
    assert any(v.endswith(" in_while") and not v.startswith("dot") for v in values)


@pytest.mark.parametrize(
    ("chain", "phase"),
    [
        # innermost first; a helper (_products, numerics) lets its caller decide
        (
            [
                (LIB + "per_example/_products.py", "product_einsum"),
                (LIB + "per_example/ghost/rules/dense.py", "norm"),
                (LIB + "per_example/ghost/_measure.py", "leaf_norms"),
            ],
            "norms",
        ),
        (
            [
                (LIB + "per_example/_products.py", "tf32_weighted_once"),
                (LIB + "per_example/ghost/_sums.py", "site_sum"),
            ],
            "clipped sum",
        ),
        # the ghost path's replay of the model's operations is the model, unless a sum replays it
        (
            [
                (LIB + "_core/jaxcompat.py", "bind"),
                (LIB + "per_example/ghost/_jaxpr.py", "replay"),
                (LIB + "per_example/ghost/_measure.py", "probe"),
            ],
            "model",
        ),
        (
            [
                (LIB + "_core/jaxcompat.py", "bind"),
                (LIB + "per_example/ghost/_measure.py", "apply_site"),
                (LIB + "per_example/ghost/_sums.py", "_pulled"),
            ],
            "clipped sum",
        ),
        (
            [(LIB + "_core/numerics.py", "sqrt_safe"), (LIB + "dp/noise.py", "noised_leaves")],
            "noise",
        ),
        ([(LIB + "dp/philox.py", "philox4x32")], "noise"),
        (
            [
                ("/x/flax/nnx/nn/linear.py", "__call__"),
                (LIB + "per_example/_batch.py", "per_example"),
            ],
            "model",
        ),
        (
            [
                ("/x/optax/losses/_classification.py", "softmax_cross_entropy"),
                ("/u/train.py", "loss"),
            ],
            "model",
        ),
        ([("/x/optax/_src/transform.py", "update_fn"), ("/u/train.py", "step")], "optimizer"),
        ([("/u/train.py", "step")], "model"),
        ([(LIB + "_core/factors.py", "clip_factor"), ("/u/train.py", "step")], "norms"),
        ([(LIB + "_core/numerics.py", "sqrt_safe")], "unattributed"),
        ([], "unattributed"),
    ],
)
def test_phase_of_reads_the_whole_chain(chain: list[tuple[str, str]], phase: str) -> None:
    assert hp.phase_of(chain) == phase


def _tables(parents: list[int]) -> str:
    """An HLO text's source tables: frame ``i`` (1-based) at ``a.py`` line ``i``, function ``f{i}``,
    its parent as printed ``parents[i - 1]``."""
    lines = ["HloModule m", "", "FileNames", '1 "/u/a.py"', "", "FunctionNames"]
    lines += [f'{i} "f{i}"' for i in range(1, len(parents) + 1)] + ["", "FileLocations"]
    lines += [
        f"{i} {{file_name_id=1 function_name_id={i} line={i} end_line={i} column=1 end_column=2}}"
        for i in range(1, len(parents) + 1)
    ] + ["", "StackFrames"]
    lines += [
        f"{i} {{file_location_id={i} parent_frame_id={p}}}" for i, p in enumerate(parents, 1)
    ] + [""]
    return "\n".join(lines)


@pytest.mark.parametrize("shifted", [True, False])
def test_frames_read_the_parent_of_each_frame(shifted: bool) -> None:
    """Frames 1 <- 2 <- 3 (3 innermost) and 4 alone. XLA prints a parent as its id plus one (so
    a root names itself when it is frame 1); a printer writing the id itself is read as well."""
    parents = [1, 2, 3, 1] if shifted else [0, 1, 2, 0]
    frames = hp._frames(_tables(parents))
    assert [fn for _, fn in hp._chain(3, frames)] == ["f3", "f2", "f1"]
    assert [fn for _, fn in hp._chain(4, frames)] == ["f4"]


def test_hlo_phases_attribute_each_part_of_a_ghost_dp_step() -> None:
    """A ghost-clipped DP step with adam: its model, norms, clipped sum, noise and optimizer are
    all found, and every drawing op is the noise's."""
    r = np.random.default_rng(0)
    params = {"w": jnp.asarray(r.normal(size=(6, 5)), jnp.float32), "b": jnp.zeros(5)}
    data = jnp.asarray(r.normal(size=(4, 3, 6)), jnp.float32)  # T=3: the weight's norm in Gram form
    opt = optax.adam(1e-3)

    def losses(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2, axis=(1, 2))

    def step(p, state, x, key):
        g, _ = clipped_grad(losses, 1.0, method="ghost")(p, x)
        g = add_gaussian_noise(g, 1.0, key)
        updates, state = opt.update(g, state, p)
        return optax.apply_updates(p, updates), state

    text = (
        jax.jit(step).lower(params, opt.init(params), data, jax.random.key(0)).compile().as_text()
    )
    phases = hp.hlo_phases(text)
    assert {"model", "norms", "clipped sum", "noise", "optimizer"} <= set(phases.values())
    assert set(phases.values()) <= set(hp.PHASES)
    comps, _ = hp._parse_hlo(text)
    draws = [
        n for body in comps.values() for n, op, _ in body if op in ("rng-bit-generator", "rng")
    ]
    assert all(phases.get(n) == "noise" for n in draws)


def test_the_ops_of_random_number_generation_are_the_noise() -> None:
    """JAX caches its key split as a jitted function carrying the source frames of its first trace
    (whichever step that was): its ops are told by their names, not by those frames."""

    def split_twice(key):
        return jax.random.split(jax.random.fold_in(key, 1), 3)

    text = jax.jit(split_twice).lower(jax.random.key(0)).compile().as_text()
    assert set(hp.hlo_phases(text).values()) == {"noise"}


@pytest.mark.cpu_only(reason="counts XLA:CPU's kernels")
def test_distinct_kernels_count_equal_work_once() -> None:
    """Equal work on equal shapes is one kernel however often the program runs it; another shape,
    another constant or another operation is a kernel of its own (XLA compiles one kernel per
    distinct fused computation)."""

    def count(f, xs):
        text = jax.jit(f).lower(xs).compile().as_text()
        return hp.kernel_count(text), hp.distinct_kernel_count(text)

    same = [jnp.ones((16, 24)) for _ in range(6)]
    shapes = [jnp.ones((16, 24 + i)) for i in range(6)]
    assert count(lambda xs: [jnp.tanh(x) * 2 for x in xs], same) == (6, 1)
    assert count(lambda xs: [jnp.tanh(x) * 2 for x in xs], shapes) == (6, 6)
    assert count(lambda xs: [jnp.tanh(x) * i for i, x in enumerate(xs, 2)], same) == (6, 6)
    assert count(lambda xs: [jnp.tanh(x) * 2 for x in xs[:3]] + [x * 2 for x in xs[3:]], same) == (
        6,
        2,
    )
