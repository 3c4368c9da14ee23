"""Every integer and bool spelling of the kernel op table (`executors/codegen/ops.py`) against
eager, bit for bit, in one compiled kernel per dtype.

The OpInfo run of `test_codegen.py` draws float samples, so an op's "int" and "bool" spellings
(`abs` as a conditional negation, `maximum` of bools as `||`, `isfinite` of an integer as
`true`...) are rendered only here. Each function below computes many ops at once and must fuse
into one region, so a wrong spelling changes an output and costs one C++ compile per dtype.
"""

import pytest
import torch

import fulmen
from fulmen.executors.codegen import kernel_sources

pytestmark = [pytest.mark.usefixtures("codegen_eager"), pytest.mark.filterwarnings(
    "error:fulmen codegen.*runs on the torch executor:RuntimeWarning")]

EXECUTORS = ["codegen", "torch"]


def _integer_ops(a, b):
    return (-a, a.abs(), a.sign(), torch.logical_not(a), ~a, a - b, b - a, a * b,
            torch.minimum(a, b), torch.maximum(a, b), a & b, a | b, a ^ b,
            a == b, a != b, a < b, a <= b, a > b, a >= b,
            torch.where(a > 0, a, b), a.isnan(), a.isinf(), a.isfinite(), a.signbit())


def _bool_ops(a, b):
    return (torch.logical_not(a), ~a, a + b, a * b, torch.minimum(a, b), torch.maximum(a, b),
            a & b, a | b, a ^ b, a == b, a != b, a < b, a <= b, a > b, a >= b,
            torch.where(a, b, ~b), a.isnan(), a.isinf(), a.isfinite(), a.signbit())


def _assert_one_kernel_matches(fn, a, b):
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    actual, expected = jfn(a, b), fn(a, b)
    for i, (x, y) in enumerate(zip(actual, expected, strict=True)):
        assert x.dtype == y.dtype, f"output {i}"
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"output {i}")
    assert len(kernel_sources(fulmen.last_traces(jfn)[-1])) == 1


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8])
def test_integer_spellings_match_eager(dtype):
    # zeros, equal pairs and both signs, so every comparison and sign spelling is decided
    a = torch.tensor([-7, -1, 0, 0, 1, 5, 3, -3, 2, 9], dtype=dtype)
    b = torch.tensor([2, -1, 0, 4, -6, 5, -3, 3, 2, -9], dtype=dtype)
    _assert_one_kernel_matches(_integer_ops, a, b)


def test_bool_spellings_match_eager():
    a = torch.tensor([False, False, True, True])
    b = torch.tensor([False, True, False, True])
    _assert_one_kernel_matches(_bool_ops, a, b)
