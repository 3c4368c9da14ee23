"""The codegen row schedule (reductions and normalisations) against eager: reductions over
chosen axes and dtypes, long rows, NaN propagation, non-contiguous and zero-size inputs, the
normalisation ops forward and backward (fused in both traces), and OpInfo samples of the
reduction and normalisation ops. Kernels compile into a per-session FULMEN_CACHE_DIR (the
fixture of test_codegen.py is repeated here)."""


import os
import platform
import subprocess

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.executors.codegen import kernel_sources
from fulmen.executors.codegen.cpu.compiler import CXX_FLAGS, compiler
from fulmen.tools.accuracy import assert_accurate
from tests.ops.opinfo_harness import assert_same, matched_opinfos, samples

# a kernel that fails to build warns and runs the torch fallback (eager's values): here that is
# an error, so a miscompiled kernel source cannot hide behind the fallback
pytestmark = [pytest.mark.usefixtures("codegen_eager"), pytest.mark.filterwarnings(
    "error:fulmen codegen.*runs on the torch executor:RuntimeWarning")]

EXECUTORS = ["codegen", "torch"]


def _trace(jfn) -> str:
    return str(fulmen.last_traces(jfn)[-1])


def _check(fn, *args, **tol):
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    actual, expected = jfn(*args), fn(*args)
    torch.testing.assert_close(actual, expected, equal_nan=True, **tol)
    assert "codegen.fusion" in _trace(jfn)
    assert "torchex.sum" not in _trace(jfn) and "torchex.amax" not in _trace(jfn)
    return jfn


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_float_reductions_over_chosen_axes(dtype):
    x = torch.randn(6, 5, 40).to(dtype)
    _check(lambda a: (a * 2).sum(-1), x)
    _check(lambda a: (a + 1).sum((1, 2), keepdim=True), x)
    _check(lambda a: (a.exp().amax(-1), a.amin((0, 2)), (a - 1).sum()), x)
    low = {"atol": 1e-2, "rtol": 1e-2} if dtype.itemsize == 2 else {}  # eager rounds each step
    _check(lambda a: (a * 0.5 + 1).prod(-1), x, **low)
    _check(lambda a: (a.mean(-1), a.var(-1), a.std((1, 2), correction=0)), x)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_int_reductions(dtype):
    x = torch.randint(0, 50, (7, 33)).to(dtype)
    _check(lambda a: ((a * 3).sum(-1), a.amax(-1), a.amin(-1)), x)
    _check(lambda a: (a % 3 + 1).prod(-1), x)


def test_long_rows_are_accurate():
    # eager sums float32 in a cascade; a naive serial float sum of 2**22 values drifts past
    # the tolerance, so the kernel accumulates blocks in double.
    x = torch.rand(2, 1 << 22) + 10
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # with fewer rows than threads, large reductions go to torch
    try:
        _check(lambda a: (a * 1).sum(-1), x)
        _check(lambda a: a.sum(), torch.rand(1 << 20) + 10)
    finally:
        torch.set_num_threads(threads)
    # softmax of a long row: at least as close to the float64 result as eager is
    x = torch.randn(3, 300_000) * 4
    jfn = fulmen.jit(lambda a: (a.softmax(-1), a.var(-1)), executors=EXECUTORS)
    (soft, var), reference = jfn(x), (x.double().softmax(-1), x.double().var(-1))
    for actual, eager, ref in zip((soft, var), (x.softmax(-1), x.var(-1)), reference):
        assert (actual - ref).abs().max() <= max((eager - ref).abs().max(), 1e-7 * ref.abs().max())


def test_nan_and_inf_propagate():
    x = torch.randn(4, 70)
    x[0, 3], x[1, 60], x[2, 5], x[2, 6] = float("nan"), float("inf"), float("inf"), -float("inf")
    _check(lambda a: (a.amax(-1), a.amin(-1), a.sum(-1), a.softmax(-1), a.var(-1)), x)


def test_layouts_and_zero_size():
    x = torch.randn(30, 50)
    _check(lambda a: a.t().sum(-1), x)  # strided inner loads
    _check(lambda a: a[:, ::3].exp().sum(-1), x)
    _check(lambda a, b: (a.t() * b).softmax(-1), x, torch.randn(30))
    jfn = fulmen.jit(lambda a: F.softmax(a * 2, -1), executors=EXECUTORS)
    for a in (x, x.t(), x[::2, 1:], torch.randn(3, 4, 50)[:, 1]):
        torch.testing.assert_close(jfn(a), F.softmax(a * 2, -1))
    _check(lambda a: (a + 1).sum(-1), torch.randn(0, 5))
    _check(lambda a: ((a + 1).sum(-1), (a * 2).prod(-1)), torch.randn(4, 0))
    _check(lambda a: (a + 1).sum(0), torch.tensor([2.5]))


