"""What a symbolic compilation does not compute: the storage size of a proxy with symbolic
sizes (NOTE [proxy storage size] in `fulmen/proxies/tensor.py`) and PyTorch's source locations
of guards (NOTE [guards without stack summaries] in `fulmen/tracer/symbolic.py`). Each test
checks the work is absent, never how long anything takes; results stay eager's."""

import importlib
import subprocess
import sys
import textwrap

import torch

from fulmen.proxies import TensorProxy
from fulmen.tracer.symbolic import SymbolicSizes


def _storage_bytes(proxy):
    with torch._C.DisableTorchFunctionSubclass():  # a proxy refuses to answer outside tracing
        return proxy.untyped_storage().nbytes()


def test_a_symbolic_proxy_has_a_plain_storage_size_from_its_hints():
    sizes = SymbolicSizes()
    shape, strides = sizes.symbolize(torch.empty(6, 5, 4), "x", dims=(0, 1))
    assert all(isinstance(size, torch.SymInt) for size in shape[:2])
    proxy = TensorProxy("x", shape, torch.float32, "cpu", strides=strides)
    nbytes = _storage_bytes(proxy)
    assert type(nbytes) is int  # PyTorch's own would be a SymInt expression (sympy per proxy)
    assert nbytes == 6 * 5 * 4 * 4
    # a transposed view with an offset spans its hints' elements from the offset
    view = TensorProxy("v", (shape[1], shape[0]), torch.float16, "cpu",
                       strides=(strides[1], strides[0]), storage_offset=3)
    assert _storage_bytes(view) == (3 + 1 + 4 * 4 + 5 * 20) * 2
    empty = TensorProxy("e", (shape[0], 0), torch.float32, "cpu")
    assert _storage_bytes(empty) == 0


def test_a_static_proxy_keeps_pytorchs_storage_size():
    proxy = TensorProxy("x", (3, 4), torch.float32, "cpu", strides=(1, 3), storage_offset=2)
    assert _storage_bytes(proxy) == (2 + 12) * 4


