"""Symbolic sizes: one trace for every size a dimension takes (dynamic shapes).

A dimension marked dynamic (`fulmen.mark_dynamic`, `jit(dynamic=True)`, or one that changed
between two calls under the default `dynamic=None`) gets a *symbolic size* from PyTorch's own
engine, `torch.fx.experimental.symbolic_shapes`: a `ShapeEnv` creates a symbol (`s0`) with the
call's value as its hint, and the input proxy is made with a `torch.SymInt` in that dimension.
Decompositions and meta kernels then compute with SymInts (`view(-1)` gives `4*s0`), and each
time Python needs a decision about a size (`if x.size(0) > 1`, `int(n)`) the ShapeEnv answers
from the hint and records a guard. Printed traces bind the symbols from the inputs' shapes at
the top of the function (`s0 = x.shape[0]`) and compute sizes from them.

PyTorch's conventions hold: sizes 0 and 1 are specialised (as in torch.compile), except a size
1 the policy asks to generalise (a batch of 1 beside a length that varies, see
`fulmen.tracer.shape_policy`): its symbol's range starts at 1 and every decision about it is
a guard evaluated at 1, so the entry serves larger sizes only where no branch depended on it
being 1. An integer read from an argument (a plain `int`, or one held by an object argument:
an HF cache layer's `cumulative_length`) that changed between calls gets a symbol too
(`symbolize_int`, torch.compile's automatic dynamic for integers): Python's decisions about it
are guards, and the trace reads its value from a *carrier*, an empty tensor of shape `(0, n)`
made for each call (`carrier`), so printed traces bind it like any size (`s3 =
n_carrier.shape[1]`). Only values from 2 to 2**62 get one (0 and 1 are specialised, as sizes
are; negative numbers and larger ones stay constants). Each dynamic dimension gets a symbol of
its own (`DimDynamic.DYNAMIC`: no duck sizing, even for equal sizes); an equality the program
relies on (`x + y` of two inputs) becomes a guard. A compiled entry is valid for a call when the ShapeEnv's guards hold
on the call's sizes (`SymbolicSizes.guard`); otherwise the call is traced again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from fulmen.core import FulmenError
from fulmen.core.printer import bindable_symbols, symbol_bindings
from fulmen.proxies import TensorProxy
from fulmen.tracer.formatting import SHAPE_ENV_MARK
from fulmen.tracer.objects import follow, function_roots
from fulmen.tracer.sym_ops import keep_symbolic_ops


def is_symbolic(value) -> bool:
    """Whether `value` is a size that is still symbolic (a `torch.SymInt` whose expression has
    a symbol; one the trace specialised to a number is not)."""
    return isinstance(value, torch.SymInt) and bool(value.node.expr.free_symbols)


_MAX_CARRIED = 2**62  # the largest integer traced as a symbol (a size of an empty tensor)
INT = "int"  # the `dims` of an integer given a symbol (`symbolize_int`), where a tensor has dims
# the `dims` of a float read at run time (NOTE [floats read at run time] in `ops/host_float.py`)
FLOAT = "float"
# ends the `dims` of a tensor whose strides are free of its sizes (NOTE [strides of a view input])
STRIDES = "strides"


def _row_major(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s strides are exactly the row-major ones of its sizes (size-1 dims
    included, which `is_contiguous()` ignores)."""
    expected = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride())):
        if stride != expected:
            return False
        expected *= max(size, 1)
    return True


_CPU = torch.device("cpu")


def carrier(value: int | float) -> torch.Tensor:
    """The empty tensor whose size 1 carries the integer `value` into a compiled call; for a
    float, the float64 0-dim tensor holding it (exactly: a Python float is a float64). On the
    CPU, as the trace declares it, whatever default device the caller set."""
    if type(value) is float:
        return torch.tensor(value, dtype=torch.float64, device=_CPU)
    return torch.empty((0, value), dtype=torch.uint8, device=_CPU)


def number_at(leaves: list, fn_roots: list, position):
    """The number at `position` of a call: as `tensor_at`, where a negative root is the
    jitted function's own object (`fn_roots[-1 - root]`: a bound method's `self`)."""
    if isinstance(position, tuple) and position[0] < 0:
        return follow(fn_roots[-1 - position[0]], position[1])
    return tensor_at(leaves, position)


