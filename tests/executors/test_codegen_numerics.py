"""Generated kernels compute what eager computes at the edges of each dtype: float -> integer
casts of out-of-range and NaN values, Python-number exponents of `pow`, the sign of zero
through `clamp`, and ops eager refuses (raised while tracing, as a FulmenError naming the op).

Every test runs with the `codegen_eager` policy, so the kernels run from the first call.
"""

import math

import pytest
import torch

import fulmen
from fulmen.core import FulmenError
from fulmen.executors.codegen import kernel_sources

pytestmark = pytest.mark.usefixtures("codegen_eager")

EXECUTORS = ["codegen", "torch"]
NAN, INF = math.nan, math.inf
SPECIAL = [-2.3, 300.0, 3e9, NAN, INF, -INF, -3e9, 1e20, -1e20, 255.9, -128.9, 127.9, 2.0**31,
           -(2.0**31), -2147483904.0, 9.3e18, -9.3e18, 65535.5, -0.7, 70000.0, -70000.0, 0.5]


def _jit(fn):
    return fulmen.jit(fn, executors=EXECUTORS)


def _fused(jfn) -> bool:
    return "codegen.fusion" in str(fulmen.last_traces(jfn)[-1])


def _run_twice(fn, *args):
    """`fn` through fulmen on its first and second call (the cached entry), and eager."""
    jfn = _jit(fn)
    first, second = jfn(*args), jfn(*args)
    assert _fused(jfn), fulmen.last_traces(jfn)[-1]
    return first, second, fn(*args)


def _assert_equal(actual, expected):
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


# --- float -> integer casts ---------------------------------------------------------------------

INTEGERS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


