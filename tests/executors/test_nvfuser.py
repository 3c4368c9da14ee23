"""The nvFuser executor's translation, checked against a recording stand-in of the
`FusionDefinition` API: for every prim it claims, the calls made and their arguments. Runs
without nvFuser (and without a GPU); real nvFuser execution is tested only where nvFuser is
installed (`cuda` marker).
"""

import pytest
import torch

import fulmen
from fulmen.core import TraceCtx, tracing
from fulmen.executors.nvfuser import CLAIMED, NvFuserExecutor, nvfuser_available
from fulmen.executors.nvfuser.translate import canonical_form, claimable, translate
from fulmen.ops import prims
from fulmen.proxies import TensorProxy


class StandInFD:
    """Records every FusionDefinition call as (name, args, kwargs); values are ("T", i)."""

    def __init__(self):
        self.calls = []
        self.ops = self._Ops(self)

    class _Ops:
        def __init__(self, fd):
            self._fd = fd

        def __getattr__(self, name):
            return lambda *args, **kwargs: self._fd._record(f"ops.{name}", args, kwargs)

    def _record(self, name, args, kwargs):
        value = ("T", len(self.calls))
        self.calls.append((name, args, kwargs))
        return value

    def define_tensor(self, **kwargs):
        return self._record("define_tensor", (), kwargs)

    def define_scalar(self, value, dtype=None):
        return self._record("define_scalar", (value,), {"dtype": dtype})

    def add_output(self, value):
        self.calls.append(("add_output", (value,), {}))


class DataType:
    Float, Half, BFloat16, Double, Int32, Int, Bool = (
        "Float", "Half", "BFloat16", "Double", "Int32", "Int", "Bool")


DTYPES = {torch.float32: DataType.Float, torch.float16: DataType.Half,
          torch.bfloat16: DataType.BFloat16, torch.float64: DataType.Double,
          torch.int32: DataType.Int32, torch.int64: DataType.Int, torch.bool: DataType.Bool}


def _proxy(name, shape, dtype=torch.float32):
    return TensorProxy(name, shape, dtype, "cuda")


def record(build, *inputs):
    """Trace `build(*inputs)` (prim calls) and translate it; returns the stand-in's calls
    after the input definitions, and the region."""
    ctx = TraceCtx("region")
    with tracing(ctx):
        out = build(*inputs)
    region = list(ctx.bsyms)
    assert all(claimable(b) for b in region), [b.sym.name for b in region]
    fd = StandInFD()
    translate(fd, region, list(inputs), [out], DTYPES)
    return fd.calls[len(inputs):], region


UNARY_FLOAT = ["neg", "abs", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt",
               "rsqrt", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh",
               "asinh", "acosh", "atanh", "erf", "erfc", "reciprocal", "floor", "ceil", "round",
               "trunc", "sign", "signbit", "isnan", "isinf", "isfinite", "logical_not"]
BINARY_FLOAT = ["add", "sub", "mul", "div", "remainder", "fmod", "pow", "atan2", "maximum",
                "minimum", "eq", "ne", "lt", "le", "gt", "ge"]
BITWISE = ["bitwise_and", "bitwise_or", "bitwise_xor"]


@pytest.mark.parametrize("name", UNARY_FLOAT)
def test_nvfuser_unary(name):
    a = _proxy("a", (4, 5))
    calls, region = record(lambda x: getattr(prims, name)(x), a)
    assert calls == [(f"ops.{name}", (("T", 0),), {}), ("add_output", (("T", 1),), {})]


@pytest.mark.parametrize("name", BINARY_FLOAT + BITWISE)
def test_nvfuser_binary_with_tensor_and_scalar(name):
    dtype = torch.int64 if name in BITWISE else torch.float32
    a, b = _proxy("a", (4, 5), dtype), _proxy("b", (4, 5), dtype)
    scalar = 3 if name in BITWISE else 2.5
    calls, _ = record(lambda x, y: getattr(prims, name)(getattr(prims, name)(x, y), scalar), a, b)
    scalar_dtype = DataType.Int if name in BITWISE else DataType.Double
    assert calls == [
        (f"ops.{name}", (("T", 0), ("T", 1)), {}),
        ("define_scalar", (scalar,), {"dtype": scalar_dtype}),
        (f"ops.{name}", (("T", 2), ("T", 3)), {}),
        ("add_output", (("T", 4),), {}),
    ]


def test_nvfuser_bitwise_not_and_where():
    a = _proxy("a", (3,), torch.int32)
    calls, _ = record(lambda x: prims.bitwise_not(x), a)
    assert calls[0] == ("ops.bitwise_not", (("T", 0),), {})
    p, x = _proxy("p", (3,), torch.bool), _proxy("x", (3,))
    calls, _ = record(lambda c, v: prims.where(c, v, 1.0), p, x)
    assert calls[:2] == [("define_scalar", (1.0,), {"dtype": DataType.Double}),
                         ("ops.where", (("T", 0), ("T", 1), ("T", 2)), {})]


@pytest.mark.parametrize("prim,op", [("sum", "sum"), ("prod", "prod"), ("amax", "max"),
                                     ("amin", "min")])
def test_nvfuser_reductions(prim, op):
    a = _proxy("a", (4, 5, 6))
    calls, _ = record(lambda x: getattr(prims, prim)(x, (0, 2)), a)
    assert calls[0] == (f"ops.{op}", (("T", 0),),
                        {"dims": [0, 2], "keepdim": False, "dtype": DataType.Float})


