"""What a compiled XLA program says of each of its instructions (``compiled.as_text()``).

Two readings, both keyed by instruction name, which is what a profiler trace's
events name (their ``hlo_op``):

* :func:`hlo_hints`: what the instruction holds (a dot and its precision, a
  convolution, a reduction, a copy, elementwise work), and whether it runs
  inside a while body;
* :func:`hlo_phases`: which part of a DP training step wrote it (:data:`PHASES`),
  read from the source locations JAX records with each instruction (the module's
  ``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames`` tables
  and each instruction's ``stack_frame_id``): the model's forward and backward
  pass, the per-example norms and clip factors, the clipped sum, the noise, or
  the optimizer. A fused kernel is attributed by its root instruction's source.

Both are plain text parsing, tested on XLA:CPU's programs; a GPU's program has
the same form. JAX keeps the trace of a jitted helper (``jnp.where``'s, say) for
later calls with the source of its first trace, so a few of a step's ops may be
attributed to wherever that helper was first traced; the random number
generation, whose cached traces are large, is read by its ops' names instead.
"""

from __future__ import annotations

import re

__all__ = [
    "PHASES",
    "distinct_kernel_count",
    "every_step_variadic_reductions",
    "hlo_hints",
    "hlo_phases",
    "kernel_count",
    "phase_of",
]

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# an instruction line: its name, result type, opcode and the rest of the line
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_COPY_LIKE = {
    "parameter",
    "constant",
    "bitcast",
    "copy",
    "transpose",
    "reshape",
    "broadcast",
    "tuple",
    "get-tuple-element",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "pad",
    "copy-start",
    "copy-done",
    "iota",
}


def _precision(rest: str) -> str:
    """The precision of an HLO dot or convolution from its attributes (or a gemm's backend config)."""
    low = rest.lower()
    algo = re.search(r"algorithm[\"=:]+\"?(?:alg_)?(?:dot_)?([a-z0-9_]+)", low)
    if algo and algo.group(1) not in ("unset", "alg_unset"):
        name = algo.group(1)
        for key, label in (
            ("tf32_tf32_f32_x3", "3xtf32"),
            ("bf16_bf16_f32_x6", "6xbf16"),
            ("bf16_bf16_f32_x3", "3xbf16"),
            ("tf32_tf32_f32", "tf32"),
            ("bf16_bf16_f32", "bf16"),
            ("f32_f32_f32", "highest"),
        ):
            if key in name:
                return label
        return name
    prec = re.search(r"operand_precision[\"=:\s]*[\[{]([^\]}]*)[\]}]", low)
    settings = re.findall(r"highest|high|default", prec.group(1)) if prec else []
    return "highest" if "highest" in settings else "high" if "high" in settings else "default"


def _parse_hlo(text: str) -> tuple[dict[str, list[tuple[str, str, str]]], dict[str, str]]:
    """Computations of an HLO module, each a list of ``(instruction, opcode, rest of line)``,
    and the computation each instruction belongs to."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    owner: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if not line.startswith((" ", "\t")) and not line.startswith("HloModule"):
            head = _COMPUTATION.match(line)
            current = head.group(1) if head else None
            if current is not None:
                comps[current] = []
            continue
        instr = _INSTRUCTION.match(line) if current is not None else None
        if instr:
            comps[current].append(instr.group(1, 3, 4))  # type: ignore[index]
            owner[instr.group(1)] = current  # type: ignore[assignment]
    return comps, owner


def _called(rest: str) -> list[str]:
    names = [m.group(2) for m in _CALLED.finditer(rest)]
    for group in _CALLED_LIST.findall(rest):
        names += [s.strip().lstrip("%") for s in group.split(",") if s.strip()]
    return names


def _reachable(
    comps: dict[str, list[tuple[str, str, str]]], todo: list[str], into_branches: bool = True
) -> set[str]:
    """The computations ``todo`` and all they call (a conditional's branches only when
    ``into_branches``)."""
    seen: set[str] = set()
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in comps:
            continue
        seen.add(comp)
        todo += [
            c
            for _, opcode, rest in comps[comp]
            if into_branches or opcode != "conditional"
            for c in _called(rest)
        ]
    return seen


def _loop_computations(comps: dict[str, list[tuple[str, str, str]]]) -> set[str]:
    """Computations run inside a while op: bodies and conditions, and all they call."""
    todo = [
        m.group(2)
        for body in comps.values()
        for _, opcode, rest in body
        if opcode == "while"
        for m in _CALLED.finditer(rest)
        if m.group(1) in ("body", "condition")
    ]
    return _reachable(comps, todo)


_VARIADIC_REDUCE = re.compile(r"=\s*\([^()=]*\)\s*reduce\(")  # a reduce with a tuple result


def every_step_variadic_reductions(text: str) -> int:
    """The variadic (tuple-result) reductions of a compiled program that run on every call: those
    reached from the entry computation without entering a conditional's branches (a fallback
    taken only when a sum over- or underflowed is left out). XLA:CPU compiles a variadic
    reduction as a scalar loop, not vectorized."""
    comps, owner = _parse_hlo(text)
    entry = [
        m.group(1)
        for m in map(_COMPUTATION.match, text.splitlines())
        if m and m.group(0).startswith("ENTRY")
    ]
    reached = _reachable(comps, entry, False)
    found = 0
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        found += bool(m and _VARIADIC_REDUCE.search(line) and owner.get(m.group(1)) in reached)
    return found


def _contents(comp: str, comps: dict[str, list[tuple[str, str, str]]], memo: dict[str, str]) -> str:
    """What a fused (or called) computation does, in the words of :func:`categorize`'s hints."""
    if comp in memo:
        return memo[comp]
    memo[comp] = "elementwise"  # guards a cycle
    kinds = []
    for _, opcode, rest in comps.get(comp, []):
        kinds.append(_hint_of(opcode, rest, comps, memo))
    for kind in ("convolution", "dot", "reduce"):
        hit = next((k for k in kinds if k.startswith(kind)), None)
        if hit:
            memo[comp] = hit
            return hit
    memo[comp] = (
        "copy" if kinds and all(k in _COPY_LIKE or k == "copy" for k in kinds) else "elementwise"
    )
    return memo[comp]


