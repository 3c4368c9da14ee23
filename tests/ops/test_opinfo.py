"""OpInfo conformance: every op fulmen decomposes, against eager, whole and decomposed.

`make test` runs up to 8 samples per OpInfo; `make conformance` runs every sample.
A sample fulmen refuses with a FulmenError (a construct it reports as unsupported) is counted
as refused, never as a pass; any wrong value fails the test.
"""

import pytest

from fulmen import FulmenError
from tests.ops.opinfo_harness import MODES, assert_same, matched_opinfos, run_sample, samples


def _ids(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("info", matched_opinfos(), ids=_ids)
def test_opinfo(info, mode, request):
    limit = request.config.getoption("--opinfo-samples")
    limit = None if limit == "all" else int(limit)
    refused = []
    ran = 0
    for sample in samples(info, limit):
        try:
            expected, actual, _ = run_sample(info, sample, mode)
        except FulmenError as error:
            refused.append(str(error).splitlines()[0])
            continue
        except (RuntimeError, ValueError, TypeError, IndexError) as error:
            # eager itself rejects some samples (error_inputs are not used here, but a few
            # samples are only valid for other dtypes): skip those, fail on our own errors.
            try:
                info.op(sample.input, *sample.args, **sample.kwargs)
            except Exception:
                continue
            raise AssertionError(f"{info.name}: jit raised but eager did not: {error}") from error
        assert_same(expected, actual, info)
        ran += 1
    assert ran > 0, f"{info.name}: no sample ran ({len(refused)} refused: {refused[:2]})"
