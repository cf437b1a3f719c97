"""Every read of JAX's internals, in one place, for every JAX version we support.

Ghost clipping reads traced programs (jaxprs): equations, their primitives and
parameters, nested jaxprs. These are JAX internals whose layout changes between
releases; this module is the only code of the package that touches them, so a
JAX release that changes a layout is handled here once:

- **scan** (jax 0.11, "Use FlatTree to structure scan arguments instead of
  num_carry, num_consts"): the parameters ``num_consts``, ``num_carry`` and
  ``linear`` were replaced by ``ft_in`` and ``ft_out``, ``FlatTree``\\ s whose
  ``unpack()`` gives the groups ``(consts, carry, xs)`` and ``(carry, ys)``;
  ``len(group)`` is the number of flat operands of a group. :func:`scan_info`
  reads either layout.
- **binding** (jax 0.9.2): ``Primitive.get_bind_params`` returns the parameters alone;
  before, ``(subfuns, params)``. :func:`bind` takes either.
- **Jaxpr / ClosedJaxpr** (jax 0.11, "Merge Jaxpr and ClosedJaxpr"): one class;
  a jaxpr is closed when it carries a value for each of its ``constvars``
  (``is_closed``), and ``.jaxpr`` of a closed jaxpr is the jaxpr itself.
  :func:`open_jaxpr` reads either.
- **threefry's CPU lowering** (every version so far): the CPU lowers
  ``threefry2x32`` as a rolled loop, GPUs and TPUs unrolled (the default rule).
  :func:`gpu_threefry_on_cpu` swaps the CPU's rule out for a while, so the CPU
  compiles a GPU trace's random draws as a GPU's fusions see them.

A parameter that a future release renames or removes is a :class:`LayoutError`
naming the primitive, the parameter and the JAX version, which the ghost
analysis turns into a per-leaf fallback with that reason, never a crash.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax import lax
from jax.extend import core as _jcore, random as _jrandom

__all__ = [
    "LayoutError",
    "Params",
    "ScanInfo",
    "bind",
    "gpu_threefry_on_cpu",
    "is_literal",
    "is_tracer",
    "jax_version",
    "manual_device_index",
    "mesh_context_of",
    "name_stack",
    "on_mesh_of",
    "open_jaxpr",
    "param",
    "params",
    "scan_info",
    "scan_or_none",
    "shape",
    "sub_jaxpr",
    "sub_jaxprs",
    "threefry2x32",
    "varying_axes",
    "vary_over",
    "with_params",
]

_MISSING = object()

# The parameter naming the jaxpr a call-like equation runs (pjit/jit: ``jaxpr``; closed_call,
# core_call, custom_jvp_call, custom_vjp_call: ``call_jaxpr``; custom_vjp_call_jaxpr before
# jax 0.6: ``fun_jaxpr``; checkpoint/remat2: ``jaxpr``).
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class LayoutError(KeyError):
    """An equation lacks a parameter in the layout this module knows (a JAX release changed it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


def jax_version() -> str:
    return str(jax.__version__)


class Params(dict):
    """An equation's parameters (a copy): reading one it lacks is a :class:`LayoutError`."""

    def __init__(self, eqn: Any) -> None:
        super().__init__(eqn.params)
        self.primitive = eqn.primitive.name

    def __missing__(self, name: str) -> Any:
        raise LayoutError(
            f"the {self.primitive!r} equations of jax {jax_version()} have no parameter {name!r} "
            f"(they have {sorted(self)}): gradclip_jax does not know this layout"
        )


def params(eqn: Any) -> Params:
    """Every parameter of ``eqn``, as a :class:`Params` copy (to read, or to rebind it changed)."""
    return Params(eqn)


def param(eqn: Any, name: str, default: Any = _MISSING) -> Any:
    """Parameter ``name`` of equation ``eqn``; ``default`` when given and absent, else :class:`LayoutError`."""
    p = eqn.params
    if name in p:
        return p[name]
    if default is not _MISSING:
        return default
    return Params(eqn)[name]


def with_params(eqn: Any, **updates: Any) -> Any:
    """``eqn`` with some parameters replaced."""
    return eqn.replace(params={**eqn.params, **updates})


@dataclass(frozen=True)
class ScanInfo:
    """A ``scan`` equation's structure, whatever the JAX version's parameter layout.

    Attributes:
      body: the body, a closed jaxpr over ``(*consts, *carry, *xs)`` giving ``(*carry, *ys)``.
      n_consts, n_carry: how many operands are constants and carries (the rest are ``xs``).
      length, reverse, unroll: as ``lax.scan``'s arguments.
    """

    body: Any
    n_consts: int
    n_carry: int
    length: int
    reverse: bool
    unroll: Any

    @property
    def n_fixed(self) -> int:
        """Operands before the ``xs``: constants and carries."""
        return self.n_consts + self.n_carry


def _scan_groups(eqn: Any) -> tuple[int, int]:
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:  # jax <= 0.10
        return int(p["num_consts"]), int(p["num_carry"])
    ft_in = p.get("ft_in")
    if ft_in is not None and hasattr(
        ft_in, "unpack"
    ):  # jax >= 0.11: FlatTree of (consts, carry, xs)
        groups = ft_in.unpack()
        if len(groups) == 3:
            return len(groups[0]), len(groups[1])
    return param(eqn, "num_consts"), param(
        eqn, "num_carry"
    )  # a LayoutError naming both layouts' miss


def scan_info(eqn: Any) -> ScanInfo:
    """The structure of a ``scan`` equation in jax <= 0.10's layout (``num_consts``,
    ``num_carry``) or jax >= 0.11's (``ft_in``, ``ft_out``)."""
    n_consts, n_carry = _scan_groups(eqn)
    return ScanInfo(
        param(eqn, "jaxpr"),
        n_consts,
        n_carry,
        int(param(eqn, "length")),
        bool(param(eqn, "reverse", False)),
        param(eqn, "unroll", 1),
    )


def scan_or_none(eqn: Any) -> ScanInfo | None:
    """:func:`scan_info` of a ``scan`` equation whose layout is known; ``None`` for any other
    equation, or a scan laid out as no supported JAX version does (it is then left as it is)."""
    if eqn.primitive.name != "scan":
        return None
    try:
        return scan_info(eqn)
    except LayoutError:
        return None


def shape(v: Any) -> tuple[int, ...]:
    """The shape of a jaxpr variable (or literal)."""
    return tuple(getattr(v.aval, "shape", ()))


def is_literal(v: Any) -> bool:
    """Whether a jaxpr atom is a literal (its value is ``v.val``), not a variable."""
    return isinstance(v, _jcore.Literal)


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a traced value (not known while tracing)."""
    return isinstance(x, jax.core.Tracer)


def jit_disabled() -> bool:
    """Whether ``jax.disable_jit()`` is in force (a jitted function then runs op by op)."""
    return bool(getattr(jax.config, "jax_disable_jit", False))


def tracing(tree: Any = ()) -> bool:
    """Whether this code runs inside a JAX transformation (``jit``, ``vmap``, ``scan``, ``grad``,
    ``shard_map``, a ``lower``) or has a traced value among ``tree``'s leaves: then a call does not
    run now, but as often as the program that holds it does."""
    from jax._src import core as _src_core  # (no public reader of the trace state)

    clean = getattr(_src_core, "trace_state_clean", None)
    if clean is None or not clean():  # (unknown: say traced, the answer that is never unsafe)
        return True
    return any(is_tracer(x) for x in jax.tree_util.tree_leaves(tree))


def open_jaxpr(j: Any) -> tuple[Any, list[Any] | None]:
    """``(jaxpr, consts)`` of a closed jaxpr, or ``(jaxpr, None)`` of an open one (its
    ``constvars``, if any, are bound by the caller)."""
    if hasattr(j, "jaxpr") and hasattr(j, "consts"):
        if getattr(j, "is_closed", True):  # jax >= 0.11: one class, closed when it holds its consts
            return j.jaxpr, list(j.consts)
        return j.jaxpr, None
    return j, None


def _is_jaxpr(j: Any) -> bool:
    return hasattr(j, "eqns") or (hasattr(j, "jaxpr") and hasattr(j, "consts"))


def sub_jaxpr(eqn: Any) -> Any | None:
    """The (closed or open) jaxpr a call-like equation runs once on its operands, if any."""
    for name in _CALL_PARAMS:
        j = eqn.params.get(name)
        if j is not None and _is_jaxpr(j):
            return j
    return None


def sub_jaxprs(eqn: Any) -> list[Any]:
    """Every (open) jaxpr nested in an equation's parameters: calls, scan and loop bodies, cond branches."""
    out = []
    for v in eqn.params.values():
        for j in v if isinstance(v, (tuple, list)) else (v,):
            if _is_jaxpr(j):
                out.append(open_jaxpr(j)[0])
    return out


def name_stack(eqn: Any) -> str:
    """The names of the scopes an equation was traced in (``jax.named_scope``, flax module paths)."""
    return str(getattr(getattr(eqn, "source_info", None), "name_stack", ""))


def bind(eqn: Any, invals: Sequence[Any], eqn_params: Mapping[str, Any] | None = None) -> list[Any]:
    """Applies one equation's primitive to ``invals`` (with ``eqn_params`` instead of its own when
    given), in the equation's context (its compute type, mesh and metadata), as a list of outputs."""
    bound = eqn.primitive.get_bind_params(dict(eqn.params if eqn_params is None else eqn_params))
    subfuns: tuple[Any, ...] = ()
    if isinstance(bound, tuple):  # jax <= 0.9.1: (subfuns, params); since 0.9.2 the params alone
        subfuns, bound = tuple(bound[0]), bound[1]
    with eqn.ctx.manager:
        ans = eqn.primitive.bind(*subfuns, *invals, **bound)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def threefry2x32(
    key: tuple[jax.Array, jax.Array], counts: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 (20 rounds) of each pair of uint32 words ``counts`` (equal shapes) under the
    pair of uint32 scalars ``key``: JAX's own primitive (``jax.extend.random``), the hash behind
    every threefry draw (``jax.random.bits`` of a key hashes the counter ``i`` for element ``i``).

    Inside ``shard_map`` the hash varies over every mesh axis its words vary over: the
    primitive (jax 0.10) types its result as the same on every device whatever its inputs, so
    a per-device key's bits, different on each device, would pass as replicated
    (``out_specs=P()``) and the replicas' noise silently differ."""
    words = (*key, *counts)
    axes = frozenset().union(*map(varying_axes, words))
    return tuple(vary_over(h, axes) for h in _jrandom.threefry2x32_p.bind(*words))  # type: ignore[return-value]


def varying_axes(x: Any) -> frozenset:
    """The ``shard_map`` mesh axes ``x`` varies over (empty outside ``shard_map``, and for a
    value that is not an array)."""
    try:
        aval = jax.typeof(x)
    except Exception:  # not an array
        return frozenset()
    return _aval_varying(aval)


# Equations that name mesh axes but move no values between devices: a device's own index, and
# the casts between values the same on every device and values that vary
_NO_TRANSFER = frozenset({"axis_index", "axis_size", "pvary", "pcast", "pbroadcast"})


def cross_device_axes(eqn: Any) -> frozenset:
    """The ``shard_map`` mesh axes over which ``eqn`` brings in other devices' values: those a
    collective (``psum``, ``all_gather``, ``ppermute``, ``reduce_scatter``, ...) names and one of
    its operands varies over. Empty for every other equation."""
    if eqn.primitive.name in _NO_TRANSFER:
        return frozenset()
    names: set[str] = set()
    for key in ("axes", "axis_name"):
        given = param(eqn, key, None)
        names.update(
            a
            for a in (given if isinstance(given, (tuple, list)) else (given,))
            if isinstance(a, str)
        )
    if not names:
        return frozenset()
    return frozenset(names) & frozenset().union(*(_aval_varying(v.aval) for v in eqn.invars))


def _aval_varying(aval: Any) -> frozenset:
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", frozenset()) or frozenset())
    return frozenset(getattr(aval, "vma", frozenset()) or frozenset())  # older jax


def on_mesh_of(x: Any, spec: Any) -> Any:
    """``spec`` (a ``PartitionSpec``) on the mesh of ``x``'s explicit sharding, as a
    ``NamedSharding``: a bare spec in ``out_sharding`` or ``reshard`` needs a mesh context
    (``jax.set_mesh``), which a caller whose arrays carry their mesh may not have entered."""
    return jax.sharding.NamedSharding(jax.typeof(x).sharding.mesh, spec)


def typed_sharding(x: Any) -> Any:
    """The sharding in ``x``'s type, or ``None`` where its type has none."""
    try:
        return jax.typeof(x).sharding
    except Exception:  # not an array, or no sharding in its type
        return None


def sharded_like(x: Any, ref: Any) -> Any:
    """``x`` resharded to ``ref``'s type-level sharding where ``ref`` has an explicit one that
    ``x`` lacks: a cotangent built from parts must carry its primal's sharding into a
    ``jax.vjp`` pull-back (``float32[1,64@model]``, not ``float32[1,64]``)."""
    want = ref.sharding if isinstance(ref, jax.ShapeDtypeStruct) else typed_sharding(ref)
    have = typed_sharding(x)
    if want is None or have is None or not hasattr(want, "spec"):
        return x
    if getattr(want.mesh, "empty", True):
        return x

    def entries(spec: Any) -> tuple:
        e = list(spec)
        while e and e[-1] is None:
            e.pop()
        return tuple(e)

    # the same mesh (axis types included: JAX's own lowerings place some values on an Auto
    # copy of an Explicit mesh) and the same spec: nothing to do
    if getattr(have, "mesh", None) == want.mesh and entries(have.spec) == entries(want.spec):
        return x
    return jax.sharding.reshard(x, want)


def einsum_out_sharding(subscripts: str, a: Any, b: Any) -> Any:
    """The output sharding of ``jnp.einsum(subscripts, a, b)`` under ``Explicit`` mesh axes,
    where JAX asks for one (a contraction over a sharded axis): each output axis keeps its
    operand's sharding (``a``'s first), a mesh axis used twice kept once, the contracted
    axes summed over their devices. ``None`` where neither operand is explicitly sharded."""
    specs = []
    for x in (a, b):
        try:
            sharding = jax.typeof(x).sharding
        except Exception:  # not an array, or no sharding in its type
            return None
        specs.append((sharding, tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))))
    if all(all(e is None for e in sp) for _, sp in specs):
        return None
    ins, out = subscripts.replace(" ", "").split("->")
    # an ellipsis stands for the same leading axes in every operand: name them by digits
    lead = max(len(sp) - len(t.replace("...", "")) for t, (_, sp) in zip(ins.split(","), specs))
    dots = "".join(map(str, range(lead)))
    ins, out = ins.replace("...", dots), out.replace("...", dots)
    of: dict[str, Any] = {}
    for letters, (_, sp) in zip(ins.split(","), specs, strict=True):
        for c, e in zip(letters, sp, strict=True):
            of[c] = of.get(c) or e
    used: set = set()
    entries = []
    for c in out:
        names = of.get(c)
        names = names if isinstance(names, tuple) else (() if names is None else (names,))
        kept = tuple(n for n in names if n not in used)
        used.update(kept)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    mesh = next(sh.mesh for sh, sp in specs if any(e is not None for e in sp))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries))


