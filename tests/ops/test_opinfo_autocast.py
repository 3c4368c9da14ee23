"""OpInfo samples under CPU autocast: every op inside `torch.autocast("cpu", dtype)` gives
eager's result dtype (autocast's lower-precision, float32 and promote lists) and its values to
the reduced dtype's rounding.

A wrong cast under autocast (an op of the float32 list run in bfloat16, a promote-list op not
promoted) changes dtypes or values only inside autocast, where the plain OpInfo tests do not
look. `make test` runs one sample per OpInfo under bfloat16, `make conformance` every sample
under both.
"""

import warnings

import pytest
import torch
from torch.utils._pytree import tree_leaves

import fulmen
from tests.ops.opinfo_harness import VALUES_UNSPECIFIED, matched_opinfos, samples


def _ids(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


@pytest.mark.parametrize("inputs", ["float32", "reduced"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("info", matched_opinfos(), ids=_ids)
def test_ops_under_autocast_give_eagers_dtypes_and_values(info, dtype, inputs, request):
    """Inputs of float32 (cast down by the lower-precision list) and of the autocast dtype
    (cast up by the float32 list, `softmax`, `layer_norm`)."""
    every = request.config.getoption("--opinfo-samples") == "all"
    if dtype == torch.float16 and not every:
        pytest.skip("float16 autocast: make conformance")
    sample_dtype = dtype if inputs == "reduced" else torch.float32
    if sample_dtype not in info.supported_dtypes("cpu"):
        pytest.skip(f"{info.name} has no {sample_dtype} samples")
    for sample in samples(info, None if every else 1, dtype=sample_dtype):

        def fn(input, *args, _op=info.op, _kwargs=sample.kwargs):
            with torch.autocast("cpu", dtype=dtype):
                return _op(input, *args, **_kwargs)

        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                torch.manual_seed(0)
                expected = fn(sample.input, *sample.args)
            except Exception:
                continue  # eager rejects the sample under autocast
            torch.manual_seed(0)
            try:
                actual = fulmen.jit(fn)(sample.input, *sample.args)
            except fulmen.FulmenError:
                continue  # refused with an error, never a wrong answer
        for e, a in zip(tree_leaves(expected), tree_leaves(actual), strict=True):
            if not isinstance(e, torch.Tensor):
                assert e == a or (e != e and a != a), info.name
                continue
            assert (a.dtype, a.shape) == (e.dtype, e.shape), info.name
            if info.name not in VALUES_UNSPECIFIED:
                torch.testing.assert_close(a, e, equal_nan=True, atol=1e-2, rtol=1.6e-2)
