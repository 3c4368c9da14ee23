"""How the CPU runtime calls a compiled kernel (`codegen/cpu/runtime.py`, NOTE [one-argument
entry] in `codegen/cpu/compiler.py`): one block of int64s per call, its pointers written by
each call into a block no other call is using, and a call plan per input layout.
"""

import ctypes
import threading

import pytest
import torch

import fulmen
from fulmen.executors.codegen.cpu import compiler
from fulmen.executors.codegen.cpu.runtime import FusedRegion, render_any

pytestmark = pytest.mark.usefixtures("codegen_eager")

EXECUTORS = ["codegen", "torch"]


def _fn(x, y):
    return (x * y).sin() + x


def _region(jfn) -> FusedRegion:
    regions = [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bsyms
               if isinstance(b.sym.impl, FusedRegion)]
    assert len(regions) == 1
    return regions[0]


def test_the_one_argument_entry_runs_the_kernel_on_a_block():
    """`fulmen_call` reads [ndim, block, threads, first pointer, sizes, strides, pointers]
    and computes what the kernel computes: here a (3, 5) region as one flat row of 15."""
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    jfn = fulmen.jit(_fn, executors=EXECUTORS)
    jfn(x, y)
    kernel = _region(jfn).kernel
    entry = compiler.load_entry(render_any(kernel, (1, 1, 1)))
    out = torch.empty(3, 5)
    start = 4 + 1 + 3  # header, one size, one stride per pointer
    block = (ctypes.c_int64 * (start + 3))(1, 15, 1, start, 15, 1, 1, 1, x.data_ptr(),
                                           y.data_ptr(), out.data_ptr())
    entry(block)
    torch.testing.assert_close(out, _fn(x, y))


def test_calls_on_several_threads_write_their_own_outputs():
    """A kernel runs without the GIL: calls of one region on several threads at once each
    write their pointers into a block of their own, so none reads another call's inputs or
    writes its outputs (many rows: a kernel reads the pointers again for every row)."""
    jfn = fulmen.jit(_fn, executors=EXECUTORS)
    base = torch.randn(512, 64)
    jfn(base, base)
    errors = []

    def work(seed):
        x = torch.randn(512, 64, generator=torch.Generator().manual_seed(seed))
        y = x + seed
        for _ in range(40):
            if not torch.allclose(jfn(x, y), _fn(x, y)):
                errors.append(seed)
                return

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


def test_a_plan_serves_only_its_own_layout():
    """One region called with contiguous, transposed and offset inputs of one shape, in turn:
    each layout gets a plan of its own (its strides; the offset is the data pointer's), and
    none runs with another's."""
    jfn = fulmen.jit(_fn, executors=EXECUTORS)
    storage = torch.randn(200)
    jfn(storage[:64].view(8, 8), storage[64:128].view(8, 8))
    region = _region(jfn)
    layouts = [lambda: storage[:64].view(8, 8), lambda: storage[:64].view(8, 8).t(),
               lambda: storage[7:71].view(8, 8), lambda: storage[100:180].view(8, 10)[:, 1:9],
               lambda: storage[110:190].view(8, 10)[:, 2:]]
    for _ in range(2):
        for layout in layouts:
            x = layout()
            y = storage[136:200].view(8, 8)
            torch.testing.assert_close(region(x, y), _fn(x, y))
            storage.add_(0.5)
    assert len(region._plans) == 3  # contiguous (at any offset), transposed, rows of 10


@pytest.mark.parametrize("shape", [(3, 1, 4), (2, 1, 1, 5), (1, 7), (6,)], ids=str)
def test_outputs_have_the_strides_of_torch_empty(shape):
    """Kernel outputs are made with the row-major strides `torch.empty` gives, size-1 dims
    included (a stride differing there changes `stride()` and channels-last answers)."""
    x, y = torch.randn(shape), torch.randn(shape)
    jfn = fulmen.jit(_fn, executors=EXECUTORS)
    out, expected = jfn(x, y), _fn(x, y)
    _region(jfn)
    torch.testing.assert_close(out, expected)
    assert out.stride() == expected.stride() == torch.empty(shape).stride()
    assert out.is_contiguous(memory_format=torch.channels_last) == \
        expected.is_contiguous(memory_format=torch.channels_last)


