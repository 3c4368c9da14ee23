"""The codegen executor against eager: OpInfo samples of the fusible elementwise ops, dtypes,
layouts (broadcast, transposed, sliced, flipped, 0-d, zero-size) and NaN/Inf propagation.

Kernels compile into a per-session temporary FULMEN_CACHE_DIR. `FULMEN_CODEGEN_SAMPLES`
(default 1) sets the OpInfo samples per op: each new kernel costs a C++ compile.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo

import fulmen
from fulmen.executors.codegen import kernel_sources
from tests.ops.opinfo_harness import assert_same, matched_opinfos, samples

# a kernel that fails to build warns and runs the torch fallback (eager's values): here that is
# an error, so a miscompiled kernel source cannot hide behind the fallback
pytestmark = [pytest.mark.usefixtures("codegen_eager"), pytest.mark.filterwarnings(
    "error:fulmen codegen.*runs on the torch executor:RuntimeWarning")]

EXECUTORS = ["codegen", "torch"]
# Elementwise OpInfos whose decomposition codegen does not fuse (yet), with the reason.
NOT_FUSED = {
    "bitwise_left_shift": "shifts past the bit width are UB in C++",
    "bitwise_right_shift": "shifts past the bit width are UB in C++",
    "positive": "an identity: no computation",
    "float": "an identity on float32 samples",
    "cdouble": "complex", "cfloat": "complex", "nn.functional.silu.complex": "complex",
    "digamma": "no libm equivalent", "lgamma": "lgamma is not thread-safe",
    "erfinv": "no libm equivalent",
    "round.decimals_3": "decimals use a decomposition with a reduction-free scale (todo)",
    "round.decimals_neg_3": "see round.decimals_3",
}  # fmt: skip
EXTRA = {"where", "clamp", "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu",
         "lerp", "addcmul", "addcdiv", "sigmoid", "nan_to_num"}  # fmt: skip


def _ids(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


ELEMENTWISE = [info for info in matched_opinfos()
               if isinstance(info, (UnaryUfuncInfo, BinaryUfuncInfo)) or info.name in EXTRA]


def _fused(jfn) -> bool:
    return "codegen.fusion" in str(fulmen.last_traces(jfn)[-1])


@pytest.mark.parametrize("info", ELEMENTWISE, ids=_ids)
def test_opinfo_codegen(info):
    limit = int(os.environ.get("FULMEN_CODEGEN_SAMPLES", "1"))
    ran = fused = 0
    for sample in samples(info, None):
        if ran >= limit:
            break
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
        fused += _fused(jfn)
    assert ran > 0
    if _ids(info) not in NOT_FUSED:
        assert fused == ran, f"{_ids(info)}: not fused"


def _check(fn, *args, exact=True):
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    actual, expected = jfn(*args), fn(*args)
    if exact:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(actual, expected, equal_nan=True)
    assert _fused(jfn)
    return jfn


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_float_dtypes_and_special_values(dtype):
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -2.5])
    x = torch.cat([special, torch.randn(200)]).to(dtype)
    y = torch.cat([special.flip(0), torch.randn(200)]).to(dtype)
    _check(lambda a, b: torch.maximum(a * b + 1, a - b), x, y)
    _check(lambda a, b: torch.where(a > b, a.exp(), torch.tanh(b)) / 3, x, y, exact=False)
    _check(lambda a: (a.isnan(), a.isinf(), a.signbit(), a.abs().floor()), x)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool])
def test_int_and_bool_dtypes(dtype):
    x = torch.randint(-100, 100, (300,)).to(dtype)
    y = torch.randint(-100, 100, (300,)).to(dtype)
    if dtype == torch.bool:
        _check(lambda a, b: (a & b) | ~a, x, y)
        # minimum and maximum of bools are `and` and `or`; `^` is exclusive
        _check(lambda a, b: (torch.minimum(a, b) | ~b, torch.maximum(a, ~b) ^ b), x, y)
    else:
        _check(lambda a, b: (torch.maximum(a * b, a + 3) & 0x5F, a < b, a.float() / 7,
                             (a ^ b) + 1), x, y)


def test_negative_and_wrapping_int_scalars():
    """A Python int operand takes the tensor's dtype as eager's kernels see it: -3 stays -3,
    and 200 wraps to -56 in int8 (every bit of the width kept, the top one the sign)."""
    x = torch.randint(-100, 100, (300,)).to(torch.int8)
    y = torch.randint(-100, 100, (300,)).to(torch.int8)
    _check(lambda a, b: (torch.maximum(a * b, a + -3) & 0x5F, (a ^ b) - 200), x, y)


def test_layouts_without_copies():
    x = torch.randn(64, 48)
    b = torch.randn(48)
    _check(lambda a, c: a + c, x, b)  # broadcast row
    _check(lambda a: a.t() * 2 + a.t().exp(), x, exact=False)  # transposed
    _check(lambda a: a[::2, 3:40:3].sin(), x, exact=False)  # sliced
    _check(lambda a, c: a.flip(1) - c, x, b)  # negative strides
    _check(lambda a, c: (a.t() + c[:, None]).relu(), x, torch.randn(48))
    _check(lambda a, c: a.unsqueeze(0).expand(3, 64, 48) * c, x, torch.randn(3, 1, 1))
    # non-contiguous *inputs* (strides are kernel arguments, not guards of the source)
    jfn = fulmen.jit(lambda a: a * 2 + 1, executors=EXECUTORS)
    for a in (x, x.t(), x[:, ::2], x.t()[::3]):
        torch.testing.assert_close(jfn(a), a * 2 + 1, rtol=0, atol=0)


def test_zero_dim_and_zero_size():
    _check(lambda a, c: a * c + 1, torch.tensor(2.5), torch.tensor(-1.0))
    _check(lambda a, c: a * c + 1, torch.randn(3, 4), torch.tensor(-1.0))
    _check(lambda a: (a.exp() + 1, a > 0), torch.randn(0, 4))


def test_large_parallel_and_multiple_outputs():
    x, y = torch.randn(300, 1000), torch.randn(1000)
    jfn = _check(lambda a, c: (F.gelu(a * c), torch.sigmoid(a) - c), x, y, exact=False)
    sources = kernel_sources(fulmen.last_traces(jfn)[-1])
    assert len(sources) == 1
    assert "#pragma omp simd" in next(iter(sources.values()))


def test_escaping_view_keeps_aliasing():
    x = torch.randn(4, 5)

    def fn(a):
        t = a.t()
        return t, t + 1

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    view, out = jfn(x)
    torch.testing.assert_close(out, x.t() + 1)
    assert view.data_ptr() == x.data_ptr() and view.shape == (5, 4)


def test_higher_priority_operator_executor_keeps_its_ops():
    myex = fulmen.extend.OperatorExecutor("myex_codegen_test")
    myex.register_implementation(torch.exp, fn=lambda a: torch.exp(a))
    jfn = fulmen.jit(lambda a: (a + 1).exp() * 2, executors=[myex, "codegen", "torch"])
    x = torch.randn(8)
    torch.testing.assert_close(jfn(x), (x + 1).exp() * 2)
    source = str(fulmen.last_traces(jfn)[-1])
    assert "myex_codegen_test.exp" in source and source.count("codegen.fusion") == 2
