"""OpInfo backward conformance: gradients of jit vs eager for ops fulmen decomposes.

Up to 3 float32 samples per OpInfo that supports autograd; `make conformance` runs all samples.
"""

import pytest

from fulmen import FulmenError
from tests.ops.opinfo_harness import (
    EagerError,
    assert_same_grads,
    grad_samples,
    matched_opinfos,
    run_grad_sample,
)

GRAD_INFOS = [info for info in matched_opinfos() if info.supports_autograd]


def _ids(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


@pytest.mark.parametrize("info", GRAD_INFOS, ids=_ids)
def test_opinfo_grad(info, request):
    limit = request.config.getoption("--opinfo-samples")
    limit = None if limit == "all" else min(int(limit), 3)
    ran = 0
    refused = []
    for sample in grad_samples(info, limit):
        try:
            result = run_grad_sample(info, sample)
        except FulmenError as error:
            refused.append(str(error).splitlines()[0])
            continue
        except EagerError:  # eager rejects the sample (e.g. a float32 sample of an int-only op)
            continue
        if result is None:
            continue
        assert_same_grads(*result, info)
        ran += 1
    if ran == 0 and refused:
        pytest.skip(f"forward refused every sample: {refused[0]}")