def _hint_of(
    opcode: str, rest: str, comps: dict[str, list[tuple[str, str, str]]], memo: dict[str, str]
) -> str:
    if opcode in ("dot", "convolution"):
        return f"{opcode} {_precision(rest)}"
    if opcode == "custom-call":
        target = rest.lower()
        if re.search(r"custom_call_target=\"[^\"]*(gemm|matmul)", target):
            return f"dot {_precision(rest)}"
        if re.search(r"custom_call_target=\"[^\"]*conv", target):
            return f"convolution {_precision(rest)}"
        return "custom-call"
    if opcode in ("fusion", "call", "async-start"):
        inner = [_contents(c, comps, memo) for c in _called(rest)]
        return inner[0] if inner else "elementwise"
    if opcode in ("reduce", "reduce-window"):
        return "reduce"
    if opcode in ("copy", "transpose", "copy-start", "copy-done"):
        return "copy"
    return opcode


def hlo_hints(text: str) -> dict[str, str]:
    """For each instruction of a compiled HLO module (``compiled.as_text()``), what it holds:
    ``"dot <precision>"``, ``"convolution <precision>"``, ``"reduce"``, ``"copy"``,
    ``"elementwise"``, ``"while"``, ``"conditional"`` or its opcode, with ``" in_while"`` added
    when it runs inside a while body or condition (see :func:`categorize`)."""
    comps, owner = _parse_hlo(text)
    loops = _loop_computations(comps)
    memo: dict[str, str] = {}
    hints = {}
    for body in comps.values():
        for name, opcode, rest in body:
            hint = _hint_of(opcode, rest, comps, memo)
            hints[name] = f"{hint} in_while" if owner[name] in loops else hint
    return hints


# ops that are bookkeeping, not work: XLA:CPU emits no kernel for them
_NO_KERNEL = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element"}


def _kernels(
    text: str,
) -> tuple[dict[str, list[tuple[str, str, str]]], list[tuple[str, str, str]]]:
    """The computations of :func:`_parse_hlo` and its kernels, each ``(name, opcode, rest of
    line)``."""
    comps, _ = _parse_hlo(text)
    inner = {
        m.group(2)
        for body in comps.values()
        for _, _, rest in body
        for m in re.finditer(r"\b(calls|to_apply)=%?([\w.\-]+)", rest)
    }
    kernels = [
        instruction
        for comp, body in comps.items()
        if comp not in inner
        for instruction in body
        if instruction[1] not in _NO_KERNEL
    ]
    return comps, kernels


def kernel_count(text: str) -> int:
    """The kernels of a compiled program: its instructions outside fused and reducer
    computations (each fusion, dot, copy, reduce, loop and conditional; loop bodies and branches
    included), less bookkeeping (parameters, constants, bitcasts, tuples)."""
    return len(_kernels(text)[1])


_ANNOTATION = re.compile(
    r",?\s*(?:metadata|backend_config|frontend_attributes)=(?:\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}|\"[^\"]*\")"
)
_NAME = re.compile(r"%[\w.\-]+")