def _regions(jfn) -> list[FusedRegion]:
    return [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bsyms
            if isinstance(b.sym.impl, FusedRegion)]


def test_regions_of_one_kernel_share_their_call_plans():
    """Two regions of the same kernel, sizes and input types (a model's layers) share one
    table of call plans (`_plan_table`): the plan one of them makes serves the other. A region
    whose constant differs (so does its kernel) keeps its own, and each computes its own
    result."""
    def fn(x, w):
        a = (x * 2).exp() @ w
        b = (a * 2).exp() @ w
        return (b * 3).exp()

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    w = torch.randn(6, 6) / 4
    for x in (torch.randn(6, 6) / 4, torch.randn(6, 6).t() / 4):  # two layouts of x
        torch.testing.assert_close(jfn(x, w), fn(x, w))
    first, second, third = _regions(jfn)
    assert first._plans is second._plans and len(first._plans) == 2
    assert third._plans is not first._plans and len(third._plans) == 1


@pytest.mark.parametrize("scale", [-0.0, float("nan")], ids=str)
def test_regions_of_equal_looking_constants_do_not_share_plans(scale):
    """-0.0 compares equal to 0.0 (so do kernels holding them) but computes otherwise
    (atan(1 / (t * -0.0)) is -pi/2 for t > 0): the rendered source is part of the signature,
    so the two regions keep their own plans and kernels, and each result is its own (a kernel
    holding NaN equals no other)."""
    def fn(x, w):
        a = torch.atan(1 / (x * 0.0)) @ w
        return torch.atan(1 / (a * scale))

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    x, w = torch.rand(5, 5) + 1, torch.rand(5, 5) + 1
    torch.testing.assert_close(jfn(x, w), fn(x, w), equal_nan=True)
    first, second = _regions(jfn)
    assert first._plans is not second._plans


def test_column_sums_over_other_axes_do_not_share_plans():
    """`(x * 2).sum(0)` and `(x * 2).sum((0, 1))` of one (30, 20, 70) input lower to equal
    kernels over one shape, reduced over other axes (`LoweredRows.reduced`: (1, 2) and (2,)),
    so their plans differ ((20, 70) and (70,) outputs): the regions never share them (NOTE [a
    plan's signature is the whole lowered region] in `cpu/plans.py`), and each result is its
    own. A signature without `reduced` ran the second region with the first's plan. (Small
    integers: sums exact in any order.)"""
    x = torch.randint(-4, 5, (30, 20, 70)).float()
    fns = (lambda t: (t * 2).sum(0), lambda t: (t * 2).sum((0, 1)))
    jfns = [fulmen.jit(fn, executors=EXECUTORS) for fn in fns]
    for fn, jfn in zip(fns, jfns):
        torch.testing.assert_close(jfn(x), fn(x))
    (first,), (second,) = (_regions(jfn) for jfn in jfns)
    assert first.kernel == second.kernel and first.lowered.shape == second.lowered.shape
    assert first.lowered.reduced != second.lowered.reduced
    assert first._plans is not second._plans


def test_the_last_plan_runs_again_only_for_inputs_its_check_passes():
    """NOTE [the last plan]: a second call with the layout of the first runs the plan it
    remembered without the table; a negated view, a transposed tensor or one that requires
    grad, of the same shape, each fails its check and is planned from its own key: each
    result is eager's."""
    jfn = fulmen.jit(_fn, executors=EXECUTORS)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    jfn(x, y)
    region = _region(jfn)
    region(x, y)
    plan = region._last[3]
    region._plans = type(region._plans)()  # (the table no longer holds the plan)
    torch.testing.assert_close(region(x + 1, y), _fn(x + 1, y))
    assert len(region._plans) == 0 and region._last[3] is plan
    for other in (torch._neg_view(x), x.t(), x.clone().requires_grad_()):
        torch.testing.assert_close(region(other, y), _fn(other, y).detach())
        torch.testing.assert_close(region(x, y), _fn(x, y))
