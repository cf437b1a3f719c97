"""The package layout: no import cycle, modules import on their own, and one trace
of the loss per clipped_grad call."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import gradclip_jax
from gradclip_jax.per_example import clipped_grad
from tests._backend import refuses_backward
from tests.per_example.models import mlp_setup

ROOT = pathlib.Path(gradclip_jax.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Modules of the package that ``name`` imports at import time (module-level statements)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in MODULES else node.module)
    return {m for m in out if m in MODULES and m != name}


def test_no_import_cycle():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(n):], n]))
            if n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_imports_flow_one_way():
    """Strategies may import the lower layers, never the api; the lower layers never a strategy."""
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    lower = {"_batch", "_measure", "_sums", "_chunks", "_config"}
    for name, deps in graph.items():
        if name.startswith("gradclip_jax.per_example.") and name != "gradclip_jax.per_example.api":
            assert "gradclip_jax.per_example.api" not in deps, name
        if name.rsplit(".", 1)[-1] in lower and name.count(".") == 2 and ".per_example." in name:
            assert not any("ghost" in d or d.endswith("_vmap") for d in deps), (name, deps)


@pytest.mark.parametrize("module", ["gradclip_jax.per_example.ghost.rules.dense", "gradclip_jax.per_example._sums",
                                    "gradclip_jax.dp.aggregate", "gradclip_jax.ghost"])
def test_module_imports_in_isolation(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT.parent)


def _counting(loss):
    calls = []

    def counted(p, b):
        calls.append(1)
        return loss(p, b)

    return counted, calls


@pytest.mark.parametrize("method,nan_safe,ghost_sum,expected", [
    ("ghost", False, "backward", 1), ("ghost", True, "bookkeeping", 1), ("ghost", True, "backward", 2),
    ("vmap", True, "auto", 2)])
def test_loss_traced_once_per_call(method, nan_safe, ghost_sum, expected):
    """Ghost: one trace (shape check, analysis and the probed passes all use its jaxpr);
    with ``nan_safe`` and a second backward pass, plus the per-example trace of the branch
    that runs only when a dropped example is not finite (book-keeping's safe branch reuses
    the stored values). vmap: the shape check and the per-example trace."""
    loss, params, data = mlp_setup()
    counted, calls = _counting(loss)
    fn = clipped_grad(counted, 1.0, method=method, nan_safe=nan_safe, ghost_sum=ghost_sum)
    if method == "ghost" and refuses_backward(ghost_sum, lambda: jax.make_jaxpr(fn)(params, data)):
        return
    jax.make_jaxpr(fn)(params, data)
    assert len(calls) == expected


def test_ghost_falling_back_traces_twice():
    """A loss ghost clipping cannot follow (a Cholesky factorization, which has no rule): the one
    analysis trace, then the vmap strategy's trace."""
    loss, params, data = mlp_setup()

    def factored(x):  # per example, but through a primitive the analysis does not know
        spd = jnp.eye(x.shape[-1]) + x[:, :, None] * x[:, None, :]
        return jnp.diagonal(jnp.linalg.cholesky(spd), axis1=-2, axis2=-1)

    counted, calls = _counting(lambda p, b: loss(p, {**b, "x": factored(b["x"])}))
    jax.make_jaxpr(clipped_grad(counted, 1.0, method="ghost", nan_safe=False))(params, data)
    assert len(calls) == 2


def _internal_reads(tree: ast.AST) -> list[str]:
    """Reads of JAX's internals in a module's code: an equation's parameters (``x.params[...]``,
    ``x.params.get(...)``, ``eqn.params``), binding machinery and private JAX modules."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr == "params" and isinstance(node.value, ast.Name) and node.value.id in ("eqn", "e", "c"):
                found.append(f"{node.value.id}.params")
            if node.attr in ("get_bind_params", "manager", "num_consts", "num_carry", "ft_in"):
                found.append(node.attr)
            if isinstance(node.value, ast.Attribute) and node.value.attr == "params" and node.attr in (
                    "get", "items", "keys", "values"):
                found.append(f"params.{node.attr}")
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "params":
            found.append("params[...]")
        if isinstance(node, ast.Constant) and node.value in ("num_consts", "num_carry", "ft_in", "ft_out"):
            found.append(repr(node.value))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [n for n in names if n.startswith(("jax._src", "jax.extend", "jax.interpreters"))]
    return found


def test_jax_internals_are_read_in_one_place():
    """Every read of a jaxpr equation's parameters, JAX's binding machinery and its private
    modules goes through ``_core/jaxcompat.py``, which handles each supported JAX version's layout."""
    home = ROOT / "_core" / "jaxcompat.py"
    offenders = {str(p.relative_to(ROOT)): reads for p in ROOT.rglob("*.py") if p != home
                 and (reads := _internal_reads(ast.parse(p.read_text())))}
    assert offenders == {}


def test_internal_reads_are_found():
    """The check above finds each kind of read it looks for."""
    src = ("from jax.extend import core\nimport jax._src.core\n"
           "a = eqn.params['axis']\nb = e.params\nc = x.params.get('k')\nd = p['num_consts']\n"
           "eqn.primitive.get_bind_params(q)\nwith eqn.ctx.manager: pass\n")
    reads = _internal_reads(ast.parse(src))
    for r in ("jax.extend", "jax._src.core", "params[...]", "eqn.params", "e.params", "params.get",
              "'num_consts'", "get_bind_params", "manager"):
        assert r in reads, r
    assert _internal_reads(ast.parse("loss(call.params, batch)\nf(params['w'])")) == []
