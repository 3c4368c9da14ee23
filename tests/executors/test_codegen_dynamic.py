"""Codegen fusions of regions with symbolic sizes (issue 16): one compiled kernel serves every
size, results equal eager for each, and lowering never decides on a comparison of sizes that
depends on the call (`fulmen.executors.codegen.sizes`)."""

import gc

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.executors.codegen import sizes as codegen_sizes
from fulmen.executors.codegen.cpu import runtime
from fulmen.executors.codegen.ops import Unsupported
from fulmen.tracer.symbolic import SymbolicSizes

pytestmark = pytest.mark.usefixtures("codegen_eager")

EXECUTORS = ["codegen", "torch"]


@pytest.fixture
def builds(monkeypatch):
    """The kernel sources whose builds the CPU runtime starts (one per new kernel)."""
    started = []
    submit = runtime._submit

    def counting(source):
        started.append(source)
        return submit(source)

    monkeypatch.setattr(runtime, "_submit", counting)
    return started


def _fused(trace) -> int:
    return str(trace).count("codegen.fusion")


def _statements(trace) -> list[str]:
    """The statements of a printed trace's body that compute a tensor (not comments, symbol
    bindings or dels)."""
    body = str(trace).split("def ", 1)[1].splitlines()[1:]
    return [line.strip() for line in body
            if line.strip().startswith("t") and " = " in line.split("#")[0]]


def _sweep(fn, make, sizes, builds, *, grad=False, **tol):
    """Call `fulmen.jit(fn, dynamic=True)` on `make(n)` for each n; compare with eager (and the
    gradients of the inputs that require grad); return the jitted function. No kernel is built
    after the first call."""
    jfn = fulmen.jit(fn, executors=EXECUTORS, dynamic=True)
    after_first = None
    for n in sizes:
        args = make(n)
        ref = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        out, expected = jfn(*args), fn(*ref)
        torch.testing.assert_close(out, expected, **tol)
        if grad:
            out.sum().backward()
            expected.sum().backward()
            for a, r in zip(args, ref):
                if a.requires_grad:
                    torch.testing.assert_close(a.grad, r.grad, **tol)
        if after_first is None:
            after_first = len(builds)
    assert after_first > 0 and len(builds) == after_first
    assert fulmen.cache_misses(jfn) == 1
    return jfn


def test_elementwise_with_broadcast_and_slices_over_many_sizes(builds):
    def fn(x, y):
        return torch.sigmoid(x[:, 1:] * y[1:] + 1.5).exp() - x[:, :-1]

    make = lambda n: (torch.randn(n, n + 3), torch.randn(n + 3))  # noqa: E731
    jfn = _sweep(fn, make, (4, 9, 2, 17, 33, 6, 9), builds)
    trace = fulmen.last_traces(jfn)[-1]
    assert '"cpu f32[s' in str(trace) and _fused(trace) == 1
    assert all("codegen.fusion" in line for line in _statements(trace))


def test_row_reductions_softmax_rmsnorm_and_sums(builds):
    def fn(x, w):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return torch.softmax(h, -1) + h.sum(-1, keepdim=True) * 0.1

    make = lambda n: (torch.randn(3, n, 24), torch.randn(24))  # noqa: E731
    jfn = _sweep(fn, make, (5, 12, 2, 40, 7), builds)
    trace = fulmen.last_traces(jfn)[-1]
    assert _fused(trace) >= 1
    assert "torchex.sum" not in str(trace) and "torchex.amax" not in str(trace)


def test_layer_norm_rows_of_symbolic_width(builds):
    def fn(x, w, b):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * w + b

    make = lambda n: (torch.randn(n, n), torch.randn(n), torch.randn(n))  # noqa: E731
    _sweep(fn, make, (3, 8, 31, 5, 64), builds, atol=1e-5, rtol=1e-5)


def test_forward_and_backward_fused_over_many_sizes(builds):
    def fn(x, w):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return F.gelu(torch.softmax(h, -1) * h)

    def make(n):
        return (torch.randn(2, n, 16, requires_grad=True), torch.randn(16, requires_grad=True))

    jfn = _sweep(fn, make, (3, 10, 25, 4, 17), builds, grad=True, atol=1e-5, rtol=1e-4)
    backward = fulmen.last_backward_traces(jfn)[-1]
    assert '"cpu f32[s' in str(backward) and _fused(backward) >= 1


def test_sizes_zero_and_one_alternating_with_symbolic():
    fn = lambda x: torch.softmax(x * 2, -1) + x.sum(-1, keepdim=True)  # noqa: E731
    jfn = fulmen.jit(fn, executors=EXECUTORS, dynamic=True)
    for n in (5, 1, 7, 0, 9, 1, 5, 2):
        x = torch.randn(n, n + 2)
        torch.testing.assert_close(jfn(x), fn(x))


def test_lowering_asks_the_shape_env_without_guards():
    sizes = SymbolicSizes()
    (a, b, c), _ = sizes.symbolize(torch.empty(6, 4, 9), "x", dims=(0, 2))
    assert codegen_sizes.same(a, a) and codegen_sizes.same(4 * a, a * 4)
    assert not codegen_sizes.same(a, 1) and not codegen_sizes.same(a + 1, a)
    for x, y in ((a, c), (b, c), (2 * a, c)):  # equal or not depends on the call: no guess
        with pytest.raises(Unsupported):
            codegen_sizes.same(x, y)
    assert codegen_sizes.same_shape((a, 4), (a, b)) and not codegen_sizes.same_shape((a,), (a, 1))
    assert not sizes.env.guards  # nothing was specialised
    frozen = codegen_sizes.freeze((a, [4, c]))
    assert frozen == codegen_sizes.freeze((a, (4, c))) and hash(frozen)
    assert codegen_sizes.has_sym_sizes(frozen) and not codegen_sizes.has_sym_sizes((4, (2,)))