def test_symbolic_guards_import_no_export_or_inductor():
    """PyTorch's guard locations import torch.export and inductor on the first guard; fulmen's
    ShapeEnv records none, so a symbolic compilation (with guards: `x.shape[0] > 4`) leaves
    them unimported. Run in a fresh interpreter: the test process may have imported them."""
    program = textwrap.dedent("""
        import sys
        import torch
        import fulmen

        def fn(x):
            return x * 2 if x.shape[0] > 4 else x - 1

        jfn = fulmen.jit(fn)
        for n in (5, 6, 7, 9):
            x = torch.randn(n, 3)
            torch.testing.assert_close(jfn(x), fn(x))
        assert fulmen.cache_misses(jfn) == 2, fulmen.cache_misses(jfn)
        print(sorted(m for m in ("torch.export._trace", "torch._inductor.codecache",
                                 "torch._functorch.aot_autograd") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=str(__import__("pathlib").Path(__file__).parents[2]), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _failures():
    """(call, message) for each prim check whose message formats shapes (made on failure)."""
    from fulmen.ops import prims

    a = TensorProxy("a", (2, 3), torch.float32, "cpu")
    other = TensorProxy("o", (3, 2), torch.float32, "cpu")
    pred = TensorProxy("p", (3, 2), torch.bool, "cpu")
    return [
        (lambda: prims.reshape(a, (4, 2)), "cannot reshape (2, 3) to (4, 2)"),
        (lambda: prims.reshape(a, (-1, 6)), "invalid shape (-1, 6)"),
        (lambda: prims.add(a, other), "shapes differ: torch.Size([2, 3]) vs torch.Size([3, 2])"),
        (lambda: prims.add(a, "x"), "operand 'x' is not a tensor or number"),
        (lambda: prims.where(pred, a, a), "pred shape torch.Size([3, 2]) != torch.Size([2, 3])"),
        (lambda: prims.squeeze(a, (0,)), "dims (0,) are not all of size 1"),
        (lambda: prims.pad(a, 0.0, ((0, -3, 0), (0, 0, 0))), "makes a negative size"),
        (lambda: prims.slice_prim(a, (0, 0), (3, 3), (1, 1)), "bad slice 0:3:1 of 2"),
    ]


def test_prim_checks_that_fail_still_say_what_differs():
    from fulmen.core import FulmenError
    from fulmen.core.trace import TraceCtx, tracing

    with tracing(TraceCtx("checks")):
        for call, message in _failures():
            try:
                call()
            except FulmenError as error:
                assert message in str(error), (message, str(error))
            else:
                raise AssertionError(f"no error: {message}")


def test_prim_checks_that_pass_format_nothing(monkeypatch):
    """A passing check formats no shape or operand (with symbolic sizes, sympy printing)."""
    from fulmen.core.trace import TraceCtx, tracing
    from fulmen.ops import prims

    def refuse(self, *args, **kwargs):
        raise AssertionError("formatted while checking")

    sizes = SymbolicSizes()
    shape, strides = sizes.symbolize(torch.empty(4, 3), "a", dims=(0,))
    with tracing(TraceCtx("checks")):
        a = TensorProxy("a", shape, torch.float32, "cpu", strides=strides)
        pred = TensorProxy("p", shape, torch.bool, "cpu", strides=strides)
        for name in ("__repr__", "__str__", "__format__"):
            monkeypatch.setattr(torch.SymInt, name, refuse)
        monkeypatch.setattr(TensorProxy, "__repr__", refuse)
        prims.add(a, a)
        prims.where(pred, a, a)
        prims.reshape(a, (3, shape[0]))
        prims.squeeze(prims.reshape(a, (1, shape[0] * 3)), (0,))
        prims.pad(a, 0.0, ((0, 1, 0), (0, 0, 0)))
        prims.slice_prim(a, (0, 1), (shape[0], 3), (1, 1))


def test_symbolic_answers_are_kept_by_the_shape_env():
    """`contiguous_strides` and `known_same_shape` of the same symbolic sizes are asked of sympy
    once per ShapeEnv (NOTE [answers kept by the ShapeEnv]); the answers are the computed ones."""
    from fulmen.proxies.tensor import contiguous_strides, known_same_shape

    sizes = SymbolicSizes()
    (s0, s1, four), _ = sizes.symbolize(torch.empty(6, 5, 4), "x", dims=(0, 1))
    strides = contiguous_strides((s0, s1, four))
    assert [str(s) for s in strides] == [f"4*{s1}", "4", "1"]
    assert contiguous_strides((s0, s1, four)) is strides  # kept, not computed again
    same = s1 * 4
    assert known_same_shape((strides[0], s0), (same, s0))
    assert sizes.env._fulmen_known_same  # the equality is kept
    assert not known_same_shape((s0,), (s1,))  # unknown without a guard: not kept, not guarded
    assert not sizes.env.guards


def test_row_major_answers_are_kept_and_tiny_regions_sized_from_hints():
    """A proxy's `is_contiguous()` with symbolic sizes is kept per ShapeEnv too; the tiny-region
    size test of fusion reads the sizes' traced values (no SymInt product, no sympy question,
    nothing to keep). The answers are the computed ones (no guard recorded)."""
    from fulmen.transforms.region_size import _numel_at_most

    sizes = SymbolicSizes()
    shape, strides = sizes.symbolize(torch.empty(6, 5, 4), "x", dims=(0, 1))
    proxy = TensorProxy("x", shape, torch.float32, "cpu", strides=strides)
    assert proxy.is_contiguous()
    assert len(sizes.env._fulmen_row_major) == 1
    assert proxy.is_contiguous()
    transposed = TensorProxy("t", (shape[1], shape[0], 4), torch.float32, "cpu",
                             strides=(strides[1], strides[0], 1))
    assert not transposed.is_contiguous()
    assert len(sizes.env._fulmen_row_major) == 1  # only known answers are kept
    assert _numel_at_most(shape, 1 << 20)  # at the traced sizes (120 elements)
    assert not _numel_at_most(shape, 100)
    assert _numel_at_most(shape, 120) and not _numel_at_most(shape, 119)
    assert not getattr(sizes.env, "_fulmen_numel_at_most", None)  # no sympy answer to keep
    assert not sizes.env.guards


def test_size_sources_look_at_each_proxy_once(monkeypatch):
    """`fulmen.transforms.dce.size_sources` (which proxies bind the symbols a backward uses)
    reads the sizes and strides of each proxy once, however many statements read it; the
    carrier it finds is the same."""
    from fulmen.core import BoundSymbol
    from fulmen.ops import prims
    from fulmen.transforms.dce import size_sources

    sizes = SymbolicSizes()
    shape, strides = sizes.symbolize(torch.empty(6, 5), "x", dims=(0, 1))
    x = TensorProxy("x", shape, torch.float32, "cpu", strides=strides)
    outs = [TensorProxy(f"t{i}", shape, torch.float32, "cpu", strides=strides) for i in range(8)]
    bsyms = [BoundSymbol(prims.neg, (x,), {}, out) for out in outs]
    dce = importlib.import_module("fulmen.transforms.dce")  # (the package exports a `dce` function)

    asked = []
    strides_of = dce.strides_of  # (how dce reads a proxy's strides, past __torch_function__)

    def counting(tensor):
        asked.append(tensor.name)
        return strides_of(tensor)

    monkeypatch.setattr(dce, "strides_of", counting)
    assert size_sources(bsyms, outs[-1], (), (x,)) == [x]
    # x: once among the statements (8 read it), once as the candidate carrier
    assert sorted(asked) == sorted(["x", "x", *(out.name for out in outs)])


def test_size_sources_find_the_symbols_of_each_expression():
    """`size_sources` keeps each expression's free symbols (`dce._free_symbols`): two sizes
    of one form (`2*s0`, `2*s1`) still give their own symbols, so a carrier is found for
    each."""
    from fulmen.core import BoundSymbol
    from fulmen.ops import prims
    from fulmen.transforms.dce import size_sources

    sizes = SymbolicSizes()
    (s0, s1), _ = sizes.symbolize(torch.empty(6, 5), "x", dims=(0, 1))
    a = TensorProxy("a", (s0,), torch.float32, "cpu")
    b = TensorProxy("b", (s1,), torch.float32, "cpu")
    for first, second in ((s0, s1), (s1, s0)):
        u = TensorProxy("u", (2 * first,), torch.float32, "cpu")
        v = TensorProxy("v", (2 * second,), torch.float32, "cpu")
        bsyms = [BoundSymbol(prims.neg, (u,), {}, v)]
        assert size_sources(bsyms, v, (), (a, b)) == [a, b]


def _counting_mul(monkeypatch) -> list:
    """Spy on PyTorch's implementation of `SymNode.mul` (what builds the sympy product)."""
    from torch.fx.experimental.sym_node import SymNode

    built = []
    implementation = SymNode._mul

    def counting(self, other):
        built.append((self.expr, other.expr))
        return implementation(self, other)

    monkeypatch.setattr(SymNode, "_mul", counting)
    return built