def test_parallel_rows_and_kernel_source():
    x = torch.randn(512, 768)
    jfn = _check(lambda a: F.layer_norm(a, (768,)) * 2, x, atol=1e-5, rtol=1e-5)
    (source,) = kernel_sources(fulmen.last_traces(jfn)[-1]).values()
    assert "#pragma omp simd reduction(+:" in source


def _norm_cases():
    n = 96
    w, b = torch.randn(n), torch.randn(n)
    target = torch.randint(0, n, (12,))
    return {
        "softmax": lambda x: F.softmax(x, -1),
        "log_softmax": lambda x: F.log_softmax(x * 2, -1),
        "layer_norm": lambda x: F.layer_norm(x, (n,), w, b),
        "rms_norm": lambda x: F.rms_norm(x, (n,), w, eps=1e-6),
        "cross_entropy": lambda x: F.cross_entropy(x * 2, target),  # fused with its producer
        "logsumexp": lambda x: torch.logsumexp(x, -1),
    }


@pytest.mark.parametrize("name", list(_norm_cases()))
def test_normalisations_forward_and_backward(name):
    fn = _norm_cases()[name]
    x0 = torch.randn(12, 96)
    x, xe = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    out, expected = jfn(x), fn(xe)
    torch.testing.assert_close(out, expected)
    cot = torch.randn_like(expected)
    (out * cot).sum().backward()
    (expected * cot).sum().backward()
    torch.testing.assert_close(x.grad, xe.grad)
    forward = _trace(jfn)
    backward = str(fulmen.last_backward_traces(jfn)[-1])
    if name == "layer_norm":  # eager's kernels on the CPU (NOTE [layer norm backward])
        assert "native_layer_norm_backward" in backward
        backward = ""
    assert "codegen.fusion" in forward and (not backward or "codegen.fusion" in backward)
    for trace in (forward, backward):  # every reduction is fused
        assert "torchex.sum" not in trace and "torchex.amax" not in trace


def test_layer_norm_is_one_kernel_per_direction():
    """With symbolic sizes: on the CPU, static sizes differentiate by eager's kernels (NOTE
    [layer norm backward])."""
    w, b = torch.randn(64), torch.randn(64)
    jfn = fulmen.jit(lambda a: F.layer_norm(a, (64,), w, b), executors=EXECUTORS, dynamic=True)
    for rows in (16, 9):
        x = torch.randn(rows, 64, requires_grad=True)
        jfn(x).sum().backward()
    assert _trace(jfn).count("codegen.fusion") == 1
    backward = str(fulmen.last_backward_traces(jfn)[-1])
    assert backward.count("codegen.fusion") == 1 and "torchex.sum" not in backward


