"""The package layout: no import cycle, modules import on their own, one trace of the loss
per clipped_grad call, and one home per idea: packages meet through explicit APIs, module and
class names are unique, the foundations (``_core``) import no feature package, primitive names
live under the ghost rules, no module is long and few functions are."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import gradclip_jax
from gradclip_jax import clipped_grad
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
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(n) :], n]))
            if n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_imports_flow_one_way():
    """Strategies may import the lower layers, never the api; the lower layers never a strategy."""
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    lower = {"_batch", "_example_norms", "_clip_sum", "_chunks", "_config"}
    for name, deps in graph.items():
        if name.startswith("gradclip_jax.per_example.") and name != "gradclip_jax.per_example.api":
            assert "gradclip_jax.per_example.api" not in deps, name
        if name.rsplit(".", 1)[-1] in lower and name.count(".") == 2 and ".per_example." in name:
            assert not any("ghost" in d or d.endswith("_vmap") for d in deps), (name, deps)


@pytest.mark.parametrize(
    "module",
    [
        "gradclip_jax.per_example.ghost.rules.dense",
        "gradclip_jax.per_example._clip_sum",
        "gradclip_jax.dp.aggregate",
        "gradclip_jax.per_example.ghost",
        "gradclip_jax._core.factors",
        "gradclip_jax.transforms.growth",
        "gradclip_jax.per_example.internal",
    ],
)
def test_module_imports_in_isolation(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT.parent)


def _counting(loss):
    calls = []

    def counted(p, b):
        calls.append(1)
        return loss(p, b)

    return counted, calls


@pytest.mark.parametrize(
    "method,nan_safe,ghost_sum,expected",
    [
        ("ghost", False, "backward", 1),
        ("ghost", True, "bookkeeping", 1),
        ("ghost", True, "backward", 2),
        ("vmap", True, "auto", 2),
    ],
)
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


def test_ghost_through_the_one_example_program_traces_three_times():
    """A loss the rules lose the batch in (a Cholesky factorization, which has no rule): the
    batched analysis trace, then the one-example program's two (at ``B`` and ``B + 1``
    examples), whose jaxpr the probed passes use; no trace for a fallback."""
    loss, params, data = mlp_setup()

    def factored(x):  # per example, but through a primitive the analysis does not know
        spd = jnp.eye(x.shape[-1]) + x[:, :, None] * x[:, None, :]
        return jnp.diagonal(jnp.linalg.cholesky(spd), axis1=-2, axis2=-1)

    counted, calls = _counting(lambda p, b: loss(p, {**b, "x": factored(b["x"])}))
    jax.make_jaxpr(clipped_grad(counted, 1.0, method="ghost", nan_safe=False))(params, data)
    assert len(calls) == 3


def test_ghost_falling_back_traces_twice():
    """A loss the rules find mixing examples (rows regrouped across the batch): the one
    analysis trace, then the vmap strategy's trace."""
    loss, params, data = mlp_setup()

    def regrouped(p, b):
        n = b["x"].shape[0]
        return jnp.mean(jnp.reshape(loss(p, b)[:, None] * jnp.ones((n, 2)), (2, n)), axis=0)

    counted, calls = _counting(regrouped)
    jax.make_jaxpr(clipped_grad(counted, 1.0, method="ghost", nan_safe=False))(params, data)
    assert len(calls) == 2


def _internal_reads(tree: ast.AST) -> list[str]:
    """Reads of JAX's internals in a module's code: an equation's parameters (``x.params[...]``,
    ``x.params.get(...)``, ``eqn.params``), binding machinery and private JAX modules."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if (
                node.attr == "params"
                and isinstance(node.value, ast.Name)
                and node.value.id in ("eqn", "e", "c")
            ):
                found.append(f"{node.value.id}.params")
            if node.attr in ("get_bind_params", "manager", "num_consts", "num_carry", "ft_in"):
                found.append(node.attr)
            if (
                isinstance(node.value, ast.Attribute)
                and node.value.attr == "params"
                and node.attr in ("get", "items", "keys", "values")
            ):
                found.append(f"params.{node.attr}")
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "params"
        ):
            found.append("params[...]")
        if isinstance(node, ast.Constant) and node.value in (
            "num_consts",
            "num_carry",
            "ft_in",
            "ft_out",
        ):
            found.append(repr(node.value))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
            )
            found += [
                n for n in names if n.startswith(("jax._src", "jax.extend", "jax.interpreters"))
            ]
    return found


def test_jax_internals_are_read_in_one_place():
    """Every read of a jaxpr equation's parameters, JAX's binding machinery and its private
    modules goes through ``_core/jaxcompat.py``, which handles each supported JAX version's layout."""
    home = ROOT / "_core" / "jaxcompat.py"
    offenders = {
        str(p.relative_to(ROOT)): reads
        for p in ROOT.rglob("*.py")
        if p != home and (reads := _internal_reads(ast.parse(p.read_text())))
    }
    assert offenders == {}