@pytest.mark.parametrize("source", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("target", INTEGERS, ids=str)
def test_float_to_integer_casts_match_eager(source, target):
    x = torch.tensor(SPECIAL, dtype=torch.float64).to(source)

    def fn(x):
        return (x * 1).to(target) + 1

    for actual in _run_twice(fn, x)[:2]:
        _assert_equal(actual, fn(x))


@pytest.mark.parametrize("target", INTEGERS, ids=str)
def test_float_to_integer_casts_are_defined_in_the_generated_source(target):
    """The C++ cast of an out-of-range float is undefined behaviour: the result on this
    machine is luck of the compiler's instruction choice, so the kernel must not contain it."""
    jfn = _jit(lambda x: (x * 2).to(target) + 1)
    jfn(torch.tensor(SPECIAL))
    (source,) = kernel_sources(fulmen.last_traces(jfn)[-1]).values()
    kernel = source[source.index('extern "C"'):]
    assert "f_to_i" in kernel
    for ctype in ("int8_t", "int16_t", "int32_t", "int64_t", "uint8_t"):
        assert f"({ctype})(v" not in kernel


def test_uint8_of_negative_and_wide_values_goes_through_int64():
    x = torch.tensor([-2.3, 300.0, 3e9, NAN, 4294967301.0], dtype=torch.float64)
    first, second, expected = _run_twice(lambda x: (x + 0).to(torch.uint8), x)
    assert expected.tolist() == [254, 44, 0, 0, 5]
    _assert_equal(first, expected)
    _assert_equal(second, expected)


def test_fake_quantization_pattern_matches_eager():
    x = torch.tensor(SPECIAL + [12.7, -12.8, 13.5, -14.0, 0.05])

    def fake_quant(x):
        return (x / 0.1).round().to(torch.int8).float() * 0.1

    first, second, expected = _run_twice(fake_quant, x)
    _assert_equal(first, expected)
    _assert_equal(second, expected)


# --- pow with a Python-number exponent ----------------------------------------------------------

POWERS = {
    "2**31-1": ([1.0000001, 0.99999994, -1.0, 2.0, -0.5], 2147483647),
    "5e-324": ([2.0, 0.5, 0.0, -2.0, INF], 5e-324),
    "1/3": ([1e30, 2.0, 0.5, 3.3, 8.0], 1 / 3),
    "1e-45": ([1.5, 2.5], 1e-45),
    "0.1": ([1e-30, 7.0, 1e30], 0.1),
    "2 (x*x)": ([3.0, -1e20, 1.5], 2),
    "-0.5 (rsqrt)": ([4.0, 0.0, 2.0], -0.5),
}


@pytest.mark.parametrize("case", sorted(POWERS))
def test_pow_number_exponent_is_not_rounded_to_float32(case):
    values, exponent = POWERS[case]
    x = torch.tensor(values)  # fewer than 16 elements: eager's kernel runs its scalar loop
    first, second, expected = _run_twice(lambda x: (x * 1) ** exponent, x)
    _assert_equal(first, expected)
    _assert_equal(second, expected)


def test_pow_number_exponent_in_a_row_kernel():
    x = torch.tensor([[1e30, 2.0, -1.0], [0.5, 3.3, 8.0]])

    def fn(x):
        y = x ** 2147483647 + x ** (1 / 3)
        return y.sum(dim=1), y

    jfn = _jit(fn)
    for actual, expected in zip(jfn(x), fn(x)):
        torch.testing.assert_close(actual, expected, equal_nan=True)


# --- clamp keeps the sign of zero ---------------------------------------------------------------

CLAMPS = {
    "clamp(min=0)": lambda x: (x * 1).clamp(min=0.0),
    "clamp(max=0)": lambda x: (x * 1).clamp(max=0.0),
    "clamp(min=-0.)": lambda x: (x * 1).clamp(min=-0.0),
    "clamp(-0., 0.)": lambda x: (x * 1).clamp(-0.0, 0.0),
    "relu": lambda x: torch.relu(x * 1),
    "hardtanh": lambda x: torch.nn.functional.hardtanh(x * 1, -0.0, 0.0),
    "clamp_min": lambda x: torch.clamp_min(x * 1, 0.0),
}


@pytest.mark.parametrize("case", sorted(CLAMPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_clamp_keeps_the_sign_of_zero(case, dtype):
    x = torch.tensor([-0.0, 0.0, NAN, -1.0, 1.0] * 5, dtype=dtype)
    first, second, expected = _run_twice(CLAMPS[case], x)
    for actual in (first, second):
        _assert_equal(actual, expected)
        assert torch.equal(actual.signbit(), expected.signbit())


# --- what eager refuses is refused while tracing --------------------------------------------------

_MASK = torch.tensor([True, False, True])
_INT8 = torch.tensor([1, 2, 3], dtype=torch.int8)
REFUSED = {
    "clamp(int8, min=300)": (lambda t: torch.clamp(t, min=300) + 1, _INT8),
    "clamp(int8, max=-300)": (lambda t: t.clamp(max=-300) * 2, _INT8),
    "clamp(float16, max=1e6)": (lambda t: t.clamp(max=1e6) * 2, torch.ones(3, dtype=torch.float16)),
    "where(c, float32, 1e308)": (lambda t: torch.where(_MASK, t, 1e308) * 2, torch.ones(3)),
    "where(c, -1e39, float32)": (lambda t: torch.where(_MASK, -1e39, t) * 2, torch.ones(3)),
    "where(c, int8, 300)": (lambda t: torch.where(_MASK, t, 300) + 1, _INT8),
    "True - x": (lambda t: True - t * 2, torch.ones(3)),
    "x - True": (lambda t: t * 2 - True, torch.ones(3)),
    "1 - bool": (lambda t: 1 - t, _MASK),
    "bool.sub(1)": (lambda t: t.sub(1) * 2, _MASK),
    "bool / 2**63": (lambda t: t / 2**63, _MASK),
    "bool + 2**63": (lambda t: (t + 2**63) * 2, _MASK),
    "bool * (2**64 - 1)": (lambda t: t * (2**64 - 1), _MASK),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("executors", [EXECUTORS, ["torch"]], ids=["codegen", "torch"])
def test_what_eager_refuses_raises_while_tracing(case, executors):
    fn, x = REFUSED[case]
    with pytest.raises(RuntimeError) as eager:
        fn(x)
    jfn = fulmen.jit(fn, executors=executors)
    for _ in range(2):  # the error repeats: nothing was cached
        with pytest.raises(FulmenError) as error:
            jfn(x)
        assert str(eager.value).split("\n")[0] in str(error.value)
        assert error.value.op.startswith("ltorch.")


ACCEPTED = {
    "clamp(int8, min=2.5)": (lambda t: torch.clamp(t, min=2.5), _INT8),
    "clamp(float32, max=inf)": (lambda t: t.clamp(max=math.inf) * 2, torch.ones(2)),
    "where(c, float32, 1e38)": (lambda t: torch.where(_MASK[:2], t, 1e38) * 2, torch.ones(2)),
    "where(c, bool, 2)": (lambda t: torch.where(_MASK[:2], t, 2), _MASK[:2]),
    "int8 + 2**63": (lambda t: t + 2**63, torch.ones(2, dtype=torch.int8)),
    "float32 / 2**63": (lambda t: t / 2**63, torch.ones(2)),
    "uint8 - 300": (lambda t: t - 300, torch.ones(2, dtype=torch.uint8)),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_what_eager_accepts_still_runs(case):
    fn, x = ACCEPTED[case]
    torch.testing.assert_close(_jit(fn)(x), fn(x))


# --- layer_norm where the row mean's square overflows ---------------------------------------------


@pytest.mark.parametrize("rows", [[[1e20, 1.0]], [[1e20, 1e20], [1.0, 2.0]], [[1e19, 1.0]],
                                  [[1e20] * 15 + [1.0]], [[1e20] * 8 + [1.0]],
                                  [[1.0, 2.0, 3.0, 5.0]]], ids=str)
def test_layer_norm_of_huge_rows_matches_eager(rows):
    x = torch.tensor(rows)

    def fn(x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],)) * 2

    first, second, expected = _run_twice(fn, x)
    torch.testing.assert_close(first, expected, equal_nan=True)
    torch.testing.assert_close(second, expected, equal_nan=True)


# --- tanh: the prelude's vectorisable f_tanh ----------------------------------------------------

def test_tanh_is_within_two_ulp_of_float64_everywhere():
    """f_tanh (a polynomial below 0.55, 1 - 2/(exp(2|x|)+1) above) against float64 tanh on a
    dense float32 grid spanning subnormals to overflow, both signs, and the special values."""
    grid = torch.logspace(-44, 38.5, 1 << 19, dtype=torch.float64).float()
    dense = torch.linspace(-12, 12, 1 << 19)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 0.55, -0.55,
                             0.5499999, 9.0, 1e-45, -1e-45])
    x = torch.cat([grid, -grid, dense, specials])
    jfn = fulmen.jit(lambda t: torch.tanh(t), executors=["codegen", "torch"])
    got = jfn(x)
    assert "f_tanh(" in "".join(fulmen.last_kernels(jfn).values())
    want = torch.tanh(x.double())
    ulp = torch.nextafter(want.float().abs(), torch.tensor(math.inf)).double() - want.float().abs()
    finite = want.isfinite() & (want != 0)
    error = ((got.double() - want).abs() / ulp)[finite]
    assert error.max() <= 2.0, f"{error.max().item():.2f} ulp at {x[finite][error.argmax()]}"
    assert torch.equal(got[~finite].isnan(), want[~finite].isnan())
    zeros = want == 0
    assert torch.equal(got[zeros].signbit(), x[zeros].signbit())  # tanh(-0.0) is -0.0
