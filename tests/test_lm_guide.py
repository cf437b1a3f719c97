"""The code of docs/guides/lm-fine-tuning.md, run as written.

The guide's ``python`` blocks form one program, section by section (``## `` headings).
Sections 1-4 (the model, token masks, full fine-tuning and LoRA through ``make_private``)
run in order in one namespace, as far as a test needs them; sections 5-7 (memory,
bfloat16, sharding) each run on the namespace the model section left (they use nothing
of sections 2-4). Each DP step compiles for several seconds on a CPU, so the quick tests
run sections 1-2 (the model and its token masks: two compiled gradients) and check what
fails while tracing; every test that trains or compiles more is marked slow. After each section the tests check what it computed: padding changes nothing on
either path, the epsilon printed is the accountant's, LoRA trains the adapters alone,
the ghost step's compiled temporaries stay near the non-private step's, bf16 norms are
float32 and near float32's, the sharded run is the one-device run.

The sharding section needs 8 devices: the test suite simulates them (conftest.py sets
``XLA_FLAGS``); a process with fewer runs it in a subprocess (this file as a script).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("dp_accounting")

pytestmark = pytest.mark.xdist_group("lm_guide")

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "lm-fine-tuning.md"
SECTIONS = [
    "1. The model",
    "2. Token masks: padding does not count",
    "3. Full fine-tuning with `make_private`",
    "4. LoRA: adapters as the only trainable leaves",
    "5. Memory: remat, scan and the ghost path",
    "6. bfloat16",
    "7. Sharding over devices",
]
IN_ORDER = SECTIONS[:4]  # run in order in one namespace
DEVICES = 8


def guide_sections() -> dict[str, str]:
    """``{heading: the section's python code}`` for each ``## `` section that has code."""
    out = {}
    for part in re.split(r"^## ", GUIDE.read_text(), flags=re.M)[1:]:
        code = "\n".join(re.findall(r"^```python\n(.*?)^```", part, flags=re.S | re.M))
        if code.strip():
            out[part.splitlines()[0].strip()] = code
    return out


def run_section(ns: dict, heading: str) -> dict:
    # dont_inherit: the guide runs without this file's `from __future__ import annotations`
    exec(
        compile(guide_sections()[heading], f"{GUIDE.name}: {heading}", "exec", dont_inherit=True),
        ns,
    )
    return ns


def _jit_to_completion(jit):
    """``jax.jit`` whose functions return only once their results are computed (XLA:CPU's
    simulated devices share one thread pool: see tests/test_dp_guide.py)."""

    def jit_blocking(fn, *args, **kwargs):
        compiled = jit(fn, *args, **kwargs)

        def call(*a, **k):
            return jax.block_until_ready(compiled(*a, **k))

        call.lower, call.trace = compiled.lower, compiled.trace
        return call

    return jit_blocking


@pytest.fixture(scope="module")
def model_ns() -> dict:
    """The namespace after section 1 (the model, the data, the loss): nothing compiled."""
    return run_section({"__name__": "lm_guide"}, SECTIONS[0])


class InOrder:
    """Sections 1-4 run in order in one namespace, each once, as far as a test needs them."""

    def __init__(self, model_ns: dict):
        self.ns, self.after = dict(model_ns), {SECTIONS[0]: dict(model_ns)}

    def __getitem__(self, heading: str) -> dict:
        for h in IN_ORDER[: IN_ORDER.index(heading) + 1]:
            if h not in self.after:
                self.after[h] = dict(run_section(self.ns, h))
        return self.after[heading]


@pytest.fixture(scope="module")
def in_order(model_ns) -> InOrder:
    """``in_order[heading]``: the namespace after that section (of 1-4), sections run in order."""
    return InOrder(model_ns)


@pytest.fixture(scope="module")
def fresh_params(model_ns):
    """The model's initial weights (section 3's ``nnx.update`` writes into the first ``params``'
    variables: nnx.split hands out the module's own ``Variable`` objects)."""
    nnx = model_ns["nnx"]
    return nnx.split(model_ns["Llama"](model_ns["cfg"], nnx.Rngs(0)))[1]


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def max_abs_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
        for x, y in zip(leaves(a), leaves(b))
    )