def test_internal_reads_are_found():
    """The check above finds each kind of read it looks for."""
    src = (
        "from jax.extend import core\nimport jax._src.core\n"
        "a = eqn.params['axis']\nb = e.params\nc = x.params.get('k')\nd = p['num_consts']\n"
        "eqn.primitive.get_bind_params(q)\nwith eqn.ctx.manager: pass\n"
    )
    reads = _internal_reads(ast.parse(src))
    for r in (
        "jax.extend",
        "jax._src.core",
        "params[...]",
        "eqn.params",
        "e.params",
        "params.get",
        "'num_consts'",
        "get_bind_params",
        "manager",
    ):
        assert r in reads, r
    assert _internal_reads(ast.parse("loss(call.params, batch)\nf(params['w'])")) == []


# ---------------------------------------------------------------------------
# One home per idea (issue 30): packages talk through their explicit APIs
# ---------------------------------------------------------------------------

CORE = "gradclip_jax._core"


def _all_imports(path: pathlib.Path) -> set[str]:
    """Every module of the package that ``path`` imports, at module level or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in MODULES else node.module)
    return {m for m in out if m in MODULES}


def _package_of(name: str) -> str:
    """The top-level package a module belongs to (``gradclip_jax.dp``, ``gradclip_jax._core``, ...);
    the package root itself for a top-level module (``gradclip_jax.monitor``)."""
    parts = name.split(".")
    if len(parts) == 2 and MODULES[name].name != "__init__.py":
        return parts[0]
    return ".".join(parts[:2])


def _private_across(importer: str, imported: str) -> bool:
    """Whether ``imported`` is a private module (a component starting with ``_`` other than the
    foundations package ``_core`` itself) of a package other than ``importer``'s."""
    home = _package_of(importer)
    if imported == home or (imported.startswith(home + ".") and home != "gradclip_jax"):
        return False
    return any(p.startswith("_") and f"gradclip_jax.{p}" != CORE for p in imported.split(".")[1:])


def test_no_import_of_another_packages_private_module():
    """A package reaches another through that package's explicit API (its ``__init__`` or a
    non-underscore module such as ``per_example.internal``), never through a private module."""
    offenders = sorted(
        (name, m)
        for name, path in MODULES.items()
        for m in _all_imports(path)
        if _private_across(name, m)
    )
    assert offenders == []


def test_private_import_check_finds_offenders():
    assert _private_across("gradclip_jax.dp.aggregate", "gradclip_jax.per_example._batch")
    assert _private_across("gradclip_jax.functional", "gradclip_jax.transforms._stateful")
    assert _private_across("gradclip_jax.dp.noise", "gradclip_jax._core.norms._reduce")
    assert not _private_across(
        "gradclip_jax.per_example.ghost._strategy", "gradclip_jax.per_example._batch"
    )
    assert not _private_across("gradclip_jax.dp.aggregate", "gradclip_jax._core.factors")
    assert not _private_across("gradclip_jax.dp.aggregate", "gradclip_jax.per_example.internal")


def test_module_names_are_unique():
    """No two modules of the package share a file name (``__init__`` aside), and none shadows a
    module of the standard library."""
    stems: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            stems.setdefault(path.stem, []).append(name)
    assert {s: ns for s, ns in stems.items() if len(ns) > 1} == {}
    assert sorted(s for s in stems if s in sys.stdlib_module_names) == []


def test_class_names_are_unique():
    classes: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(name)
    assert {c: ns for c, ns in classes.items() if len(ns) > 1} == {}


