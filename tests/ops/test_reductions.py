"""Reduction ops beyond OpInfo: method and keyword spellings, dtype arguments and accumulation
dtypes, the three forms of max/min, var/std overloads, empty and 0-d inputs, fallbacks to the
exact torch op, and printed decompositions.

Each case runs eagerly and through `fulmen.jit` twice: the op run whole by the torch executor,
and decomposed into prims.
"""

import math

import pytest
import torch

import fulmen
from fulmen.transforms import decompose_to_prims

MODES = {"whole": {}, "decomposed": {"transforms": [decompose_to_prims]}}


def check(fn, *args, mode="decomposed", exact=False):
    """Run `fn` eagerly and jitted; assert same structure, dtypes and values; return the jitted
    function."""
    expected = fn(*args)
    jfn = fulmen.jit(fn, **MODES[mode])
    actual = jfn(*args)
    assert type(actual) is type(expected)
    flat_e, spec_e = torch.utils._pytree.tree_flatten(expected)
    flat_a, spec_a = torch.utils._pytree.tree_flatten(actual)
    assert spec_e == spec_a
    for e, a in zip(flat_e, flat_a):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        if exact:
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
        elif e.dtype in (torch.float16, torch.bfloat16):
            # fulmen computes half reductions in float32; eager's half kernels round more often
            torch.testing.assert_close(a, e, rtol=1e-2, atol=1e-2, equal_nan=True)
        else:
            torch.testing.assert_close(a, e, equal_nan=True)
    return jfn


def ops_of(jfn, stage=0) -> list[str]:
    """Qualified names of the top-level symbols of a trace (the traced one by default)."""
    return [bsym.sym.id for bsym in fulmen.last_traces(jfn)[stage].bsyms]


def prims_of(jfn) -> list[str]:
    """Qualified names of every prim the traced program decomposes into."""
    names = []

    def walk(bsym):
        if bsym.sym.is_prim:
            names.append(bsym.sym.id)
        for sub in bsym.subsymbols:
            walk(sub)

    for bsym in fulmen.last_traces(jfn)[0].bsyms:
        walk(bsym)
    return names


torch.manual_seed(0)  # the sample tensors below are built at import
x234 = torch.randn(2, 3, 4)
i234 = torch.randint(-5, 5, (2, 3, 4), dtype=torch.int32)
b234 = torch.rand(2, 3, 4) > 0.5
u8 = torch.tensor([[0, 3], [1, 2]], dtype=torch.uint8)
h234 = torch.randn(2, 3, 4, dtype=torch.float16)
bf234 = torch.randn(2, 3, 4, dtype=torch.bfloat16)
c23 = torch.randn(2, 3, dtype=torch.complex64)
scalar = torch.tensor(2.5)
empty = torch.randn(0, 3)
nan_inf = torch.tensor(
    [
        [1.0, float("nan"), 3.0],
        [-float("inf"), -float("inf"), -float("inf")],
        [float("inf"), 1.0, 2.0],
    ]
)