def test_nvfuser_var_and_convert():
    a = _proxy("a", (4, 5), torch.float16)
    calls, _ = record(lambda x: prims.var(prims.convert_element_type(x, torch.float32), (1,), 1),
                      a)
    assert calls[:2] == [
        ("ops.cast", (("T", 0),), {"dtype": DataType.Float}),
        ("ops.var", (("T", 1),), {"dims": [1], "correction": 1, "keepdim": False}),
    ]


def test_nvfuser_views():
    a = _proxy("a", (4, 1, 6))
    calls, _ = record(lambda x: prims.slice_prim(prims.reshape(prims.permute(
        prims.broadcast_in_dim(prims.squeeze(x, (1,)), (3, 4, 6), (1, 2)), (2, 0, 1)),
        (6, 12)), (0, 1), (6, 12), (2, 3)), a)
    assert calls == [
        ("ops.squeeze", (("T", 0),), {"dims": [1]}),
        ("ops.broadcast_in_dim", (("T", 1),), {"shape": [3, 4, 6], "broadcast_dims": [1, 2]}),
        ("ops.permute", (("T", 2),), {"dims": [2, 0, 1]}),
        ("ops.reshape", (("T", 3),), {"new_shape": [6, 12]}),
        ("ops.slice", (("T", 4),), {"start_indices": [0, 1], "end_indices": [6, 12],
                                    "strides": [2, 3]}),
        ("add_output", (("T", 5),), {}),
    ]


def test_nvfuser_input_definitions():
    a, b = _proxy("a", (4, 1, 6), torch.bfloat16), _proxy("b", (6,), torch.bfloat16)
    ctx = TraceCtx("region")
    with tracing(ctx):
        out = prims.mul(a, prims.broadcast_in_dim(b, (4, 1, 6), (2,)))
    fd = StandInFD()
    translate(fd, list(ctx.bsyms), [a, b], [out], DTYPES)
    assert fd.calls[:2] == [
        ("define_tensor", (), {"shape": [-1, 1, -1], "contiguity": [True, None, True],
                               "dtype": DataType.BFloat16}),
        ("define_tensor", (), {"shape": [-1], "contiguity": [True], "dtype": DataType.BFloat16}),
    ]


def test_nvfuser_every_claimed_prim_is_tested():
    tested = set(UNARY_FLOAT + BINARY_FLOAT + BITWISE) | {
        "bitwise_not", "where", "sum", "prod", "amax", "amin", "var", "convert_element_type",
        "squeeze", "broadcast_in_dim", "permute", "reshape", "slice"}
    assert set(CLAIMED) == tested


def test_nvfuser_claims_only_cuda_and_supported_dtypes():
    ctx = TraceCtx("region")
    with tracing(ctx):
        prims.exp(TensorProxy("c", (3,), torch.float32, "cpu"))
        prims.neg(_proxy("u", (3,), torch.uint8))
        prims.exp(_proxy("g", (3,)))
    assert [claimable(b) for b in ctx.bsyms] == [False, False, True]


def test_nvfuser_canonical_form_shares_identical_regions():
    def region(name):
        a = _proxy(f"{name}_a", (8, 16))
        ctx = TraceCtx(name)
        with tracing(ctx):
            out = prims.mul(prims.exp(a), 2.0)
        return list(ctx.bsyms), [a], [out]

    first, second = region("one"), region("two")
    assert canonical_form(*first) == canonical_form(*second)
    a = _proxy("z", (8, 16))
    ctx = TraceCtx("three")
    with tracing(ctx):
        out = prims.mul(prims.exp(a), 3.0)
    assert canonical_form(list(ctx.bsyms), [a], [out]) != canonical_form(*first)


def test_nvfuser_executor_fuses_cuda_regions_without_nvfuser():
    """Fusion works on "cuda" proxies without nvFuser or a GPU; only running needs them."""
    from fulmen.executors.claim import claim_executors
    from fulmen.tracer import trace_program
    from fulmen.transforms import dce

    ex = NvFuserExecutor("nvfuser_test")
    x, w = _proxy("x", (8, 16)), _proxy("w", (16,))
    program = trace_program(lambda a, b: (torch.nn.functional.gelu(a * b).sum(1), a.t()),
                            (x, w), {})
    trace = claim_executors(dce(program.trace), [ex, fulmen.executors.get_executor("torch")])
    text = str(trace)
    assert "nvfuser_test.fusion" in text and "torch.t(a)" in text  # the view stays a view
    fusions = [b for b in trace.bsyms if "fusion" in b.sym.tags]
    assert len(fusions) == 1
    assert [b.sym.name for b in fusions[0].subsymbols] == [
        "broadcast_in_dim", "mul", "mul", "erf", "mul", "add", "mul", "sum"]


def test_nvfuser_registered_only_when_installed():
    from fulmen.executors.registry import _REGISTRY

    assert ("nvfuser" in _REGISTRY) == nvfuser_available()


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and nvfuser_available()),
                    reason="needs a CUDA GPU and nvFuser")
def test_nvfuser_execution_matches_eager():
    x, w = torch.randn(64, 128, device="cuda"), torch.randn(128, device="cuda")

    def fn(a, b):
        return torch.nn.functional.gelu(a * b).sum(1), torch.softmax(a, -1)

    jfn = fulmen.jit(fn, executors=["nvfuser", "torch"])
    for actual, expected in zip(jfn(x, w), fn(x, w)):
        torch.testing.assert_close(actual, expected)
    assert "nvfuser.fusion" in str(fulmen.last_traces(jfn)[-1])