def test_symbolic_arithmetic_is_built_once_per_shape_env(monkeypatch):
    """NOTE [symbolic arithmetic kept by the ShapeEnv]: while a trace or its passes run, the
    same operation on the same sizes of one of fulmen's ShapeEnvs is built once; the answer is
    the same node, with PyTorch's expression and hint. Another ShapeEnv (torch.compile's)
    gets PyTorch's own operations, as does everything outside the switch."""
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fulmen.tracer.sym_ops import memoized_symbolic_ops

    built = _counting_mul(monkeypatch)
    sizes = SymbolicSizes()
    shape, _ = sizes.symbolize(torch.empty(6, 5), "x", dims=(0, 1))
    built.clear()  # (the strides of the symbolized input)
    a, b = shape[0].node.expr, shape[1].node.expr
    with memoized_symbolic_ops():
        products = [shape[0] * shape[1] for _ in range(5)] + [shape[0] * 4, shape[0] * 4]
        assert len(built) == 2  # s0*s1 and 4*s0, each once
        assert len({id(p.node) for p in products}) == 2
        assert [p.node.hint for p in products] == [30] * 5 + [24, 24]
        assert products[0].node.expr == a * b and products[-1].node.expr == 4 * a
        assert shape[0] * 4.0 is not None and len(built) == 3  # a float operand: its own
        other = ShapeEnv()
        n = other.create_symintnode(other.create_symbol(6, LocalSource("n")), hint=6)
        before = len(built)
        for _ in range(3):
            n * 4
        assert len(built) == before + 3  # not fulmen's ShapeEnv: built each time
    before = len(built)
    shape[0] * shape[1]
    assert len(built) == before + 1  # switched off: PyTorch's operation


def test_a_symbolic_trace_builds_each_operation_once(monkeypatch):
    """A traced program with many ops on the same symbolic shapes (the row-major strides of
    each new proxy, each shape compared with another) builds each product of sizes once;
    results stay eager's."""
    import fulmen

    def fn(x):
        for _ in range(6):
            x = (x * 2).transpose(0, 1).contiguous().transpose(0, 1) + 1
        return x.reshape(-1)

    built = _counting_mul(monkeypatch)
    jfn = fulmen.jit(fn, dynamic=True)
    x = torch.randn(5, 7)
    torch.testing.assert_close(jfn(x), fn(x))
    assert len(built) == len(set(built)), built
    y = torch.randn(3, 9)
    torch.testing.assert_close(jfn(y), fn(y))
    assert fulmen.cache_misses(jfn) == 1


def test_the_text_of_a_symbolic_size_is_printed_once(monkeypatch):
    """NOTE [the text of a symbolic size]: printing a trace writes its sizes through sympy's
    printer; the text of an expression is made once, and is PyTorch's."""
    from torch.fx.experimental.sym_node import SymNode

    import fulmen  # noqa: F401  (installs fulmen's SymInt formatting)
    from fulmen.core import printer

    printed = []
    original = SymNode.str

    def counting(self):
        printed.append(self.expr)
        return original(self)

    monkeypatch.setattr(SymNode, "str", counting)
    monkeypatch.setattr(printer, "_TEXTS", {})  # (another test may have printed it)
    sizes = SymbolicSizes()
    shape, _ = sizes.symbolize(torch.empty(6, 5), "x", dims=(0, 1))
    product = shape[0] * shape[1] + 3
    texts = [str(product), repr(product), str(product), f"{product!r}"]
    assert texts == [original(product.node)] * 4
    assert len(printed) == 1
    proxy = TensorProxy("p", (product, 4), torch.float32, "cpu")
    assert proxy.type_string() == f"cpu f32[{texts[0]}, 4]" and len(printed) == 1