def test_core_imports_no_feature_package():
    """The foundations (``_core``) import nothing of the package outside ``_core``, so every
    other package may use them and imports flow one way."""
    offenders = {
        name: sorted(m for m in _all_imports(path) if not m.startswith(CORE))
        for name, path in MODULES.items()
        if name.startswith(CORE)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def _primitive_names() -> set[str]:
    """The names of JAX's primitives (every ``Primitive`` object of the loaded jax modules)."""
    import jax._src.lax.control_flow  # noqa: F401  (loads the control-flow primitives)
    from jax.extend.core import Primitive

    names = set()
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("jax"):
            names |= {v.name for v in list(vars(mod).values()) if isinstance(v, Primitive)}
    return names


def _primitive_name_uses(tree: ast.AST, names: set[str]) -> list[str]:
    """Primitive names a module acts on: string constants that are primitive names, compared
    with a primitive's name (``eqn.primitive.name == 'x'``, ``name in (...)``, ``prim != 'x'``)
    or held in a set literal (a table of primitives)."""

    def strings(node: ast.AST) -> list[str]:
        return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names]

    def names_a_primitive(node: ast.AST) -> bool:
        text = ast.unparse(node)
        return "prim" in text or text == "name" or text.endswith(".name")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
            names_a_primitive(x) for x in [node.left, *node.comparators]
        ):
            found += [s for x in [node.left, *node.comparators] for s in strings(x)]
        if isinstance(node, ast.Set):
            found += strings(node)
    return found


def test_primitive_names_live_under_the_ghost_rules():
    """Every JAX primitive the package acts on by name is named under ``per_example/ghost/rules``
    (or read in ``_core/jaxcompat.py``): the rest of the package uses those names through them."""
    names = _primitive_names()
    allowed = (ROOT / "per_example" / "ghost" / "rules", ROOT / "_core" / "jaxcompat.py")
    offenders = {
        str(p.relative_to(ROOT)): uses
        for p in ROOT.rglob("*.py")
        if not any(p == a or a in p.parents for a in allowed)
        and (uses := _primitive_name_uses(ast.parse(p.read_text()), names))
    }
    assert offenders == {}


def test_primitive_name_uses_are_found():
    names = {"gather", "slice", "add", "cond"}
    src = (
        "if eqn.primitive.name == 'gather': pass\nif name in ('slice', 'x'): pass\n"
        "OPS = frozenset({'add'})\nif spec.kind == 'cond': pass\nhps.add('add', 1)\n"
    )
    assert sorted(_primitive_name_uses(ast.parse(src), names)) == ["add", "gather", "slice"]


