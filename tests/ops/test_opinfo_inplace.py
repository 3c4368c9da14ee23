"""OpInfo in-place variants (`x.add_(y)`, `x.uniform_()`, ...): the jitted call writes what
eager writes into its input and returns that input itself.

A dropped or misplaced write-back of an in-place op is invisible to the out-of-place OpInfo
tests. Random ops draw after the same seed in both runs, so their values are compared too.
`make test` runs 2 samples per OpInfo, `make conformance` all.
"""

import itertools
import warnings

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import fulmen
from tests.ops.opinfo_harness import samples

# in-place variants fulmen refuses with an error: eager resizes the input (`addbmm_` of a
# shape-[1] input returns a [5, 10] tensor in its place)
RESIZES_THE_INPUT = {"addbmm"}


def _ids(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


@pytest.mark.parametrize("info", [i for i in op_db if i.inplace_variant is not None], ids=_ids)
def test_inplace_variant_writes_as_eager(info, request):
    every = request.config.getoption("--opinfo-samples") == "all"
    ran = 0
    for sample in samples(info, None if every else 2):
        if not isinstance(sample.input, torch.Tensor):
            continue

        def fn(input, *args, _op=info.inplace_variant, _kwargs=sample.kwargs):
            return _op(input, *args, **_kwargs)

        expected, actual = sample.input.clone(), sample.input.clone()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                torch.manual_seed(0)
                fn(expected, *sample.args)
            except Exception:
                continue  # eager rejects this sample in place (a result of another dtype)
            torch.manual_seed(0)
            if info.name in RESIZES_THE_INPUT and expected.shape != actual.shape:
                with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
                    fulmen.jit(fn)(actual, *sample.args)
                continue
            returned = fulmen.jit(fn)(actual, *sample.args)
        torch.testing.assert_close(actual, expected, equal_nan=True)
        assert returned is actual, info.name
        ran += 1
    if not ran:
        pytest.skip(f"{info.name}: eager rejects every sample in place")


def _grad_infos() -> list:
    return [i for i in op_db if i.inplace_variant is not None and i.supports_autograd
            and i.supports_inplace_autograd and i.name not in RESIZES_THE_INPUT]


def _loss_and_grads(fn, sample, leaves) -> list:
    for leaf in leaves:
        leaf.grad = None
    torch.manual_seed(0)
    loss = fn(sample.input, *sample.args)
    loss.backward()
    return [loss.detach(), *(leaf.grad for leaf in leaves)]


@pytest.mark.parametrize("info", _grad_infos(), ids=_ids)
def test_inplace_variant_of_a_value_requiring_grad_trains_as_eager(info):
    """The in-place op applied to an intermediate (`h = x * 1.0; h.op_(...)`) of float64
    inputs requiring grad: the loss and every input's gradient equal eager's."""
    for sample in itertools.islice(info.sample_inputs("cpu", torch.float64, requires_grad=True), 2):
        leaves = [sample.input, *(a for a in sample.args
                                  if isinstance(a, torch.Tensor) and a.requires_grad)]

        def fn(input, *args, _op=info.inplace_variant, _kwargs=sample.kwargs):
            result = _op(input * 1.0, *args, **_kwargs)
            return (result * result).sum()

        try:
            expected = _loss_and_grads(fn, sample, leaves)
        except RuntimeError:
            continue  # eager rejects this sample in place
        got = _loss_and_grads(fulmen.jit(fn), sample, leaves)
        for actual, wanted in zip(got, expected, strict=True):
            assert (actual is None) == (wanted is None), info.name
            if wanted is not None:
                torch.testing.assert_close(actual, wanted, equal_nan=True)
