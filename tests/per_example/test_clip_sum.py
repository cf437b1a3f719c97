"""The clip step shared by the per-example paths (``per_example/_clip_sum.py``): under global
clipping the norms' combination and the clip factor are computed once for all leaves."""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest

from benchmarks import hlo_program as hp
from gradclip_jax import clipped_grad
from tests.per_example.ghost.test_low_precision import lm16

# As a GPU compiles: optimization barriers kept through fusion (XLA:CPU's own pipeline removes
# them before it fuses, see benchmarks/bench_cost.py).
AS_GPU = {"xla_disable_hlo_passes": "cse_barrier_expander"}
SHARED = ("from_leaf_norms", "combine_l2_stacked", "measure", "clip_factor")


def _kernels_computing(loss, params, data, method: str) -> Counter:
    """How many kernels (fusions of the entry computation) of the compiled clipped sum (global
    clipping) hold ops of each function of :data:`SHARED`."""
    text = (
        jax.jit(clipped_grad(loss, 1.0, method=method))
        .lower(params, data)
        .compile(AS_GPU)
        .as_text()
    )
    frames = hp._frames(text)
    comps, _ = hp._parse_hlo(text)

    def functions(comp: str) -> set[str]:  # of the ops of a computation and of those it calls
        out = set()
        for _, _, rest in comps.get(comp, []):
            if m := re.search(r"stack_frame_id=(\d+)", rest):
                out.add(hp._chain(int(m.group(1)), frames)[0][1])
            out |= {f for c in hp._called(rest) for f in functions(c)}
        return out

    entry = next(c for c in comps if c.startswith("main"))
    found: Counter = Counter()
    for _, opcode, rest in comps[entry]:
        if opcode == "fusion":
            found.update(f for f in SHARED if f in functions(hp._called(rest)[0]))
    return found


@pytest.mark.cpu_only(
    reason="reads what XLA:CPU fuses, with its barrier pass off as a GPU's pipeline has it"
)
@pytest.mark.reads_compiled_names  # the kernels' source functions, from the stack frames
@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_the_global_factor_is_computed_once_for_all_leaves(method: str) -> None:
    """A transformer LM of 13 leaves: the norms' combination and the clip factor are in a few
    kernels, not repeated in each leaf's (XLA copies a cheap producer into every consumer's
    kernel unless it is stored: on the ghost path they were in 23 and 9 kernels, GPT-2 small's
    148 leaves many more, all compiled)."""
    loss, params, data = lm16(jnp.float32)
    assert len(jax.tree.leaves(params)) == 13
    found = _kernels_computing(loss, params, data, method)
    # ghost combines per-leaf norms; vmap sums the leaves' sums of squares in `measure`
    combine = "combine_l2_stacked" if method == "ghost" else "measure"
    assert found[combine] >= 1 and found["clip_factor"] >= 1, found
    assert found["from_leaf_norms"] <= 2 and found["clip_factor"] <= 2, found
