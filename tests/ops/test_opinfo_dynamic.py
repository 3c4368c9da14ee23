"""OpInfo conformance with symbolic sizes and alternating shapes: for each op, ONE jitted
function (`dynamic=True`) is called with every sample in turn and then with the first again, so
a symbolic trace compiled for one sample is reused for the others wherever its guards hold
(sizes, int arguments, kwargs). Every call must equal eager, forward and backward: a result
computed by a trace whose guards accepted a call they should not have is a wrong cache hit.

`make test` runs the ops of `FAST` (those whose decompositions compute with sizes: views,
slicing, concatenation, reductions, normalisations, padding, convolution), `SAMPLES` samples
each and `GRAD_SAMPLES` for the grads; `make conformance` runs every op (the others are marked
slow) with every sample (`--opinfo-samples=all`).
"""

import pytest
import torch

import fulmen
from fulmen import FulmenError
from tests.ops.opinfo_harness import (
    EagerError,
    assert_same,
    assert_same_grads,
    grad_samples,
    matched_opinfos,
    run_grad_sample,
    samples,
)

SAMPLES = 3  # per op in `make test`
GRAD_SAMPLES = 2
FAST = {
    "view", "reshape", "expand", "narrow", "split", "chunk", "cat", "squeeze", "unsqueeze",
    "transpose", "sum", "mean", "var", "amax", "cumsum", "softmax", "nn.functional.layer_norm",
    "nn.functional.pad", "nn.functional.conv2d", "gather",
}  # fmt: skip


def _ids(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def _params(infos) -> list:
    return [pytest.param(info, id=_ids(info),
                         marks=() if info.name in FAST else pytest.mark.slow) for info in infos]


def _limit(request, default: int) -> int | None:
    limit = request.config.getoption("--opinfo-samples")
    return None if limit == "all" else min(int(limit), default)


def _shared(info):
    """One jitted function for every sample of `info` (the sample's kwargs are arguments)."""
    op = info.op

    def fn(input, *args, **kwargs):
        return op(input, *args, **kwargs)

    return fn, fulmen.jit(fn, dynamic=True, cache_size_limit=64)


def _alternating(chosen: list) -> list:
    return chosen + chosen[:1] if len(chosen) > 1 else chosen


@pytest.mark.parametrize("info", _params(matched_opinfos()))
def test_opinfo_samples_through_one_dynamic_function(info, request):
    chosen = samples(info, _limit(request, SAMPLES))
    fn, jfn = _shared(info)
    ran = 0
    for sample in _alternating(chosen):
        args = (sample.input, *sample.args)
        with torch.no_grad():
            try:
                expected = fn(*args, **sample.kwargs)
            except Exception:  # noqa: BLE001 - eager rejects the sample: fulmen must too
                with pytest.raises(Exception):  # noqa: B017,PT011
                    jfn(*args, **sample.kwargs)
                continue
            try:
                actual = jfn(*args, **sample.kwargs)
            except FulmenError:  # a construct fulmen refuses (counted as not run)
                continue
        assert_same(expected, actual, info)
        ran += 1
    if not ran:
        pytest.skip(f"{info.name}: no sample ran")


GRAD_INFOS = [info for info in matched_opinfos() if info.supports_autograd]


@pytest.mark.parametrize("info", _params(GRAD_INFOS))
def test_opinfo_grads_through_one_dynamic_function(info, request):
    chosen = grad_samples(info, _limit(request, GRAD_SAMPLES))
    _, jfn = _shared(info)
    ran = 0
    for sample in _alternating(chosen):
        try:
            result = run_grad_sample(info, sample, jfn=jfn)
        except (FulmenError, EagerError):
            continue
        if result is None:
            continue
        assert_same_grads(*result, info)
        ran += 1
    if not ran:
        pytest.skip(f"{info.name}: no sample ran")