def test_symint_results_are_kept_per_method_and_operand(monkeypatch):
    """NOTE [symbolic arithmetic kept at the SymInt]: under the switch, a `SymInt` method with
    a plain int or a SymInt of the same ShapeEnv returns the result it returned before for the
    same method and operands (the same object, built once); another method, another operand,
    a float or bool operand, or operands in the other order are never answered from it."""
    from fulmen.tracer.sym_ops import memoized_symbolic_ops

    built = _counting_mul(monkeypatch)
    sizes = SymbolicSizes()
    (s0, s1), _ = sizes.symbolize(torch.empty(6, 5), "x", dims=(0, 1))
    a, b = s0.node.expr, s1.node.expr
    built.clear()  # (the strides of the symbolized input)
    with memoized_symbolic_ops():
        first = s0 * 4
        assert s0 * 4 is first and len(built) == 1
        assert 4 * s0 is not first and len(built) == 2  # reflected: a method of its own
        assert (4 * s0).node.expr == 4 * a
        assert (s0 + 4).node.expr == a + 4 and (s0 - 4).node.expr == a - 4
        assert (4 - s0).node.expr == 4 - a and (s0 - 4).node.hint == 2
        assert (s0 * s1).node.expr == a * b and (s0 - s1).node.expr == a - b
        assert (s1 - s0).node.expr == b - a and (s1 - s0).node.hint == -1
        assert (s0 * 5).node.hint == 30 and (s0 * 4).node.hint == 24
        as_float = s0 * 2.0  # equal to 2 as a key: never looked up
        assert (s0 * 2).node.hint == 12 and isinstance(s0 * 2, torch.SymInt)
        assert isinstance(as_float, torch.SymFloat) and isinstance(s0 * 2.0, torch.SymFloat)
        assert isinstance(s0 * True, torch.SymInt) and (s0 * True).node.expr == a
        assert isinstance(s0 == 6, torch.SymBool) and (s0 == 6) is (s0 == 6)
        assert (s0 < 7).node.expr != (s0 > 7).node.expr
    assert s0 * 4 is not first  # switched off: PyTorch's own
    other = SymbolicSizes()  # another ShapeEnv: its sizes are not the first's
    (t0, _), _ = other.symbolize(torch.empty(3, 2), "x", dims=(0, 1))
    with memoized_symbolic_ops():
        assert (t0 * 4).node.hint == 12 and (t0 * 4).node.shape_env is t0.node.shape_env


def test_a_proxy_made_row_major_answers_is_contiguous_as_eager():
    """A proxy made without `strides=` has its shape's row-major strides and answers
    `is_contiguous()` True at once (no sizes compared, no guard); every other question (other
    strides, another memory format, a copy restrided by layout truth) gets the answer eager
    gives for the same layout."""
    from fulmen.ops.meta import with_strides

    sizes = SymbolicSizes()
    shape, _ = sizes.symbolize(torch.empty(6, 5, 4, 3), "x", dims=(0, 1))
    guards = len(sizes.env.guards)
    for dims in ((6, 5, 4, 3), tuple(shape)):
        made = TensorProxy("a", dims, torch.float32, "cpu")
        assert made.is_contiguous() and len(sizes.env.guards) == guards
        for fmt in (torch.channels_last, torch.contiguous_format):
            real = torch.empty(6, 5, 4, 3)
            assert made.is_contiguous(memory_format=fmt) == real.is_contiguous(memory_format=fmt)
    real = torch.empty(6, 5, 4, 3).permute(0, 2, 3, 1)
    for strides, expected in ((real.stride(), False), ((60, 12, 3, 1), True)):
        proxy = TensorProxy("b", real.shape if not expected else (6, 5, 4, 3), torch.float32,
                            "cpu", strides=strides)
        assert proxy.is_contiguous() is expected
    last = TensorProxy("c", (6, 5, 4, 3), torch.float32, "cpu", strides=(60, 1, 15, 5))
    assert not last.is_contiguous() and last.is_contiguous(memory_format=torch.channels_last)
    # a copy with other strides (and the first's attributes) answers for its own strides
    made = TensorProxy("d", (6, 5, 4, 3), torch.float32, "cpu")
    assert not with_strides(made, (60, 1, 15, 5)).is_contiguous()
    assert with_strides(made, (60, 12, 3, 1)).is_contiguous()