def distinct_kernel_count(text: str) -> int:
    """The distinct kernels of a compiled program: :func:`kernel_count`'s kernels, those that do
    the same work on the same shapes counted once.

    XLA compiles one kernel for each distinct fused computation and reuses it for the equal
    ones (two layers of one shape, adamw's update of equal-shaped leaves), so on the CPU the
    compile time follows this count: each distinct kernel costs its own code generation, about
    10 ms on XLA:CPU however small it is. A kernel is identified by its result shape, opcode
    and operands' attributes and by the instructions of the computations it calls, all without
    instruction names and source annotations (the names differ for every copy)."""
    comps, kernels = _kernels(text)
    typed = {m.group(1): m.group(2) for m in map(_INSTRUCTION.match, text.splitlines()) if m}
    memo: dict[str, str] = {}

    def canonical(rest: str, ids: dict[str, str]) -> str:
        def named(m: re.Match) -> str:
            name = m.group(0)[1:]
            return computation(name) if name in comps else ids.get(name, "%")

        return _NAME.sub(named, _ANNOTATION.sub("", rest))

    def computation(comp: str) -> str:
        if comp not in memo:
            memo[comp] = ""  # guards a cycle
            body = comps.get(comp, [])
            ids = {name: f"v{i}" for i, (name, _, _) in enumerate(body)}
            memo[comp] = (
                "{"
                + ";".join(f"{typed[name]} {op}({canonical(rest, ids)}" for name, op, rest in body)
                + "}"
            )
        return memo[comp]

    return len({f"{typed[name]} {op}({canonical(rest, {})}" for name, op, rest in kernels})


# ----------------------------------------------------------------------------- the sources

PHASES = ("model", "norms", "clipped sum", "noise", "optimizer", "unattributed")
"""The parts of a DP step an instruction is attributed to (:func:`phase_of`): ``model``, the
model's forward and backward pass (the user's code, a library's layers, and the ghost path's
replay of the model's operations) and the step's own code; ``norms``, the per-example norms
and clip factors (ghost's Gram norms, formed rows and their norms, the clip weights); ``clipped
sum``, the weighted sum of the per-example gradients (book-kept or of formed rows); ``noise``,
the Gaussian noise and all random number generation (a non-private step's own key split too); ``optimizer``, optax's update; ``unattributed``, an instruction that records
no source (a parameter, a copy the compiler added)."""

_NOISE_FILES = re.compile(r"gradclip_jax/dp/(noise|philox)\.py$")
_SUM_FILES = re.compile(r"gradclip_jax/per_example/(ghost/_sums|_clip_sum)\.py$")
# helpers that serve both the norms and the sums: their caller decides
_SHARED_FILES = re.compile(r"gradclip_jax/(per_example/_products|_core/numerics)\.py$")
_REPLAY = re.compile(r"gradclip_jax/_core/jaxcompat\.py$")
_OPTAX = re.compile(r"/optax/(?!losses/)")


def _frame_tag(path: str, function: str) -> str | None:
    """One source frame's part of the step (``None``: a helper whose caller decides)."""
    if _NOISE_FILES.search(path):
        return "noise"
    if _SUM_FILES.search(path):
        return "clipped sum"
    if _SHARED_FILES.search(path):
        return None
    if _REPLAY.search(path):
        return "model" if function == "bind" else None
    if "gradclip_jax/" in path:
        return "norms"
    if _OPTAX.search(path):
        return "optimizer"
    return "model"


def phase_of(chain: list[tuple[str, str]]) -> str:
    """The part of the step (:data:`PHASES`) of an instruction whose source frames are ``chain``
    (``(file, function)``, innermost first): the noise or the clipped sum wherever in the chain
    they are (their code calls the norms' helpers and replays the model's operations), else what
    the innermost deciding frame says."""
    tags = [_frame_tag(path, fn) for path, fn in chain]
    for phase in ("noise", "clipped sum"):
        if phase in tags:
            return phase
    return next((t for t in tags if t is not None), "unattributed")


def _table(text: str, name: str) -> list[str]:
    """The lines of one of the module's source tables (``FileNames``, ...), empty when absent."""
    found = re.search(rf"^{name}\n((?:\d+ .*\n?)*)", text, re.M)
    return found.group(1).splitlines() if found else []