def test_every_code_block_is_in_a_checked_section():
    assert list(guide_sections()) == SECTIONS
    text = GUIDE.read_text()
    assert "```python" not in text.split("\n## ")[0]


def test_padding_changes_nothing_on_either_path(in_order):
    """Other ids and targets at the padded positions: the same clipped sums and norms (to 1e-6),
    on the ghost and the vmap path; the all-padding sequence has norm 0."""
    ns = in_order[SECTIONS[1]]
    batch, scrambled, padded = ns["batch"], ns["scrambled"], ns["padded"]
    assert padded[3].all() and 0 < padded.sum() < padded.size
    assert (scrambled["tokens"] != batch["tokens"]).sum() > padded.sum() // 2
    assert (scrambled["targets"] != batch["targets"]).sum() > padded.sum() // 2
    params, out = ns["params"], {}
    for method, grad_fn in ns["grad_fns"].items():
        (g, info), (g2, info2) = grad_fn(params, batch), grad_fn(params, scrambled)
        assert max_abs_diff(g, g2) <= 1e-6, method
        np.testing.assert_allclose(info.norms, info2.norms, rtol=0, atol=1e-6)
        norms = np.asarray(info.norms)
        assert norms[3] == 0.0 and np.all(norms[np.arange(8) != 3] > 0), method
        out[method] = (g, norms)
    # the two paths agree with each other
    np.testing.assert_allclose(out["ghost"][1], out["vmap"][1], rtol=1e-5)
    assert max_abs_diff(out["ghost"][0], out["vmap"][0]) <= 1e-5


def test_an_all_padding_sequence_adds_a_zero_gradient(in_order):
    ns = in_order[SECTIONS[1]]
    empty = dict(ns["scrambled"], mask=np.zeros_like(ns["batch"]["mask"]))
    for method, grad_fn in ns["grad_fns"].items():
        g, info = grad_fn(ns["params"], empty)
        assert all(np.all(x == 0) for x in leaves(g)), method
        assert np.all(np.asarray(info.norms) == 0) and int(info.num_clipped) == 0


def test_dividing_by_the_batch_token_count_breaks_the_contract(model_ns):
    """The guide's warning: a loss divided by the batch's token count is not per example."""
    import gradclip_jax as gcx

    ns = model_ns
    graphdef, params, nnx = ns["graphdef"], ns["params"], ns["nnx"]
    batch = jax.tree.map(lambda a: a[:4], ns["data"])

    def batch_mean_loss(p, b):
        logits = nnx.merge(graphdef, p)(b["tokens"], b["mask"])
        ce = ns["optax"].softmax_cross_entropy_with_integer_labels(logits, b["targets"])
        return jnp.sum(jnp.where(b["mask"], ce, 0.0), axis=-1) / jnp.sum(b["mask"])

    for method in ("ghost", "vmap"):
        with pytest.raises(ValueError, match="per-example"):
            gcx.clipped_grad(batch_mean_loss, 1.0, method=method)(params, batch)


@pytest.mark.slow
def test_full_fine_tuning(in_order, fresh_params):
    """The epsilon printed is the accountant's, at the target; 'auto' took the ghost path; every
    weight moved and the module holds them."""
    ns = in_order[SECTIONS[2]]
    priv, nnx = ns["priv"], ns["nnx"]
    assert priv.accountant.steps == 10 == priv.steps
    assert priv.epsilon() == priv.accountant.epsilon(1e-5) and 7.0 < priv.epsilon() <= 8.0 + 1e-9
    assert (
        ns["gcx"].ghost_report(ns["per_example_loss"], fresh_params, ns["batch"]).auto[0] == "ghost"
    )
    before, after = leaves(fresh_params), leaves(ns["params"])
    assert all(np.all(np.isfinite(a)) for a in after)
    assert all(not np.array_equal(a, b) for a, b in zip(before, after))
    for a, b in zip(leaves(nnx.state(ns["model"], nnx.Param)), after):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_lora_trains_the_adapters_alone(in_order):
    ns = in_order[SECTIONS[3]]
    lora, nnx = ns["lora"], ns["nnx"]
    assert (
        lora.accountant.steps == 10
        and lora.epsilon() == lora.accountant.epsilon(1e-5) <= 8.0 + 1e-9
    )
    fresh = ns["Llama"](ns["dataclasses"].replace(ns["cfg"], lora_rank=4), nnx.Rngs(0))
    _, adapters0, base0 = nnx.split(fresh, nnx.LoRAParam, ...)
    _, adapters1, base1 = nnx.split(ns["lora_model"], nnx.LoRAParam, ...)
    assert (
        ns["n_adapter"]
        == sum(x.size for x in leaves(adapters0))
        < sum(x.size for x in leaves(base0)) / 4
    )
    for a, b in zip(leaves(base0), leaves(base1)):  # the frozen base is unchanged
        np.testing.assert_array_equal(a, b)
    moved = [not np.array_equal(a, b) for a, b in zip(leaves(adapters0), leaves(adapters1))]
    assert all(moved) and all(np.all(np.isfinite(a)) for a in leaves(adapters1))