def _lines_of_code(path: pathlib.Path, root: pathlib.Path = ROOT) -> dict[str, int]:
    """Lines of code of every function of a module (``module:qualified.name``): its lines, nested
    functions included, that are neither blank, nor a comment, nor part of a docstring."""
    src = path.read_text()
    tree = ast.parse(src)
    docs: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module))
            and node.body
        ):
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docs.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    code = {
        i
        for i, line in enumerate(src.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#")
    } - docs
    out = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                name = f"{prefix}{child.name}"
                out[name] = sum(1 for i in code if start <= i <= (child.end_lineno or start))
                visit(child, name + ".")
            else:
                visit(
                    child, f"{prefix}{child.name}." if isinstance(child, ast.ClassDef) else prefix
                )

    visit(tree, f"{path.relative_to(root)}:")
    return out


LONG_FUNCTION = 60
MAX_LONG_FUNCTIONS = 5


def test_few_long_functions():
    """At most five functions over 60 lines of code: a transform's ``update`` reads as its math,
    with its steps in named helpers."""
    sizes = {k: v for p in ROOT.rglob("*.py") for k, v in _lines_of_code(p).items()}
    long = sorted(((n, k) for k, n in sizes.items() if n > LONG_FUNCTION), reverse=True)
    assert len(long) <= MAX_LONG_FUNCTIONS, long


MAX_MODULE_LINES = 600


def _long_modules(paths: dict[str, pathlib.Path], limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    """The modules of ``paths`` over ``limit`` lines, with their line counts."""
    counts = {name: len(path.read_text().splitlines()) for name, path in sorted(paths.items())}
    return {name: n for name, n in counts.items() if n > limit}


def test_no_module_is_long():
    """No module is over 600 lines: a longer one (or one holding two ideas) becomes a package whose
    files show the design, a folder per concern and a file per idea, named for what it does."""
    long = _long_modules({str(p.relative_to(ROOT.parent)): p for p in MODULES.values()})
    assert long == {}, (
        f"modules over {MAX_MODULE_LINES} lines (split each into a package of its ideas): "
        + (", ".join(f"{name} ({n} lines)" for name, n in long.items()))
    )


def test_long_module_check_finds_offenders(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _long_modules({p.name: p for p in tmp_path.iterdir()}) == {
        "long.py": MAX_MODULE_LINES + 1
    }


def test_every_loaded_module_comes_from_this_tree():
    """No module of the package is loaded from elsewhere (a stale import of a moved module that an
    installed copy of the package would still answer)."""
    foreign = {
        name: getattr(mod, "__file__", None)
        for name, mod in list(sys.modules.items())
        if (name == "gradclip_jax" or name.startswith("gradclip_jax."))
        and getattr(mod, "__file__", None)
        and ROOT not in pathlib.Path(mod.__file__).parents
    }
    assert foreign == {}


# ---------------------------------------------------------------------------
# benchmarks/ is kept like the package: no import cycle, short functions
# ---------------------------------------------------------------------------

BENCHMARKS = ROOT.parent / "benchmarks"


def _benchmark_modules() -> dict[str, pathlib.Path]:
    modules = {}
    for p in BENCHMARKS.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return modules


def _benchmark_imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ``benchmarks`` that ``path`` imports, at module level or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            }
    return {m for m in out if m in modules}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (found := visit(n, [*stack, n])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_benchmarks_have_no_import_cycle():
    """No benchmark module imports, even inside a function, one that imports it back: the suites
    share ``benchmarks/models.py``, ``benchmarks/steps.py`` and ``benchmarks/common.py``."""
    modules = _benchmark_modules()
    graph = {name: _benchmark_imports(path, modules) - {name} for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_benchmark_suites_import_no_private_name_of_another_module():
    """A benchmark module imports no ``_name`` from another benchmark module: what two suites
    share lives, public, in ``models``, ``steps`` or ``common``."""
    modules = _benchmark_modules()
    offenders = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                offenders += [
                    (name, f"{node.module}.{a.name}") for a in node.names if a.name.startswith("_")
                ]
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in ("bg", "bd", "bgh", "bn", "pg", "bc")
            ):
                offenders.append((name, f"{node.value.id}.{node.attr}"))
    assert offenders == []


def test_no_benchmark_function_is_long():
    """No function of ``benchmarks/`` is over 60 lines of code (the package's own measure)."""
    sizes = {
        k: v for p in BENCHMARKS.rglob("*.py") for k, v in _lines_of_code(p, BENCHMARKS).items()
    }
    assert sorted((n, k) for k, n in sizes.items() if n > LONG_FUNCTION) == []


# ---------------------------------------------------------------------------
# Settings are read from the module that defines them
# ---------------------------------------------------------------------------

CONSTANTS = {
    "ONCE_ROUNDING",  # a property of TF32's rounding, which no one sets
    "DELTA",  # the demo's delta, a default argument of its functions (gradclip_jax.demo.output)
}


def _is_number(node: ast.AST | None) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return _is_number(node.left) and _is_number(node.right)
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("int", "float")
        and all(_is_number(a) for a in node.args)
    )


def _numeric_settings(modules: dict[str, pathlib.Path]) -> set[str]:
    """Module-level UPPER_CASE names bound to a number anywhere in the package."""
    names = set()
    for path in modules.values():
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if _is_number(getattr(node, "value", None)):
                names |= {t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()}
    return names - CONSTANTS


def _runtime_imports(tree: ast.AST) -> list[ast.ImportFrom]:
    """The ``from ... import`` statements of a module, those under ``if TYPE_CHECKING:`` aside."""
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in (
                "TYPE_CHECKING",
                "typing.TYPE_CHECKING",
            ):
                continue
            if isinstance(child, ast.ImportFrom):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def _settings_copied(modules: dict[str, pathlib.Path]) -> list[tuple[str, str]]:
    settings = _numeric_settings(modules)
    return sorted(
        (name, a.name)
        for name, path in modules.items()
        for node in _runtime_imports(ast.parse(path.read_text()))
        if (node.module or "").startswith("gradclip_jax")
        for a in node.names
        if a.name in settings
    )


def test_settings_are_read_from_their_module():
    """No module imports a numeric setting by name (a copy, which assigning the setting would not
    change): it reads ``module.SETTING`` when it decides, and a module that shows the setting under
    another path forwards it (``gradclip_jax._core.settings.forward_settings``)."""
    assert _settings_copied(MODULES) == []


def test_settings_copy_check_finds_offenders(tmp_path):
    (tmp_path / "home.py").write_text("LIMIT = 2**20\nNAME = 'x'\nTABLE = {'cpu': 1}\n")
    (tmp_path / "user.py").write_text(
        "from typing import TYPE_CHECKING\nfrom gradclip_jax.home import LIMIT, NAME\n"
        "if TYPE_CHECKING:\n    from gradclip_jax.home import LIMIT as L2\n"
    )
    (tmp_path / "shows.py").write_text(
        "if TYPE_CHECKING:\n    from gradclip_jax.home import LIMIT\n"
    )
    modules = {f"gradclip_jax.{p.stem}": p for p in tmp_path.iterdir()}
    assert _settings_copied(modules) == [("gradclip_jax.user", "LIMIT")]


# ---------------------------------------------------------------------------
# No underscored name crosses a module
# ---------------------------------------------------------------------------


def _absolute(name: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement of module ``name`` (file ``path``) reads."""
    if node.level == 0:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names_across(modules: dict[str, pathlib.Path]) -> list[tuple[str, str]]:
    """``(importer, module.name)`` for every ``_name`` a module of ``modules`` takes from another:
    ``from module import _name``, or ``alias._name`` where ``alias`` is an imported module.
    A private *module* (``from gradclip_jax.per_example import _batch``) is not a name."""
    offenders = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        aliases[a.asname or a.name.split(".")[0]] = (
                            a.name if a.asname else a.name.split(".")[0]
                        )
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(name, path, node)
                for a in node.names:
                    if f"{source}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{source}.{a.name}"
                    elif source in modules and source != name and _is_private(a.name):
                        offenders.append((name, f"{source}.{a.name}"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                chain, value = [], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in aliases:
                    owner = ".".join([aliases[value.id], *reversed(chain)])
                    if owner in modules and owner != name and f"{owner}.{node.attr}" not in modules:
                        offenders.append((name, f"{owner}.{node.attr}"))
    return sorted(offenders)


def test_no_private_name_crosses_a_module():
    """A name another module of the package uses is not private: no module imports a ``_name``
    from another (or reads ``module._name``); private *modules* are fine."""
    assert _private_names_across(MODULES) == []


def test_private_name_check_finds_offenders(tmp_path):
    pkg = tmp_path / "gradclip_jax"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "_home.py").write_text("def _helper(): ...\ndef public(): ...\n")
    (pkg / "sub" / "user.py").write_text(
        "from gradclip_jax.sub._home import _helper, public\nfrom . import _home\nfrom ._home import _helper as h\n"
        "import gradclip_jax.sub._home as home\nhome._helper(); _home._helper(); home.__name__; _home.public()\n"
        "def _mine(): ...\n"
    )
    (pkg / "sub" / "self.py").write_text(
        "def _own(): ...\nimport gradclip_jax.sub.self as me\nme._own()\n"
    )
    modules = {
        ".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
        for p in pkg.rglob("*.py")
    }
    assert _private_names_across(modules) == [
        ("gradclip_jax.sub.user", "gradclip_jax.sub._home._helper"),
        ("gradclip_jax.sub.user", "gradclip_jax.sub._home._helper"),
        ("gradclip_jax.sub.user", "gradclip_jax.sub._home._helper"),
        ("gradclip_jax.sub.user", "gradclip_jax.sub._home._helper"),
    ]


# ---------------------------------------------------------------------------
# One public import path per public name
# ---------------------------------------------------------------------------

#: Deprecation shims of moved modules: they warn on import and list nothing (CHANGELOG.md).
SHIMS = {
    "gradclip_jax.ghost",
    "gradclip_jax.privacy",
    "gradclip_jax.dp.batch_selection",
    "gradclip_jax.dp.user_sampling",
}


def _public_modules() -> list[str]:
    """The package's modules whose dotted path has no ``_`` component, shims aside."""
    return sorted(
        name
        for name in MODULES
        if name not in SHIMS and not any(p.startswith("_") for p in name.split(".")[1:])
    )


def _exporters() -> dict[tuple[str, int], list[str]]:
    """For each public object (name and identity; a setting by name), the public modules whose
    ``__all__`` lists it."""
    import importlib
    import types

    found: dict[tuple[str, int], list[str]] = {}
    for name in _public_modules():
        try:
            module = importlib.import_module(name)
        except ImportError:  # interop.jax_privacy without its extra: its names are its own anyway
            continue
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if isinstance(obj, types.ModuleType):
                continue  # a subpackage listed by its parent is a path, not a second home
            key = (attr, 0 if isinstance(obj, (int, float, str, dict, tuple)) else id(obj))
            found.setdefault(key, []).append(name)
    return found


def test_every_public_name_has_one_home():
    """Each public object is listed in exactly one public ``__all__``: ``gradclip_jax`` for the
    everyday API, else the subpackage of its concern (CONTRIBUTING.md, "Import paths")."""
    assert {key[0]: homes for key, homes in _exporters().items() if len(homes) > 1} == {}


def test_the_everyday_api_is_at_the_top():
    exported = {key[0] for key in _exporters()}
    for name in (
        "clip_by_global_norm",
        "clipped_grad",
        "make_private",
        "PrivacyAccountant",
        "ghost_report",
        "dp_aggregate",
        "tree_norm",
        "inject_hyperparams",
        "norms_from_state",
    ):
        assert name in gradclip_jax.__all__ and name in exported
    assert "ghost" not in gradclip_jax.__all__ and "privacy" not in gradclip_jax.__all__


def test_dp_names_read_at_gcx_dp_name_their_one_home():
    """``shared/API.md`` lists ``epsilon``, ``calibrate_noise_multiplier`` and
    ``add_gaussian_noise`` under ``gcx.dp``: reading them there is an AttributeError naming the
    submodule that is their one home, and each is listed in that home's ``__all__``."""
    import importlib

    for name, home in gradclip_jax.dp._HOMES.items():
        assert name in importlib.import_module(home).__all__
        with pytest.raises(AttributeError, match=rf"one import path is {home}\.{name}"):
            getattr(gradclip_jax.dp, name)


@pytest.mark.parametrize(
    "old,names",
    [
        (
            "ghost",
            {
                "ghost_report": "gradclip_jax",
                "GhostReport": "gradclip_jax",
                "GhostFallbackWarning": "gradclip_jax",
            },
        ),
        (
            "privacy",
            {
                "epsilon": "gradclip_jax.dp.accounting",
                "calibrate_noise_multiplier": "gradclip_jax.dp.accounting",
                "dp_sgd_event": "gradclip_jax.dp.accounting",
                "PrivacyPhase": "gradclip_jax.dp.accounting",
                "add_gaussian_noise": "gradclip_jax.dp.noise",
                "NOISE_STRATEGY": "gradclip_jax.dp.noise",
                "PrivacyAccountant": "gradclip_jax",
            },
        ),
    ],
)
def test_moved_modules_warn_and_serve_their_names(old, names):
    """A moved module warns when imported and serves each old name, warning with its new path;
    the object is the very one at the new path."""
    import importlib

    from tests.moved import import_moved

    shim = import_moved(old)
    for name, home in names.items():
        with pytest.warns(DeprecationWarning, match=rf"import from {home}\.{name} instead"):
            obj = getattr(shim, name)
        assert obj is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError):
        shim.not_a_name  # noqa: B018


def test_settings_assigned_through_the_old_paths_take_effect(monkeypatch):
    from gradclip_jax.dp import noise
    from gradclip_jax.per_example import ghost
    from gradclip_jax.per_example.ghost._analysis import policy
    from tests.moved import import_moved

    old_ghost, old_privacy = import_moved("ghost"), import_moved("privacy")
    for setting in ("AUTO_MIN_ELEMENTS", "AUTO_MIN_ELEMENTS_NO_FALLBACK", "BOOKKEEPING_MAX_SHARE"):
        monkeypatch.setattr(old_ghost, setting, 7)
        assert getattr(policy, setting) == getattr(ghost, setting) == 7
    monkeypatch.setattr(old_privacy, "NOISE_BLOCK_SIZE", 4096)
    assert noise.NOISE_BLOCK_SIZE == 4096


# ---------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------

FORMATTED = ("gradclip_jax", "tests", "benchmarks", "tools", "conftest.py")


def test_code_is_formatted():
    """``ruff format --check`` (the project's config: line length 100) finds nothing to change;
    ``.ci/run``'s ruff stage runs the same check."""
    import shutil

    ruff = shutil.which("ruff") or shutil.which(
        "ruff", path=str(pathlib.Path(sys.executable).parent)
    )
    if ruff is None:
        pytest.skip("ruff is not installed")
    proc = subprocess.run(
        [ruff, "format", "--check", *FORMATTED], cwd=ROOT.parent, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_ci_checks_the_formatting():
    ci = (ROOT.parent / ".ci" / "run").read_text()
    assert f"ruff format --check {' '.join(FORMATTED)}" in ci