def _frames(text: str) -> dict[int, tuple[str, str, int]]:
    """``{frame id: (file, function, parent frame id or 0)}`` from the module's tables."""
    files = {
        int(i): s.strip('"') for i, s in (ln.split(" ", 1) for ln in _table(text, "FileNames"))
    }
    funcs = {
        int(i): s.strip('"') for i, s in (ln.split(" ", 1) for ln in _table(text, "FunctionNames"))
    }
    locs = {}
    for ln in _table(text, "FileLocations"):
        f = dict(re.findall(r"(\w+)=(\d+)", ln))
        locs[int(ln.split(" ", 1)[0])] = (
            files.get(int(f["file_name_id"]), "?"),
            funcs.get(int(f["function_name_id"]), "?"),
        )
    raw = {}
    for ln in _table(text, "StackFrames"):
        f = dict(re.findall(r"(\w+)=(\d+)", ln))
        raw[int(ln.split(" ", 1)[0])] = (int(f["file_location_id"]), int(f["parent_frame_id"]))
    # XLA prints a frame's parent as its id plus one (0 + 1 for none); a frame naming itself
    # as parent says so. A printer that writes the id itself names no frame as its own parent.
    shift = 1 if any(p == i for i, (_, p) in raw.items()) else 0
    return {i: (*locs.get(loc, ("?", "?")), p - shift) for i, (loc, p) in raw.items()}


def _chain(frame: int, frames: dict[int, tuple[str, str, int]]) -> list[tuple[str, str]]:
    out, seen = [], set()
    while frame in frames and frame not in seen:
        seen.add(frame)
        path, fn, frame = frames[frame]
        out.append((path, fn))
    return out


_FRAME_ID = re.compile(r"\bstack_frame_id=(\d+)")
# JAX's random number generation runs in jitted functions it caches with the source frames of
# their first trace (the key split of another step, say): their ops are told by their names.
_RNG_OP = re.compile(
    r'op_name="[^"]*jit\((?:_threefry_split|_threefry_fold_in|_threefry_random_bits|_random_bits|'
    r"_uniform|_normal|_normal_real|_split|_fold_in)\)"
)
# ops whose cost a fused kernel's other ops ride along with: the kernel is theirs
_HEAVY = ("dot", "convolution", "custom-call")


def _fused_phase(
    comp: str,
    comps: dict[str, list[tuple[str, str, str]]],
    own: dict[str, str],
    memo: dict[str, str | None],
) -> str | None:
    """The part of the step a fused (or called) computation does: that of its products, if it
    holds any; else the noise's, if it draws any (a draw costs far more than the arithmetic around
    it); else the part most of its attributed ops belong to; ``None`` if none is."""
    if comp in memo:
        return memo[comp]
    memo[comp] = None  # guards a cycle
    heavy, seen = [], []
    for name, opcode, rest in comps.get(comp, []):
        inner = (
            [_fused_phase(c, comps, own, memo) for c in _called(rest)]
            if opcode in ("fusion", "call")
            else []
        )
        phase = next((q for q in inner if q is not None), own.get(name))
        if phase is None:
            continue
        seen.append(phase)
        if opcode in _HEAVY:
            heavy.append(phase)
    counts = {q: seen.count(q) for q in seen}
    found = (
        heavy[0]
        if heavy
        else "noise"
        if "noise" in counts
        else max(counts, key=counts.__getitem__, default=None)
    )
    memo[comp] = found
    return found


def hlo_phases(text: str) -> dict[str, str]:
    """For each instruction of a compiled HLO module, the part of the DP step that wrote it
    (:data:`PHASES`): from the source frames it records (:func:`phase_of`), the ops of JAX's
    random number generation (by their names) the noise's; a fusion (or call)
    by what its fused ops do (its products', else its noise draw's, else most of its ops'), and
    so are its fused ops that record none. An instruction with no attributed source is left out
    (a caller reads it as ``unattributed``)."""
    frames = _frames(text)
    comps, _ = _parse_hlo(text)
    by_frame: dict[int, str] = {}
    own: dict[str, str] = {}
    for body in comps.values():
        for name, _, rest in body:
            m = _FRAME_ID.search(rest)
            if _RNG_OP.search(rest):
                own[name] = "noise"
            elif m:
                fid = int(m.group(1))
                if fid not in by_frame:
                    by_frame[fid] = phase_of(_chain(fid, frames))
                own[name] = by_frame[fid]
    memo: dict[str, str | None] = {}
    out = dict(own)
    for body in comps.values():
        for name, opcode, rest in body:
            if opcode in ("fusion", "call"):
                inner = next(
                    (
                        q
                        for c in _called(rest)
                        if (q := _fused_phase(c, comps, own, memo)) is not None
                    ),
                    None,
                )
                if inner is not None:
                    out[name] = inner
                    for c in _called(
                        rest
                    ):  # the fused ops that record no source (parameters) are the kernel's
                        out.update((n, inner) for n, _, _ in comps.get(c, []) if n not in own)
    return out