@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_lora_without_copy_is_flaxs_trace_level_error(model_ns, method):
    """What the guide says happens without ``copy=True``: flax's ValueError, passed through (it
    is raised while tracing: nothing compiles)."""
    ns = model_ns
    nnx, gcx = ns["nnx"], ns["gcx"]
    graphdef, adapters, base = nnx.split(
        ns["Llama"](ns["dataclasses"].replace(ns["cfg"], lora_rank=4), nnx.Rngs(0)),
        nnx.LoRAParam,
        ...,
    )

    def no_copy(a, b):
        return ns["example_loss"](nnx.merge(graphdef, a, base), b)

    batch = jax.tree.map(lambda a: a[:4], ns["data"])
    with pytest.raises(ValueError, match="different trace level"):
        jax.jit(gcx.clipped_grad(no_copy, 1.0, method=method))(adapters, batch)


@pytest.mark.slow
def test_memory_section(model_ns):
    """The ghost step's compiled temporaries within 1.2x of the non-private step's (the streamed
    path; the probed one held every layer's activations), and below the vmap step's."""
    ns = run_section(dict(model_ns), SECTIONS[4])
    mem = ns["memory"]
    assert set(mem) == {"non-private", "ghost", "vmap"} and min(mem.values()) > 0
    assert mem["ghost"] <= 1.2 * mem["non-private"], mem
    assert mem["ghost"] < mem["vmap"], mem


@pytest.mark.slow
def test_bfloat16_section(model_ns):
    """bf16 model: float32 norms and sums on both paths, ghost == vmap within bf16 rounding, and
    the norms within 1e-2 of the same weights' float32 norms (3.4e-3 measured)."""
    ns = run_section(dict(model_ns), SECTIONS[5])
    assert all(x.dtype == jnp.bfloat16 for x in leaves(ns["params16"]))
    info32 = ns["info32"]
    for m, (g, info) in ns["norms16"].items():
        assert info.norms.dtype == jnp.float32 and all(x.dtype == jnp.float32 for x in leaves(g)), m
        np.testing.assert_allclose(info.norms, info32.norms, rtol=1e-2)
    np.testing.assert_allclose(
        ns["norms16"]["ghost"][1].norms, ns["norms16"]["vmap"][1].norms, rtol=1e-2
    )


