"""Symbolic counts after a graph break: one compiled path for every token count (automatic
dynamic for trace trees).

A data-dependent op (`torch.where(mask)`, `nonzero`, `x[mask]`) runs eagerly between two
segments of a trace tree (`fulmen.tree`), followed by a guard on its output shapes. Traced with
the real shapes, every new count is a new answer of that guard: a new branch, a full retrace,
until the guard closes. A mixture-of-experts layer routes tokens so, and its counts change at
every step.

NOTE [symbolic counts at a break site]: once a guard on output shapes gives a second distinct
answer, its *site* (the user's line and the op) is dynamic for the tree (`CountSites`): the
dimensions whose sizes differed between the answers. A later trace of the tree gives each such
dimension at that site a symbol of a ShapeEnv of its own (one per retrace, made by
`symbolic_counts` before the trace; `count_shape`), with the real size as its hint, so the segments after the break compute with it as with any
symbolic size (the printed segment binds it from the op's output, its input). Sizes 0 and 1
stay numbers (PyTorch specialises them), and so does an output whose strides would involve the
size. The tree files that path's child under a *generic* key (`generic_key`: the varying sizes
replaced by a marker) and checks, at each node, the ShapeEnv's guards whose symbols are all
bound by then (`path_checks`), with each symbol renamed after where it is bound (`c{depth}_{out}
_{dim}`), so paths traced in other ShapeEnvs agree. A call whose sizes fail a check takes the
exact answer's child, or retraces (see below for when that answer is refused,
`CountSites.refused`: the site stays static there), so a wrong size never reaches a compiled
path.

In a tree whose input sizes are symbolic (a length that varies), the count symbols are made in
the trace's own ShapeEnv, beside the inputs' (two ShapeEnvs would give symbols of one name):
the entry's shape guard leaves out every guard on a count symbol (`COUNT_SYMBOLS` in
`fulmen.tracer.symbolic`), and `path_checks` checks those at the node, reading the input sizes
they involve from the call's inputs (`TraceTree.reads`). A site is one line *and* op (two breaks
of one line vary apart). A count stored into an object (`stats.seen += idx.shape[0]`) is
computed by the epilogue from the leaf's op outputs (`TraceTree._bind_epilogue`). One generic
key holds up to `MAX_VARIANTS` generic children (`tree.Variant`: the key and the texts of the
path's checks there), each taken where its own checks hold: a program deciding on `n % 2`
gets one per class; sizes no child takes retrace symbolically, past the cap they are refused.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fulmen.ops.breaks import answer_key
from fulmen.tracer.bool_args import symbolic_bools_decided
from fulmen.tracer.environment import environment_unrecorded
from fulmen.tracer.int_answers import symbolic_ints_are_ints
from fulmen.tracer.symbolic import COUNT_SYMBOLS, SymbolicSizes, _row_major, is_symbolic

_RECOMPILES = logging.getLogger("fulmen.recompiles")  # the topic of `fulmen.logs`
GENERIC = "n"  # the size in a generic answer key that a symbol stood for


def site_of(source, fn, op: str = "", outputs: int = 0) -> tuple | None:
    """The site of a break: its user line, question, data-dependent op and number of
    outputs (None without a source line): two ops of one line (HF Mixtral's
    `torch.where(expert_mask[expert_idx])` indexes by a tensor, then counts) vary apart."""
    if source is None:
        return None
    return (source.filename, source.lineno, getattr(fn, "__qualname__", repr(fn)), op, outputs)


@dataclass
class CountSites:
    """The break sites of one trace tree whose output sizes vary: site -> the `(output, dim)`
    pairs that differed; `refused` holds `(site, answer key)` pairs a generic path's checks
    refused, traced with exact sizes."""

    dims: dict = field(default_factory=dict)
    refused: set = field(default_factory=set)
    off: bool = False  # a trace with symbolic counts failed: the tree's counts stay exact

    def note_miss(self, site, answers: list, answer, refused: bool) -> None:
        """A guard on output shapes at `site`, having answered `answers`, answered `answer`
        with no path for it (`refused`: a generic path's checks failed)."""
        if site is None or self.off:
            return
        if refused:
            self.refused.add((site, answer_key(answer)))
            return
        varying = set(self.dims.get(site, ()))
        for old in answers:
            if len(old) != len(answer):
                continue
            for index, (a, b) in enumerate(zip(old, answer)):
                if len(a) == len(b):
                    varying |= {(index, d) for d, (x, y) in enumerate(zip(a, b)) if x != y}
        if varying:
            self.dims[site] = frozenset(varying)


# the `CountSites` of the tree a trace now in progress grafts onto, and its symbols' ShapeEnv
_ACTIVE: list = [(None, None)]


@contextlib.contextmanager
def symbolic_counts(sites: CountSites | None) -> Iterator[None]:
    """Around a retrace of a trace tree: data-dependent ops at `sites` get symbolic counts,
    and user code asking `isinstance(n, int)` or passing a size comparison as a bool gets the
    answers it gets for symbolic input sizes (`fulmen.tracer.int_answers`, `bool_args`)."""
    if sites is None or not sites.dims:
        yield
        return
    # (made before the trace: making a ShapeEnv reads torch's settings from the environment,
    # which a trace would record as the program's)
    _ACTIVE.append((sites, SymbolicSizes()))
    try:
        with symbolic_ints_are_ints(), symbolic_bools_decided():
            yield
    finally:
        _ACTIVE.pop()


def trace_with_counts(trace: Callable[[], Any], sites: CountSites | None,
                      reset: Callable[[], None]) -> Any:
    """`trace()` with symbolic counts at `sites` (`symbolic_counts`); where that trace fails
    (an op PyTorch describes only from values given a count as a number: `bincount(i,
    minlength=n)`), `reset()` and `trace()` again with exact counts, for good in this tree."""
    if sites is None or not sites.dims:
        return trace()
    try:
        with symbolic_counts(sites):
            return trace()
    except Exception as error:  # noqa: BLE001 - traced again with exact counts
        _RECOMPILES.info("symbolic counts after graph breaks failed (%s: %s); tracing them "
                         "exactly", type(error).__name__, error)
        sites.dims.clear()
        sites.off = True
        reset()
        return trace()


def _strides_keep(tensor: torch.Tensor, dims: list[int]) -> bool:
    """Whether `tensor`'s strides stay numbers when `dims` vary: no other dim of more than one
    element steps over them (`where`'s `(n,)` columns of a `(n, 2)` nonzero)."""
    strides = tensor.stride()
    for dim in dims:
        if any(tensor.shape[d] > 1 and strides[d] > strides[dim]
               for d in range(tensor.dim()) if d != dim):
            return False
    return True


def count_shape(fn, source, index: int, tensor: torch.Tensor, depth: int,
                answer, inputs_env: Callable[[], Any] = lambda: None,
                op: str = "") -> tuple[tuple, tuple]:
    """`(shape, strides)` for the proxy of output `index` of a data-dependent op, the real
    `tensor`, at break `depth` of the trace: symbolic in the dims its site varies in (NOTE
    [symbolic counts at a break site]), else the real ones. `inputs_env()` is the ShapeEnv
    of the trace's symbolic input sizes (None without): the count symbols are made in it;
    `op` names the data-dependent op (`site_of`)."""
    plain = tuple(tensor.shape), tuple(tensor.stride())

    sites, sizes = _ACTIVE[-1]
    site = site_of(source, fn, op, len(answer))
    if sites is None or site not in sites.dims or (site, answer_key(answer)) in sites.refused:
        return plain
    dims = [d for i, d in sites.dims[site] if i == index and d < tensor.dim()
            and tensor.shape[d] >= 2]
    row_major = _row_major(tensor)
    if not dims or not (row_major or _strides_keep(tensor, dims)):
        return plain
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    shape: list = list(tensor.shape)
    env = inputs_env() or sizes.env
    counts = env.__dict__.setdefault(COUNT_SYMBOLS, set())  # (left out of the entry's guard)
    with environment_unrecorded():  # (PyTorch's reads of its settings, not the program's)
        for dim in dims:
            source_name = LocalSource(f"count{depth}_{index}_{dim}")
            expr = env.create_symbol(int(tensor.shape[dim]), source=source_name,
                                     dynamic_dim=DimDynamic.DYNAMIC)
            counts.add(expr)
            shape[dim] = env.create_symintnode(expr, hint=int(tensor.shape[dim]),
                                               source=source_name)
    if not row_major:
        return tuple(shape), tuple(tensor.stride())
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc = acc * size if not isinstance(size, int) or size > 1 else acc
    return tuple(shape), tuple(reversed(strides))


def generic_dims(proxies) -> tuple:
    """The `(output, dim)` pairs of a guard's proxies whose sizes are symbolic."""
    return tuple((i, d) for i, p in enumerate(proxies) for d, size in enumerate(p.shape)
                 if is_symbolic(size))


def generic_key(answer, dims: tuple, depth: int) -> tuple[Any, dict] | None:
    """`(key, bindings)`: the generic answer key of the shapes `answer` for `dims` and the
    values of the canonical symbols (`c{depth}_{out}_{dim}`); None where a size among `dims`
    is 0 or 1 (specialised: only an exact path takes it) or the answer does not fit."""
    shapes = [list(shape) for shape in answer]
    bindings = {}
    for index, dim in dims:
        if index >= len(shapes) or dim >= len(shapes[index]) or shapes[index][dim] < 2:
            return None
        bindings[f"c{depth}_{index}_{dim}"] = shapes[index][dim]
        shapes[index][dim] = GENERIC
    return answer_key(tuple(tuple(s) for s in shapes)), bindings


def _input_names(env, symbols, names) -> dict:
    """Symbol -> `(input name, dim)` for the symbols among `symbols` that are a size of a
    trace input in `names` (an integer's symbol is none: a check on it refuses)."""
    from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource

    found = {}
    for symbol in symbols:
        for source in env.var_to_sources.get(symbol, ()):
            if isinstance(source, TensorPropertySource) and source.prop is TensorProperty.SIZE \
                    and isinstance(source.base, LocalSource) and source.base.local_name in names:
                found[symbol] = (source.base.local_name, source.idx)
                break
    return found


def input_value_name(name: str, dim: int) -> str:
    """The name a count check reads the size `dim` of trace input `name` as."""
    return f"i_{name}_{dim}"


def path_checks(symbols: list[tuple], names: tuple = ()) -> tuple[dict[int, list[Callable]], set]:
    """`(checks, reads)`: the checks of one grafted path, break depth -> functions of the
    canonical symbols' values (`generic_key`'s bindings, and the sizes of the trace inputs
    `reads` names as `(name, dim)`, bound as `input_value_name`) that hold where the path's
    ShapeEnv's guards on its counts do. `symbols` holds `(SymInt, depth, output, dim)` for
    each count symbol of the path; a guard is checked at the deepest break binding one of its
    symbols. A guard on a symbol neither a break nor an input in `names` binds (none should
    exist) makes the first generic node refuse every call."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
    from torch.utils._sympy.printers import PythonPrinter

    if not symbols:
        return {}, set()
    import sympy

    env = symbols[0][0].node.shape_env
    renamed, depth_of = {}, {}
    for number, depth, index, dim in symbols:
        # the symbol the size was made as (`_expr`), not what the ShapeEnv replaced it by: two
        # outputs of one count (`where`'s indices) are made equal by a guard, renamed both
        symbol = number.node._expr
        renamed[symbol] = sympy.Symbol(f"c{depth}_{index}_{dim}", integer=True, positive=True)
        depth_of[symbol] = depth
    checks: dict[int, list[Callable]] = {}
    exprs = [guard.expr for guard in env.guards]
    exprs += [sympy.Eq(symbol, value) for symbol, value in env.replacements.items()
              if symbol in renamed]
    printer = PythonPrinter()
    # a size the trace specialised (another output's, not renamed) is its number
    constants = {symbol: value for symbol, value in env.replacements.items()
                 if symbol not in renamed and value.is_number}
    reads: set = set()
    for expr in exprs:
        expr = expr.xreplace(constants)
        free = expr.free_symbols
        if not free & renamed.keys():
            continue  # (the entry's shape guard checks it: `SymbolicSizes.guard`)
        inputs = _input_names(env, free - renamed.keys(), names)
        if not free <= renamed.keys() | inputs.keys():
            depth = min(depth_of.values())
            checks.setdefault(depth, []).append(_check(lambda values: False, "False"))
            continue
        reads |= set(inputs.values())
        depth = max(depth_of[s] for s in free if s in depth_of)
        named = {**renamed, **{symbol: sympy.Symbol(input_value_name(*inputs[symbol]),
                                                     integer=True) for symbol in inputs}}
        text = printer.doprint(expr.xreplace(named))
        code = compile(text, "<fulmen count checks>", "eval")
        checks.setdefault(depth, []).append(_check(
            lambda values, code=code: bool(eval(code, SYMPY_INTERP, dict(values))), text))
    return checks, reads


def _check(function: Callable, text: str) -> Callable:
    """`function`, a count check, with its expression as `text` (a generic child's checks
    tell it from another's of the same key: `TraceTree._key`)."""
    function.text = text
    return function


__all__ = ["CountSites", "count_shape", "trace_with_counts", "generic_dims", "generic_key",
           "input_value_name", "path_checks",
           "site_of", "symbolic_counts"]