def test_a_short_inner_axis_iterates_the_longest_axis_innermost():
    from fulmen.executors.codegen.cpu.plans import long_inner as _long_inner

    sizes, rows = _long_inner([8, 4, 128, 4], [[2048, 4, 16, 1], [2048, 512, 4, 1]])
    assert sizes == [8, 4, 4, 128] and rows == [[2048, 4, 1, 16], [2048, 512, 1, 4]]
    assert _long_inner([8, 16], [[16, 1]]) == ([8, 16], [[16, 1]])  # long enough already
    fn = lambda x, y: -x.transpose(1, 2) * y + 1  # noqa: E731
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    for shape in ((8, 128, 4, 4), (3, 64, 2, 5), (2, 9, 1, 3)):
        x, y = torch.randn(shape), torch.randn(shape[0], shape[2], shape[1], shape[3])
        torch.testing.assert_close(jfn(x, y), fn(x, y))


def test_a_region_is_made_concrete_rebuilding_only_its_symbolic_parts():
    """`sizes._substituter`: every `SymSize` (in shapes, accesses and view parameters) gets its
    size; tuples and IR objects holding none are shared with the symbolic region, not copied."""
    import sympy

    from fulmen.executors.codegen.ir import Access, ViewStep

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    sym = codegen_sizes.SymSize
    static = Access(1, (ViewStep("broadcast_in_dim", ((4, 8), (1,))),))
    parts = ((sym(s0), 8),
             (Access(0, (ViewStep("slice", ((0, 0), (sym(s0 * s1), 8), (1, 1))),)), static),
             (("kernel", 0), ("view", Access(0, (ViewStep("reshape", ((sym(s1 + 2), 4),)),)))))
    index = {s0: 0, s1: 1, s0 * s1: 2, s1 + 2: 3}
    rebuilt = codegen_sizes._substituter(parts, index)((3, 5, 15, 7))
    assert rebuilt == ((3, 8),
                       (Access(0, (ViewStep("slice", ((0, 0), (15, 8), (1, 1))),)), static),
                       (("kernel", 0), ("view", Access(0, (ViewStep("reshape", ((7, 4),)),)))))
    assert rebuilt[1][1] is static and rebuilt[2][0] is parts[2][0]
    assert codegen_sizes._substituter((static, (1, 2)), index) is None


def test_a_sweep_over_sizes_keeps_few_concrete_regions(monkeypatch):
    """A call plan is kept per shape and holds what its calls need, not the concrete region it
    was made from; only the last `bound_limit` concrete regions are kept (a sweep over many
    shapes once left up to 256 per region, thousands of objects for the garbage collector)."""
    from fulmen.executors.codegen.ir import Access, ViewStep

    made = []
    init = runtime.FusedRegion.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(runtime.FusedRegion, "__init__", recording)
    fn = lambda x, y: torch.softmax(x[:, 1:] * 2, -1) + y.transpose(0, 1)  # noqa: E731
    jfn = fulmen.jit(fn, executors=EXECUTORS, dynamic=True)
    lengths = range(3, 15)
    for n in lengths:
        x, y = torch.randn(5, n + 1), torch.randn(n, 5)
        torch.testing.assert_close(jfn(x, y), fn(x, y))
    regions = [r for r in made if r.binder is not None]
    assert regions and fulmen.cache_misses(jfn) == 1
    for region in regions:
        assert len(region._plans) == len(lengths)
        seen, stack = set(), [region._plans]
        while stack:  # what the plans hold, down to tensors and functions
            obj = stack.pop()
            if id(obj) in seen or isinstance(obj, torch.Tensor) or callable(obj):
                continue
            seen.add(id(obj))
            assert type(obj).__name__ not in ("LoweredRegion", "LoweredRows")
            assert not isinstance(obj, (Access, ViewStep, list))
            stack.extend(gc.get_referents(obj))
        assert len(region._bound) <= 4 < len(lengths)  # `FusedRegion.bound_limit`


def _two_widths(x, y):
    return (x * 2 + 1).exp(), (y * 2 + 1).exp()


def test_regions_alike_but_for_a_size_share_generated_code_not_sizes():
    """Two symbolic regions that differ only in a static size (4 and 6 columns; the rows vary)
    generate the same substituter text, compiled once (`sizes._code`) and run in each region's
    scope: each region still runs with its own sizes, checked against eager at every length."""
    codegen_sizes._CODES.clear()
    jfn = fulmen.jit(_two_widths, executors=EXECUTORS)  # automatic dynamic: the rows only
    for n in (3, 5, 9, 12):
        x, y = torch.randn(n, 4), torch.randn(n, 6)
        torch.testing.assert_close(jfn(x, y), _two_widths(x, y))
    assert fulmen.cache_misses(jfn) == 2 and _fused(fulmen.last_traces(jfn)[-1]) == 2
    substituters = [source for source in codegen_sizes._CODES if "_substitute" in source]
    assert len(substituters) == 1