def sharded_summary(ns: dict) -> dict:
    """What the sharding section computed, against the same run on one device."""
    gcx, nnx, optax = ns["gcx"], ns["nnx"], ns["optax"]
    dist = ns["dist"]
    one = gcx.make_private(
        ns["per_example_loss"],
        optax.adamw(3e-3),
        dataset_size=ns["n_train"],
        expected_batch_size=16,
        steps=3,
        target_epsilon=8.0,
        delta=1e-5,
        l2_clip_norm=1.0,
        seed=0,
        max_batch_size=dist.sampler.max_batch_size,
    )
    _, params = nnx.split(ns["Llama"](ns["cfg"], nnx.Rngs(0)))
    state, step = one.init(params), jax.jit(one.step)
    for batch, mask, key in one.batches(ns["data"], noise_key=jax.random.key(2)):
        params, state, _ = step(params, state, batch, mask, key)
    sharded = ns["sharded"]
    specs = [x.sharding.spec for x in jax.tree.leaves(sharded)]
    # the guide's note on make_mesh's default (Explicit) axes: this model's step does not trace
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    explicit = jax.make_mesh(tuple(ns["mesh"].shape.values()), ("data", "fsdp"))
    assert all(t == AxisType.Explicit for t in explicit.axis_types)
    rows = dist.sampler.max_batch_size
    with jax.set_mesh(explicit):
        p = jax.tree.map(
            lambda x: jax.device_put(x, NamedSharding(explicit, ns["fsdp_sharding"](x).spec)),
            ns["start"],
        )
        b = jax.tree.map(
            lambda a: jax.device_put(a[:rows], NamedSharding(explicit, P(("data", "fsdp")))),
            ns["data"],
        )
        m = jax.device_put(np.ones(rows, bool), NamedSharding(explicit, P(("data", "fsdp"))))
        try:
            jax.jit(dist.step).trace(p, dist.init(p), b, m, jax.random.key(0))
            explicit_error = None
        except Exception as e:  # jax's ShardingTypeError (not a public name)
            explicit_error = f"{type(e).__name__}: {e}"
    return {
        "devices": ns["n_dev"],
        "mesh": dict(ns["mesh"].shape),
        "max_diff": max_abs_diff(params, sharded),
        "scale": max(float(np.max(np.abs(x))) for x in leaves(params)),
        "fsdp_leaves": sum("fsdp" in str(s) for s in specs),
        "leaves": len(specs),
        "steps": dist.accountant.steps,
        "epsilon": dist.epsilon(),
        "accountant": dist.accountant.epsilon(1e-5),
        "batch_rows": dist.sampler.max_batch_size,
        "explicit_error": explicit_error,
        # the annotated loss: both paths' norms and sums against the unannotated loss on one device
        "annotated_diff": _annotated_diff(ns),
    }


def _annotated_diff(ns: dict) -> float:
    """The largest relative difference of ``annotated``'s norms and sums (ghost and vmap) from
    the guide's loss without the annotation, on one device."""
    gcx, piece = ns["gcx"], jax.tree.map(np.asarray, ns["piece"])
    params = jax.tree.map(np.asarray, ns["sharded"])
    ref, ref_info = jax.jit(gcx.clipped_grad(ns["per_example_loss"], 1.0))(params, piece)
    scale = max(float(np.max(np.abs(x))) for x in leaves(ref))
    diffs = []
    for grads, info in ns["annotated"].values():
        diffs.append(max_abs_diff(grads, ref) / scale)
        diffs.append(
            float(np.max(np.abs(np.asarray(info.norms) - ref_info.norms) / ref_info.norms))
        )
    return max(diffs)


def run_sharded(ns: dict) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax, "jit", _jit_to_completion(jax.jit))
        run_section(ns, SECTIONS[6])
        return sharded_summary(ns)


@pytest.mark.slow
def test_sharding_section(model_ns):
    """On a 2x4 mesh of 8 devices, FSDP weights: the one-device run's parameters to float rounding."""
    if jax.device_count() >= DEVICES:
        res = run_sharded(dict(model_ns))
    else:  # set the devices before jax starts: a process of its own
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}",
        )
        proc = subprocess.run(
            [sys.executable, __file__],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=GUIDE.parent.parent.parent,
        )
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == DEVICES and res["mesh"] == {"data": 2, "fsdp": 4}
    assert res["fsdp_leaves"] == res["leaves"]  # every weight split over the fsdp axis
    assert res["batch_rows"] % DEVICES == 0 and res["steps"] == 3
    assert res["epsilon"] == res["accountant"] <= 8.0 + 1e-9
    assert res["max_diff"] <= 1e-5 * max(1.0, res["scale"]), res
    assert res["annotated_diff"] <= 1e-5, res
    assert (
        res["explicit_error"].startswith("ShardingTypeError")
        and "out_sharding" in res["explicit_error"]
    )


if __name__ == "__main__":  # the sharding section in a process with 8 simulated devices
    _ns = run_section({"__name__": "lm_guide"}, SECTIONS[0])
    print(json.dumps(run_sharded(_ns)))