def number_function(numbers: list, proxies: list) -> Callable:
    """A function of a call's inputs (`proxies` are the trace inputs they come in as, a prefix
    of the compiled call's arguments) returning the values of the traced Python numbers
    `numbers` (`torch.SymInt`, `SymFloat`, `SymBool`) in that call.

    NOTE [traced numbers in stores]: a store of a symbolic size or integer into an object
    that outlives the call (`self.cumulative_length += key.shape[-2]`, `counter.seen +=
    x.shape[0]`) holds a SymInt whose expression is in the trace's symbols (`s3 + s7`).
    Replayed by value, the object would keep the symbol; instead the epilogue
    (`fulmen.tracer.objects.Epilogue`) evaluates the expression with each call's own sizes,
    read from its inputs as the printed trace reads them (`s3 = n_carrier.shape[1]`), before
    any store changes what the inputs were read from.

    Raises:
        FulmenError: when no input's sizes determine a symbol (`symbol_bindings`).

    Example:
        >>> number_function([2 * s0], [x])(torch.empty(5, 3))  # x: f32[s0, 3]
        (10,)
    """
    from torch.utils._sympy.printers import PythonPrinter

    exprs = [number.node.expr for number in numbers]
    symbols = set().union(*(expr.free_symbols for expr in exprs))
    counts = set().union(*(getattr(n.node.shape_env, COUNT_SYMBOLS, ()) for n in numbers))
    unbound = symbols - bindable_symbols(proxies, symbols)
    if unbound and unbound <= counts:  # (else `symbol_bindings` raises)
        return _counts_unbound(numbers)
    lines = symbol_bindings(proxies, symbols, "the epilogue's numbers")
    printer = PythonPrinter()
    values = [f"{number.node.pytype.__name__}({printer.doprint(expr)})"
              for number, expr in zip(numbers, exprs)]
    source = "\n".join([f"def numbers({''.join(p.name + ', ' for p in proxies)}*_):",
                        *(f"    {line}" for line in lines),
                        f"    return ({', '.join(values)},)"])
    scope: dict = {"math": math, "torch": torch}  # (a SymFloat prints `torch.sym_float(s0)`)
    exec(compile(source, "<fulmen epilogue numbers>", "exec"), scope)
    function = scope["numbers"]
    function.source = source
    return function


def _counts_unbound(numbers: list) -> Callable:
    """The `number_function` of numbers holding a count after a graph break (NOTE [symbolic
    counts at a break site]): the call's inputs do not hold it; the trace tree's leaf replaces
    it by one reading the op's output (`TraceTree.bind_epilogue`). Raises if called."""

    def numbers_after_breaks(*_):
        raise FulmenError("the epilogue's numbers hold a count after a graph break, read only "
                          "at the trace tree's leaf", op="print the epilogue's numbers")

    numbers_after_breaks.counts = numbers
    return numbers_after_breaks


def has_symbolic_shape(tensor: torch.Tensor) -> bool:
    """Whether any size of `tensor` is symbolic."""
    return any(isinstance(size, torch.SymInt) for size in tensor.shape)


def tensor_at(leaves: list, position):
    """The tensor (or integer) at `position` of a call's flattened arguments: an index, or
    `(index, path)` for a value inside an object argument (`fulmen.tracer.objects`)."""
    if isinstance(position, int):
        return leaves[position]
    root, path = position
    return follow(leaves[root], path)


_SHAPE_ENV_CLASS: list[type] = []


def _shape_env_class() -> type:
    """PyTorch's `ShapeEnv` without its source locations. NOTE [guards without stack
    summaries]: the ShapeEnv records, for each symbol and guard, the first stack frame outside
    a set of PyTorch files (`symbolic_shapes.uninteresting_files`); building that set imports
    `torch.export`, `torch._inductor` and `torch._functorch.aot_autograd` (0.1-0.3 s, once per
    process, inside the first symbolic compilation), and each lookup walks the stack. fulmen
    never reads these locations (its guards print from their expressions and traces carry the
    user's source lines), so they are left empty; the guards themselves are PyTorch's."""
    if not _SHAPE_ENV_CLASS:
        from torch._guards import SLoc
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        class FulmenShapeEnv(ShapeEnv):
            def _get_stack_summary(self, is_debug: bool = False,
                                   framework_loc: str | None = None) -> tuple[SLoc, str]:
                return SLoc(framework_loc, None), ""

        _SHAPE_ENV_CLASS.append(FulmenShapeEnv)
    return _SHAPE_ENV_CLASS[0]