def mesh_context_of(tree: Any) -> contextlib.AbstractContextManager:
    """A context with the abstract mesh of ``tree``'s explicitly sharded arrays, where no mesh
    is in context (``jax.set_mesh`` not entered); else a context that does nothing."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    for x in jax.tree_util.tree_leaves(tree):
        try:
            sharding = jax.typeof(x).sharding
        except Exception:  # not an array, or no sharding in its type
            continue
        mesh = getattr(sharding, "mesh", None)
        if (
            mesh is not None
            and not getattr(mesh, "empty", True)
            and any(s is not None for s in getattr(sharding, "spec", ()))
        ):
            return jax.sharding.use_abstract_mesh(mesh)
    return contextlib.nullcontext()


def manual_device_index() -> jax.Array:
    """Inside ``shard_map``: this device's index over the mesh axes that are manual there (its
    position in the per-device program); ``0`` elsewhere (one program for the whole mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(getattr(mesh, "manual_axes", ()) or ())
    return lax.axis_index(axes) if axes else jax.numpy.int32(0)


def vary_over(x: Any, axes: frozenset) -> Any:
    """``x`` marked as varying over ``axes`` too (``lax.pcast``), inside ``shard_map``."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


@contextlib.contextmanager
def gpu_threefry_on_cpu() -> Iterator[bool]:
    """Inside, programs lowered for the CPU draw random bits as on a GPU: threefry's 20 rounds
    unrolled into elementwise ops, which XLA fuses into the draw's consumers, instead of the
    CPU's rolled loop. Yields whether it could (``False``: this JAX keeps its rules elsewhere,
    and nothing changed). For reading, on the CPU, how a GPU's compiler sees a program's noise
    (``benchmarks/bench_cost.py``); programs lowered inside and run on the CPU give the same bits.
    """
    try:
        from jax._src.interpreters import mlir

        cpu_rules = mlir._platform_specific_lowerings["cpu"]
    except (ImportError, AttributeError, KeyError):
        yield False
        return
    prim = _jrandom.threefry2x32_p
    saved = cpu_rules.pop(prim, None)
    try:
        yield saved is not None
    finally:
        if saved is not None:
            cpu_rules[prim] = saved