def _rms_norm_keepdim(x, w):
    # as HF Llama writes it: float32 statistics kept as (..., 1), the weight in the input dtype
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return w * (x32 * torch.rsqrt(variance + 1e-6)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_keepdim_is_one_kernel_per_direction(dtype):
    # rsqrt(mean + eps) on the (..., 1) statistic is a row-level statement in keepdim form;
    # the backward of the keepdim view reshapes instead of summing over a size-1 axis
    w = torch.rand(64, dtype=dtype, requires_grad=True)
    x = torch.randn(2, 16, 64, dtype=dtype, requires_grad=True)
    cotangent = torch.randn(2, 16, 64, dtype=dtype)
    jfn = fulmen.jit(_rms_norm_keepdim, executors=EXECUTORS)
    actual, expected = jfn(x, w), _rms_norm_keepdim(x, w)
    torch.testing.assert_close(actual, expected)

    def reference():
        x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
        return torch.autograd.grad(_rms_norm_keepdim(x64, w64), (x64, w64), cotangent.double())

    assert_accurate(torch.autograd.grad(actual, (x, w), cotangent),
                    torch.autograd.grad(expected, (x, w), cotangent), reference)
    # in bfloat16 the weight's (64,) float32 conversion is a region of its own (a value of
    # the row's shape is not in the row schedule), and in the backward so is its gradient's
    regions = 1 if dtype == torch.float32 else 2
    assert _trace(jfn).count("codegen.fusion") == regions
    assert str(fulmen.last_backward_traces(jfn)[-1]).count("codegen.fusion") == regions + (
        dtype != torch.float32)
    # the statistic escaping the region is returned as a view of the row output
    stats = lambda a: (a.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()  # noqa: E731
    _check(lambda a: (stats(a), a * stats(a)), torch.randn(3, 5, 7))


def test_ops_on_a_broadcast_row_value_run_once_per_row():
    # log_softmax's log of the broadcast row sum, and an op reading a row value only through
    # one view, are row-level values (computed once per row, not once per element), unless
    # they leave the region: outputs are contiguous element-level tensors, as eager's
    fns = {"log_softmax": (lambda a: F.log_softmax(a, -1), "log", True),
           "inner": (lambda a: a.sum(-1, keepdim=True).expand(3, 7).exp() * a, "exp", True),
           "escaping": (lambda a: (a.sum(-1, keepdim=True).expand(3, 7).exp(), a * 3), "exp",
                        False)}
    for name, (fn, op, per_row) in fns.items():
        x = torch.randn(3, 7)
        jfn = _check(fn, x)
        (fused,) = [b for b in fulmen.last_traces(jfn)[-1].bsyms if "fusion" in b.sym.tags]
        kernel = fused.sym.impl.kernel
        ops = {value.name: row for value, row in zip(kernel.values, kernel.rows)
               if type(value).__name__ == "Op"}
        assert ops[op] == per_row, (name, ops)
        for actual, expected in zip(*(r if isinstance(r, tuple) else (r,)
                                      for r in (jfn(x), fn(x)))):
            assert actual.stride() == expected.stride(), name



def _scaled_softmax(x, w):
    m = x.amax(-1, keepdim=True)
    e = (x - m).exp()
    s = e.sum(-1, keepdim=True) * w + m * w
    return e / s, s


def _scaled_norm(x, w):
    d = x - x.mean(-1, keepdim=True) * w
    v = (d * d).mean(-1, keepdim=True)
    return d * (v * w + 1e-5).rsqrt(), v * w


@pytest.mark.parametrize("fn", [_scaled_softmax, _scaled_norm])
def test_row_values_of_a_statistic_and_a_per_row_input_build(fn):
    # a row-level op reading a row statistic and a per-row input (`w`, one value per row) is
    # computed after the reduction (the stage of its latest argument): the kernel builds
    # (a failed build is an error here, see pytestmark) and gives eager's values
    x, w = torch.randn(8, 32), torch.rand(8, 1) + 0.5
    _check(fn, x, w, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0")
def test_var_with_a_correction_past_the_row_length_is_eagers():
    """var/std divide by max(0, n - correction): a correction above the row length gives
    eager's inf (and NaN for a constant row), never a negative variance."""
    x = torch.randn(6, 2)
    x[0] = 1.5  # a constant row: 0 / 0
    _check(lambda a: ((a * 2).var(-1, correction=3), (a + 1).std(-1, correction=5)), x)


def test_column_sums():
    # sums over leading axes: per-thread float32 partials over 16 rows (5000 rows: a partial
    # group at each thread's end) added into float64 partials; float64 values straight in
    cases = [((5000, 300), lambda t: (t * 2).sum(0)), ((1001, 33), lambda t: (t.double() * 2).sum(0)), ((30, 20, 70), lambda t: (t * 2).sum((0, 1))),
             ((70, 300), lambda t: (t.t() - 1).sum(0)), ((300, 70), lambda t: (t * 2).half().sum(0)),
             ((64, 96), lambda t: ((t * 3).sum(0), F.softmax(t, -1), (t * t).sum(0)))]
    for shape, fn in cases:
        x = torch.randn(shape)
        jfn = fulmen.jit(fn, executors=EXECUTORS)
        actual, eager = jfn(x), fn(x)
        reference = fn(x.double())
        for a, e, r in zip(*(o if isinstance(o, tuple) else (o,) for o in (actual, eager, reference))):
            assert a.dtype == e.dtype and a.shape == e.shape
            assert (a.double() - r).abs().max() <= (e.double() - r).abs().max() + 1e-6
        assert "codegen.fusion" in _trace(jfn) and "torchex.sum" not in _trace(jfn)
    _check(lambda a: (a + 1).sum(0), torch.randn(0, 5))


REDUCTION_OPS = {"sum", "mean", "amax", "amin", "prod", "var", "std", "softmax", "log_softmax",
                 "nn.functional.softmin", "logsumexp", "nn.functional.layer_norm",
                 "nn.functional.rms_norm", "nn.functional.cross_entropy", "var_mean", "std_mean",
                 "nn.functional.normalize", "norm", "linalg.vector_norm", "nansum"}  # fmt: skip
REDUCTION_INFOS = [info for info in matched_opinfos() if info.name in REDUCTION_OPS
                   and not info.variant_test_name]


@pytest.mark.parametrize("info", REDUCTION_INFOS, ids=lambda info: info.name)
def test_opinfo_reductions_codegen(info):
    ran = 0
    for sample in samples(info, 4):
        kwargs = sample.kwargs

        def fn(input, *args, kwargs=kwargs):
            return info.op(input, *args, **kwargs)

        try:
            expected = fn(sample.input, *sample.args)
        except Exception:
            continue
        jfn = fulmen.jit(fn, executors=EXECUTORS)
        assert_same(expected, jfn(sample.input, *sample.args), info)
        ran += 1
    assert ran > 0


def test_last_kernels_lists_forward_and_backward_sources():
    x = torch.randn(8, 32, requires_grad=True)
    jfn = fulmen.jit(lambda a: F.softmax(a * 2, -1), executors=EXECUTORS)
    jfn(x).sum().backward()
    kernels = fulmen.last_kernels(jfn)
    assert len(kernels) == 2 and all("fulmen_kernel" in src for src in kernels.values())


def test_vectorised_exp_and_erf_match_eager():
    # float exp/erf are generated polynomials (libm's are scalar calls): check them over their
    # whole range, subnormal results, overflow and the special values.
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.72, 88.73,
                            -87.3, -103.5, -104.5, 3.9999, 4.0, 1.0, 0.99999994, 1e-45])
    x = torch.cat([torch.linspace(-110, 95, 200_001), torch.logspace(-40, 1, 2000), special])
    # gelu's 1 + erf(x) cancels for x << 0: 1 ulp of erf there is an absolute 3e-7 in eager too
    # eager's gelu(+-inf) is inf from its scalar loop and NaN from its AVX-512 vector loop (so
    # it depends on the machine and on where the element falls): compare gelu on finite values
    finite = x[x.isfinite() | x.isnan()]
    for fn, atol, inputs in ((torch.exp, 1e-30, x), (torch.erf, 1e-30, x), (F.gelu, 1e-6, finite)):
        jfn = fulmen.jit(fn, executors=EXECUTORS)
        torch.testing.assert_close(jfn(inputs), fn(inputs), rtol=1.3e-6, atol=atol,
                                   equal_nan=True)
        assert "codegen.fusion" in _trace(jfn)
    jfn = fulmen.jit(torch.erf, executors=EXECUTORS)
    torch.testing.assert_close(jfn(-x), torch.erf(-x), rtol=1.3e-6, atol=1e-30, equal_nan=True)


def _ulps(got: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|got - reference| in float32 ulps of the float64 reference (subnormal ulp at the bottom)."""
    exponent = torch.floor(torch.log2(reference.abs().clamp_min(2.0**-126)))
    return (got.double() - reference).abs() / torch.exp2(exponent - 23)


def test_exp_and_erf_ulp_bounds_against_float64():
    # the bounds the prelude's comments state (exp 0.94 ulp over the normal range, erf 2.6 ulp),
    # against the float64 functions on a dense grid
    x = torch.cat([torch.linspace(-87.0, 88.7, 1_000_001), torch.linspace(-1, 1, 100_001)])
    jfn = fulmen.jit(torch.exp, executors=EXECUTORS)
    assert _ulps(jfn(x), torch.exp(x.double())).max() < 1.0
    x = torch.cat([torch.linspace(-4.5, 4.5, 1_000_001), torch.logspace(-38, 0.7, 10_001)])
    x = torch.cat([x, -x])
    jfn = fulmen.jit(torch.erf, executors=EXECUTORS)
    assert _ulps(jfn(x), torch.erf(x.double())).max() < 2.7


@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax])
def test_softmax_exp_of_nonpositive_values_special_rows(fn):
    # exp(x - max(x)) uses f_exp_nonpos: subnormal and zero results, -inf, +inf and NaN rows
    inf, nan = float("inf"), float("nan")
    rows = [torch.linspace(-110, 0, 64), torch.linspace(-90, 5, 64), torch.full((64,), -inf),
            torch.full((64,), inf), torch.randn(64), torch.randn(64) * 40]
    rows[4][3], rows[5][7] = nan, inf
    x = torch.stack(rows + [torch.where(torch.arange(64) % 2 == 0, -inf, 1.0)])
    jfn = fulmen.jit(lambda a: fn(a, -1), executors=EXECUTORS)
    torch.testing.assert_close(jfn(x), fn(x, -1), rtol=1.3e-6, atol=1e-44, equal_nan=True)
    assert "f_exp_nonpos(" in "".join(fulmen.last_kernels(jfn).values())


def test_bool_masks_are_bytes_and_every_loop_vectorises():
    # GCC 12 vectorises no loop that loads a C++ bool or converts one to float ("no vectype"):
    # masks are stored as uint8_t and converted by a select. Causal attention ran scalar before.
    mask = torch.rand(16, 64) > 0.3
    x = torch.randn(16, 64, requires_grad=True)

    def fn(a, m):
        return F.softmax(torch.where(m, a, -float("inf")), -1) * m.float() + m.float()

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    out = jfn(x, mask)
    (grad,) = torch.autograd.grad((out * out).sum(), x)
    x2 = x.detach().requires_grad_()
    expected = fn(x2, mask)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, torch.autograd.grad((expected * expected).sum(), x2)[0])
    sources = list(fulmen.last_kernels(jfn).values())
    assert sources and not any("bool*" in src for src in sources)
    cxx = compiler()
    if cxx is None or platform.machine() not in ("x86_64", "AMD64"):
        return
    for src in sources:  # the compiler's own report: nothing in a simd loop it cannot vectorise
        result = subprocess.run([cxx, *CXX_FLAGS, "-fopt-info-vec-missed", "-S", "-x", "c++",
                                 "-", "-o", os.devnull], input=src, capture_output=True, text=True)
        body = _simd_loop_lines(src)
        assert not [line for line in result.stderr.splitlines()
                    if "no vectype" in line and int(line.split(":")[1]) in body]


def _simd_loop_lines(src: str) -> set[int]:
    """1-based numbers of the lines inside `#pragma omp simd` loops of a generated kernel."""
    lines, inside = src.splitlines(), set()
    for i, line in enumerate(lines):
        if line.strip().startswith("#pragma omp simd"):
            indent = len(lines[i + 1]) - len(lines[i + 1].lstrip())
            k = i + 2
            while lines[k].strip() != "}" or len(lines[k]) - len(lines[k].lstrip()) != indent:
                inside.add(k + 1)
                k += 1
    return inside


def test_only_compute_bound_row_passes_prefetch_the_next_row():
    x, w = torch.randn(8, 64), torch.randn(64)
    softmax = fulmen.jit(lambda a: F.softmax(a, -1), executors=EXECUTORS)
    layer_norm = fulmen.jit(lambda a: F.layer_norm(a, (64,), w, w), executors=EXECUTORS)
    torch.testing.assert_close(softmax(x), F.softmax(x, -1))
    torch.testing.assert_close(layer_norm(x), F.layer_norm(x, (64,), w, w))
    assert "__builtin_prefetch" in "".join(fulmen.last_kernels(softmax).values())
    assert "__builtin_prefetch" not in "".join(fulmen.last_kernels(layer_norm).values())


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward_fuses_with_the_recomputed_gelu(approximate):
    def fn(x, w):
        return torch.nn.functional.gelu(x * w, approximate=approximate).sum(-1)

    x = torch.randn(64, 96, dtype=torch.float64, requires_grad=True)
    w = torch.randn(96, dtype=torch.float64, requires_grad=True)
    jfn = fulmen.jit(fn)
    grads = torch.autograd.grad(jfn(x, w).sum(), (x, w))
    torch.testing.assert_close(grads, torch.autograd.grad(fn(x, w).sum(), (x, w)))
    backward = fulmen.last_backward_traces(jfn)[-1]
    fused = [sub.sym.name for b in backward.bsyms if "fusion" in b.sym.name
             for sub in b.subsymbols]
    assert ("erf" if approximate == "none" else "tanh") in fused  # gelu_backward's prims
    assert "torchex" not in str(backward)  # nothing left to the torch executor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_silu_backward_fuses_with_the_recomputed_silu(dtype):
    """A SwiGLU MLP's backward: `silu_backward`'s prims join the kernel recomputing the gate
    (was eager's kernel on the torch executor, one more pass over the gate's gradient)."""
    def fn(x, wg, wu):
        return torch.nn.functional.silu(x @ wg) * (x @ wu)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(shape, generator=g).to(dtype).requires_grad_()
            for shape in ((16, 24), (24, 40), (24, 40))]
    ref = [a.detach().clone().requires_grad_() for a in args]
    jfn = fulmen.jit(fn)
    cotangent = torch.randn(16, 40, generator=g).to(dtype)
    grads = torch.autograd.grad(jfn(*args), args, cotangent)
    torch.testing.assert_close(grads, torch.autograd.grad(fn(*ref), ref, cotangent))
    backward = fulmen.last_backward_traces(jfn)[-1]
    fused = [sub.sym.name for b in backward.bsyms if "fusion" in b.sym.name
             for sub in b.subsymbols]
    assert "reciprocal" in fused and "silu_backward" not in str(backward)


def test_swiglu_backward_kernel_computes_one_exp():
    """The SwiGLU backward kernel recomputes the gate's `silu` (for the down projection's weight
    gradient) next to `silu_backward`: both spell the sigmoid's `1 + exp(-x)` alike and the
    lowering computes each value once (NOTE [values numbered once]), so the kernel calls exp
    once per element (was twice: silu_backward's plain exp differed from silu's saturating one;
    litgpt-llama tiny: 31 -> 23 µs per gate-backward kernel, process time). Odd sizes, a transposed gate."""
    def fn(x, wg, wu, wd):
        return (torch.nn.functional.silu(x @ wg) * (x @ wu)) @ wd

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(shape, generator=g).requires_grad_()
            for shape in ((37, 24), (40, 24), (24, 40), (40, 7))]
    args[1] = args[1].detach().t().requires_grad_()  # non-contiguous gate weight
    ref = [a.detach().clone().requires_grad_() for a in args]
    jfn = fulmen.jit(fn)
    cotangent = torch.randn(37, 7, generator=g)
    grads = torch.autograd.grad(jfn(*args), args, cotangent)
    torch.testing.assert_close(grads, torch.autograd.grad(fn(*ref), ref, cotangent))
    backward = fulmen.last_backward_traces(jfn)[-1]
    bodies = [source.split('extern "C"')[-1] for source in kernel_sources(backward).values()]
    exps = [body.count("f_exp(") for body in bodies if "f_exp(" in body]
    assert exps == [1]  # the gate's backward kernel (one layout), one exp


def test_conversions_of_one_value_to_two_dtypes_stay_apart():
    """NOTE [values numbered once] keys an op by its result dtype too: `x.half()` and
    `x.double()` are one conversion op of the same operand, and the float64 output must not
    take the float16 rounding (nor the half constant the double's)."""
    def fn(x):
        return x.half() * 0.1, x.double() * 0.1, x.to(torch.int32) + 300, x.to(torch.int16) + 300

    x = torch.randn(33, 65, generator=torch.Generator().manual_seed(0)) * 100 + 0.3
    jfn = _check(fn, x[:, ::2])  # odd sizes, a strided input
    assert len(kernel_sources(fulmen.last_traces(jfn)[-1])) == 1  # one region: all four


def test_silu_backward_decomposition_matches_eager_at_special_values():
    """`aten.silu_backward` decomposed to prims (run by the torch executor and by codegen)
    against eager's kernel, at infinities, NaN, large magnitudes, zeros."""
    from fulmen.transforms import decompose_to_prims

    x = torch.tensor([[float("inf"), float("-inf"), float("nan"), -100.0, 100.0, -0.0, 0.0,
                       -20.0, 20.0, 1.5, -1.5, 3e-39]] * 3)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    grad[0, :4] = float("inf")

    def fn(g, x):
        return torch.ops.aten.silu_backward.default(g, x)

    expected = fn(grad, x)
    for executors in (["torch"], ["codegen", "torch"]):
        jfn = fulmen.jit(fn, executors=executors, transforms=[decompose_to_prims])
        torch.testing.assert_close(jfn(grad, x), expected, equal_nan=True, rtol=1e-6,
                                   atol=1e-30)