CASES = {
    # sum
    "sum all": (lambda x: x.sum(), x234),
    "sum dim": (lambda x: torch.sum(x, 1), x234),
    "sum dims keepdim": (lambda x: x.sum((0, -1), keepdim=True), x234),
    "sum dim list kw": (lambda x: torch.sum(x, dim=[2, 0]), x234),
    "sum empty dims reduce all": (lambda x: x.sum(dim=()), x234),
    "sum None keepdim": (lambda x: torch.sum(x, None, True), x234),
    "sum int32 -> int64": (lambda x: x.sum(1), i234),
    "sum bool -> int64": (lambda x: x.sum(), b234),
    "sum dtype kw": (lambda x: x.sum(1, dtype=torch.float64), x234),
    "sum int dtype int32": (lambda x: x.sum(0, dtype=torch.int32), i234),
    "sum half": (lambda x: x.sum(-1), h234),
    "sum bfloat16": (lambda x: x.sum((0, 1)), bf234),
    "sum complex": (lambda x: x.sum(0), c23),
    "sum 0-d dim": (lambda x: x.sum(0), scalar),
    "sum 0-d keepdim": (lambda x: x.sum(-1, keepdim=True), scalar),
    "sum empty": (lambda x: x.sum(0), empty),
    # mean
    "mean all": (lambda x: x.mean(), x234),
    "mean dims": (lambda x: torch.mean(x, (0, 2), True), x234),
    "mean int with dtype": (lambda x: x.mean(1, dtype=torch.float32), i234),
    "mean half": (lambda x: x.mean(1), h234),
    "mean complex": (lambda x: x.mean(), c23),
    "mean empty -> nan": (lambda x: x.mean(0), empty),
    # prod
    "prod all": (lambda x: x.prod(), x234),
    "prod dim keepdim": (lambda x: torch.prod(x, -1, keepdim=True), x234),
    "prod int32 -> int64": (lambda x: x.prod(2), i234),
    "prod bool": (lambda x: x.prod(0), b234),
    "prod dtype": (lambda x: x.prod(1, dtype=torch.float64), x234),
    # amax / amin
    "amax default": (lambda x: x.amax(), x234),
    "amax dims": (lambda x: torch.amax(x, (0, 2), keepdim=True), x234),
    "amin dim": (lambda x: torch.amin(x, -1), i234),
    "amax bool": (lambda x: x.amax(1), b234),
    "amax nan": (lambda x: x.amax(1), nan_inf),
    # max / min
    "max full": (lambda x: x.max(), x234),
    "max dim": (lambda x: torch.max(x, 1), x234),
    "max dim keepdim kw": (lambda x: x.max(dim=-1, keepdim=True), x234),
    "min dim": (lambda x: torch.min(x, 0), x234),
    "min full int": (lambda x: x.min(), i234),
    "max dim bool": (lambda x: x.max(0), b234),
    "max dim nan": (lambda x: x.max(1), nan_inf),
    "max 0-d dim": (lambda x: x.max(0), scalar),
    "max binary": (lambda x, y: torch.max(x, y), x234, torch.randn(3, 4)),
    "max binary promotes": (lambda x, y: torch.max(x, y), i234, x234),
    "min binary method": (lambda x, y: x.min(y), x234, torch.randn(4)),
    "max values attr": (lambda x: x.max(1).values + x.max(1).indices, x234),
    # argmax / argmin
    "argmax flat": (lambda x: x.argmax(), x234),
    "argmax flat keepdim": (lambda x: torch.argmax(x, keepdim=True), x234),
    "argmax dim": (lambda x: torch.argmax(x, 1), x234),
    "argmin dim keepdim": (lambda x: x.argmin(-1, keepdim=True), i234),
    "argmax 0-d": (lambda x: x.argmax(), scalar),
    "argmax nan": (lambda x: x.argmax(1), nan_inf),
    # var / std
    "var all": (lambda x: x.var(), x234),
    "var unbiased positional": (lambda x: torch.var(x, False), x234),
    "var dim unbiased keepdim": (lambda x: torch.var(x, 1, False, True), x234),
    "var correction": (lambda x: x.var(dim=(0, 2), correction=2, keepdim=True), x234),
    "var float correction": (lambda x: x.var(-1, correction=0.5), x234),
    "var half": (lambda x: x.var(1), h234),
    "var complex": (lambda x: x.var(1), c23),
    "std dims": (lambda x: torch.std(x, [0, 1]), x234),
    "std unbiased false": (lambda x: x.std(unbiased=False), x234),
    "var_mean": (lambda x: torch.var_mean(x, 1), x234),
    "var_mean keepdim correction": (
        lambda x: torch.var_mean(x, (0, 2), correction=0, keepdim=True),
        x234,
    ),
    "std_mean": (lambda x: torch.std_mean(x, dim=-1, unbiased=False), x234),
    "std_mean complex": (lambda x: torch.std_mean(x), c23),
    # all / any
    "all": (lambda x: x.all(), b234),
    "any dim": (lambda x: torch.any(x, 1), x234),
    "all dims keepdim": (lambda x: torch.all(x, (0, 2), keepdim=True), i234),
    "all empty dims reduce none": (lambda x: torch.all(x, ()), x234),
    "any uint8": (lambda x: x.any(0), u8),
    "all uint8 full": (lambda x: x.all(), u8),
    "any nan is true": (lambda x: x.any(1), nan_inf),
    "all empty": (lambda x: torch.all(x, 0), empty),
    "any empty": (lambda x: torch.any(x), empty),
    "all complex": (lambda x: x.all(1), c23),
    # logsumexp
    "logsumexp": (lambda x: torch.logsumexp(x, 1), x234),
    "logsumexp dims keepdim": (lambda x: x.logsumexp((0, 2), keepdim=True), x234),
    "logsumexp inf and nan": (lambda x: x.logsumexp(1), nan_inf),
    "logsumexp int": (lambda x: torch.logsumexp(x, -1), i234),
    "logsumexp half": (lambda x: x.logsumexp(0), h234),
    "logsumexp large": (lambda x: torch.logsumexp(x * 1e4, 1), x234),
    "logsumexp empty": (lambda x: torch.logsumexp(x, 0), empty),
    "special.logsumexp": (lambda x: torch.special.logsumexp(x, 2), x234),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_eager(case, mode):
    fn, *args = CASES[case]
    jfn = check(fn, *args, mode=mode)
    assert not any(op.startswith("opaque") for op in ops_of(jfn)), ops_of(jfn)


def test_max_with_dim_returns_named_tuple():
    jfn = check(lambda x: torch.max(x, 1), x234)
    out = jfn(x234)
    assert isinstance(out, torch.return_types.max)
    assert torch.equal(out.indices, x234.argmax(1))
    assert isinstance(fulmen.jit(lambda x: x.min(0))(x234), torch.return_types.min)
    assert prims_of(jfn) == ["prims.amax", "prims.argmax"]


def test_sum_accumulates_integers_in_int64():
    jfn = check(lambda x: x.sum(), torch.full((3,), 2**31 - 1, dtype=torch.int32), exact=True)
    assert prims_of(jfn) == ["prims.convert_element_type", "prims.sum"]


def test_half_reductions_compute_in_float32():
    jfn = check(lambda x: x.sum(1), h234)
    trace = str(fulmen.last_traces(jfn)[0])
    assert "prims.convert_element_type(x, torch.float32)" in trace
    assert "torch.float16)" in trace
    assert fulmen.jit(lambda x: x.mean())(h234).dtype == torch.float16


def test_printed_decomposition():
    jfn = fulmen.jit(lambda x: x.sum(1, keepdim=True))
    jfn(x234)
    assert "\n".join(str(fulmen.last_traces(jfn)[0]).splitlines()[-4:]) == (
        '  t1 = ltorch.sum(x, 1, keepdim=True)  # t1: "cpu f32[2, 1, 4]"\n'
        "    # t0 = prims.sum(x, (1,))\n"
        "    # t1 = prims.broadcast_in_dim(t0, (2, 1, 4), (0, 2))\n"
        "  return t1"
    )


def test_logsumexp_is_stable():
    x = torch.tensor([[1000.0, 1000.0], [-1000.0, -1000.0]])
    out = fulmen.jit(lambda x: torch.logsumexp(x, 1), transforms=[decompose_to_prims])(x)
    torch.testing.assert_close(out, torch.tensor([1000.0 + math.log(2), -1000.0 + math.log(2)]))


@pytest.mark.parametrize(
    "fn, args",
    [
        (lambda x: torch.mean(x), (i234,)),  # eager: mean needs a floating dtype
        (lambda x: torch.sum(x, (0, 0)), (x234,)),  # eager: repeated dim
        (lambda x: torch.amax(x, 0), (empty,)),  # eager: cannot reduce an empty dim
        (lambda x: torch.argmax(x), (b234,)),  # eager: no bool argmax
        (lambda x: torch.var(x), (i234,)),  # eager: var needs floating/complex
    ],
)
def test_eager_errors_stay_errors(fn, args):
    with pytest.raises((RuntimeError, ValueError, TypeError, IndexError)) as eager:
        fn(*args)
    # the exact torch op is traced instead: its meta kernel (FulmenError, a RuntimeError) or
    # the op raises, an error of eager's type
    with pytest.raises(RuntimeError if eager.type is RuntimeError else eager.type):
        fulmen.jit(fn)(*args)


def test_unsupported_arguments_fall_back_to_the_torch_op():
    jfn = check(lambda x: torch.logsumexp(x, 1), c23, mode="whole")
    assert ops_of(jfn) == ["opaque.logsumexp"]


def test_methods_route_to_the_same_symbol():
    jfn = check(lambda x: (x.sum(1), x.amax(0), x.var(), x.all(), x.argmin()), x234)
    assert ops_of(jfn) == ["ltorch.sum", "ltorch.amax", "ltorch.var", "ltorch.all", "ltorch.argmin"]


def test_numpy_axis_keyword_runs_as_eager():
    # torch accepts numpy's `axis=` for `dim=` (HF I-BERT: `x.mean(axis=2, keepdim=True)`);
    # a call the decomposition cannot bind is recorded as the exact torch op, not a TypeError
    def fn(x):
        return x.mean(axis=1, keepdim=True) + torch.sum(x, axis=0) * x.amax(axis=-1, keepdim=True)

    x = torch.randn(3, 3, requires_grad=True)
    expected, actual = fn(x), fulmen.jit(fn)(x)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(torch.autograd.grad(actual.sum(), x),
                               torch.autograd.grad(expected.sum(), x))