# the attribute of a ShapeEnv holding the symbols of counts after graph breaks made in it
# (`fulmen.tracer.break_sizes.count_shape`): guards on them are checked by the trace tree at
# the break binding them, not by the entry's shape guard (`SymbolicSizes.guard`)
COUNT_SYMBOLS = "_fulmen_count_symbols"


class SymbolicSizes:
    """The symbolic sizes of one trace: a `ShapeEnv`, and which input dimension each symbol
    was made for.

    Example:
        >>> sizes = SymbolicSizes()
        >>> shape, strides = sizes.symbolize(torch.empty(8, 4), "x", dims=(0,))
        >>> shape
        (s0, 4)
    """

    def __init__(self) -> None:
        # ops whose output shape or a Python value depends on data (`nonzero`, `x[mask]`,
        # `.item()`) must fail in the meta kernel, as without symbolic sizes, so they become
        # graph breaks (`fulmen.tracer.breaks`), not unbacked symbols
        self.env = _shape_env_class()(specialize_zero_one=True, duck_shape=True,
                                      allow_scalar_outputs=False,
                                      allow_dynamic_output_shape_ops=False)
        setattr(self.env, SHAPE_ENV_MARK, True)  # user code formatting its sizes gets numbers
        keep_symbolic_ops(self.env)  # NOTE [symbolic arithmetic kept by the ShapeEnv]
        self.proxies: list[TensorProxy] = []  # inputs with a symbolic size, in order
        self.free_strides: set[str] = set()  # inputs with a stride symbol of its own, by name
        self.positions: list[int] = []  # the flattened-argument position of each
        # the jitted function, whose own objects (`objects.function_roots`) hold the numbers
        # at negative roots (`number_at`: a custom optimizer's `self.state[p]["step"]`)
        self.fn: Callable | None = None

    def symbolize(self, tensor: torch.Tensor, label: str, dims: Sequence[int]):
        """`(shape, strides)` for the input proxy of `tensor` (a trace input called `label`),
        with symbolic sizes in `dims` (a size 0 stays an int, and so does a 1 unless `dims` names
        it). A contiguous tensor's strides are computed from them; a view's are not a function
        of its own sizes (NOTE [strides of a view input]), so they are `view_strides`'."""
        from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource
        from torch.fx.experimental.symbolic_shapes import DimDynamic

        shape = list(tensor.shape)
        free = STRIDES in dims
        dims = [d for d in dims if d != STRIDES]
        if not dims and not free:
            return tuple(shape), tuple(tensor.stride())
        bounds = getattr(tensor, "_fulmen_dynamic_dims", {})  # fulmen.mark_dynamic(min=, max=)
        for dim in dims:
            hint = int(tensor.shape[dim])
            low, high = bounds.get(dim, (None, None))
            if (low is not None and hint < low) or (high is not None and hint > high):
                continue  # outside the declared range: this size stays a number
            source = TensorPropertySource(LocalSource(label), TensorProperty.SIZE, dim)
            # a size 1 reaches here only when the policy asks for it (`DynamicDims`): its
            # symbol is not specialised, and every decision the trace makes about it is a
            # guard evaluated at 1, so the entry serves other sizes only where those hold
            expr = self.env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC,
                                          do_not_specialize_zero_one=hint == 1)
            if expr.is_Symbol and hint == 1:
                low = 1 if low is None else max(low, 1)  # sympy assumes it positive: never 0
                self.env._fulmen_generalised_ones = True  # meta kernels: `fulmen.ops.meta`
            if expr.is_Symbol and (low is not None or high is not None):
                self._constrain(expr, low, high)
            shape[dim] = self.env.create_symintnode(expr, hint=hint, source=source)
        if free or not tensor.is_contiguous() or not _row_major(tensor):
            # a size-1 dim's stride that is not the row-major one (`(4, 1)` with strides
            # `(1, 4)`, contiguous to `is_contiguous()`) is written as a view's are, so it
            # reads as eager's
            return tuple(shape), self.view_strides(tensor, shape, label, free)
        strides, acc = [], 1
        for size in reversed(shape):
            strides.append(acc)
            acc = acc * size if not isinstance(size, int) or size > 1 else acc
        return tuple(shape), tuple(reversed(strides))

    # NOTE [strides of a view input]: a view's strides come from the tensor it views, not from
    # its own sizes: `keys[..., :n, :]` of a cache of `S` positions (`DynamicCache.crop`,
    # assisted generation) has sizes `(b, h, n, d)` and strides `(h*S*d, S*d, d, 1)`, with
    # `n` and `S` changing every call. As torch.compile does, each stride is written, in
    # increasing order, as a size times a stride already written where their values agree
    # (`d = d*1`, `h*(S*d)`), and one that is not gets a symbol of its own (`S*d`), read from
    # the input's `stride()` in printed traces (`fulmen.core.printer.symbol_bindings`). The
    # shape guard checks every stride against its expression, so a call whose strides are
    # related otherwise (a coincidence of the traced call's values) is traced again.
    # An input seen both as a view and contiguous (assisted generation crops the cache at some
    # steps only) is traced with *free* strides (`STRIDES` in its dims, `shape_policy`): no
    # stride is written as a symbolic size times another, so the stride outside the cache's
    # length is a symbol of its own even when the traced call's cache was contiguous, and one
    # entry serves both layouts (its key leaves contiguity out: `leaf_keys._masked_key`).

    def view_strides(self, tensor: torch.Tensor, shape: list, label: str,
                     free: bool = False) -> tuple:
        """Symbolic strides for the input `tensor`, a view (not contiguous, or `free`: written
        without its symbolic sizes) whose sizes are `shape` (some symbolic): NOTE [strides of
        a view input]."""
        from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource
        from torch.fx.experimental.symbolic_shapes import DimDynamic

        hints, sizes = tensor.stride(), tensor.shape
        strides: list = [stride if stride in (0, 1) else None for stride in hints]
        while None in strides:
            known = {sizes[d] * hints[d]: shape[d] * strides[d]
                     for d in range(len(hints)) if strides[d] is not None
                     and not (free and is_symbolic(shape[d]))}
            for _, d in sorted((hints[d], d) for d in range(len(hints)) if strides[d] is None):
                if hints[d] in known:
                    strides[d] = known[hints[d]]
                    if not (free and is_symbolic(shape[d])):
                        known[sizes[d] * hints[d]] = shape[d] * strides[d]
            if None in strides:
                hint, d = min((hints[d], d) for d in range(len(hints)) if strides[d] is None)
                source = TensorPropertySource(LocalSource(label), TensorProperty.STRIDE, d)
                expr = self.env.create_symbol(hint, source=source,
                                              dynamic_dim=DimDynamic.DYNAMIC)
                strides[d] = self.env.create_symintnode(expr, hint=hint, source=source)
                self.free_strides.add(label)
        return tuple(strides)

    def symbolize_int(self, value: int, label: str) -> tuple[torch.SymInt, TensorProxy] | None:
        """`(n, carrier_proxy)` for an integer argument `value` that varies (its carrier a trace
        input called `label`): `n` a SymInt of the ShapeEnv with `value` as its hint, the proxy
        an input of shape `(0, n)` from which the trace reads it (`carrier`). None for a value
        below 2: it stays a constant (0 and 1 specialised, negative numbers are no size), and
        so does one above 2**62 (the symbol's range ends there: the guard refuses larger)."""
        from torch._dynamo.source import LocalSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic

        if type(value) is not int or not 2 <= value <= _MAX_CARRIED:
            return None
        source = LocalSource(label)
        expr = self.env.create_symbol(value, source=source, dynamic_dim=DimDynamic.DYNAMIC)
        self._constrain(expr, None, _MAX_CARRIED)  # the guard refuses what no carrier holds
        number = self.env.create_symintnode(expr, hint=value, source=source)
        proxy = TensorProxy(label, (0, number), torch.uint8, "cpu",
                            strides=(number, 1))
        return number, proxy

    def _constrain(self, symbol, low: int | None, high: int | None) -> None:
        """Narrow `symbol`'s range to `[low, high]` (within the ShapeEnv's own; sizes 0 and 1
        are specialised anyway); the entry's guard then checks it."""
        from torch.utils._sympy.numbers import int_oo

        known = self.env.var_to_range[symbol]
        lower = known.lower if low is None else max(low, known.lower)
        upper = known.upper if high is None else min(high, known.upper)
        self.env.constrain_symbol_range(symbol, compiler_min=lower,
                                        compiler_max=int_oo if upper == int_oo else upper)

    def add_input(self, proxy: TensorProxy | torch.SymInt, position) -> None:
        """Declare `proxy` (at flattened-argument `position`, see `tensor_at`) an input with
        symbolic sizes, or the SymInt of an integer input (`symbolize_int`)."""
        if isinstance(proxy, torch.SymInt) or has_symbolic_shape(proxy) \
                or proxy.name in self.free_strides:  # (strides alone vary: `shape_policy`)
            self.proxies.append(proxy)
            self.positions.append(position)

    # NOTE [offsets of held tensors]
    # HF's sliding-window cache layer keeps `cat(keys, new)[:, :, 1 - window:]`: after a
    # prefill longer than the window its keys sit at offset `(prompt - window + 1) * row`, at
    # every later step at one row. Guarded as a constant, the offset of a tensor inside an
    # object argument made the first decoding step of each prompt length compile an entry no
    # other call could use (one more compile per prompt length, up to `cache_size_limit`, then
    # eager calls). It is guarded, as an argument's, only where the program reads it; static
    # keys still key held tensors by their offsets.

    def guard(self, offsets_read: frozenset = frozenset()) -> Callable[[list], bool]:
        """A function of the call's flattened arguments: whether this trace's specialisations
        (every guard the ShapeEnv recorded while tracing and compiling, equalities between
        duck-sized dimensions, the symbols' ranges) hold for their sizes.

        An argument's storage offset is checked only where the program read it (its position
        in `offsets_read`, `TracedProgram.offset_reads`; `(root, path)` for a tensor inside an
        object argument): the micro-batch `x[i:j]` of a batch whose size varies has another
        offset at each size, which the compiled program never reads (NOTE [offsets of held
        tensors]). Sizes at which a guard cannot be evaluated (a divisor that is 0 there) fail
        the check."""
        from torch._dynamo.source import LocalSource
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        # ignore_static=False: a symbol the trace specialised (`int(n)`, a meta kernel's
        # check) has become a number, and its input's size must be guarded as one
        names = [f"t{i}" for i in range(len(self.proxies))]
        counts = getattr(self.env, COUNT_SYMBOLS, set())
        kept = self.env.guards  # (NOTE [symbolic counts at a break site]: the tree's guards)
        self.env.guards = [g for g in kept if not g.expr.free_symbols & counts]
        try:
            guards = self.env.produce_guards(self.proxies, [LocalSource(n) for n in names],
                                             ignore_static=False)
        except (AssertionError, RuntimeError):
            if not counts:
                raise
            guards = ["L['count"]  # (a size no input holds)
        finally:
            self.env.guards = kept
        if counts and any("L['count" in guard for guard in guards):
            # an input size the trace replaced by a count's expression: never hit
            return lambda leaves: False
        unread = tuple(f"L['{name}'].storage_offset() == " for name, p in
                       zip(names, self.positions) if p not in offsets_read)
        guards = [g for g in guards if not (g.startswith(unread)
                                            and g.rsplit(" == ", 1)[1].isdigit())]
        if not guards:
            return lambda leaves: True
        code = " and ".join(guards)
        compiled = compile(code, "<fulmen shape guards>", "eval")
        positions, fn = self.positions, self.fn
        own = any(isinstance(p, tuple) and p[0] < 0 for p in positions)

        def check(leaves: list) -> bool:
            roots = function_roots(fn) if own else ()  # (read anew: a closure cell may change)
            scope = {f"t{i}": number_at(leaves, roots, p) for i, p in enumerate(positions)}
            try:
                return bool(eval(compiled, SYMPY_INTERP, {"L": scope}))
            except ZeroDivisionError:  # a divisor the trace had nonzero (`n // ((1 + s) // 4)`)
                return False  # is 0 at these sizes: they are outside what the trace covers

        check.source = code
        return check
