"""OpInfo error inputs: every input eager rejects, fulmen rejects too, with eager's error type.

An input eager rejects that fulmen accepts is a silent answer where the user expected an error
(`gather` with an `out=` of another dtype once wrote cast values). A `FulmenError` counts as a
`RuntimeError` (it is one); other types (IndexError, ValueError, TypeError) must be eager's.
`make test` checks the first `PER_OP` error inputs of each OpInfo, `make conformance` all
(`--opinfo-samples=all`).
"""

import itertools
import warnings

import pytest
import torch

import fulmen
from tests.ops.opinfo_harness import matched_opinfos

# error inputs fulmen rejects with another error type than eager's (still an error)
OTHER_TYPE = {"arange"}
PER_OP = 4


def _with_error_inputs() -> list:
    return [info for info in matched_opinfos() if info.error_inputs_func is not None]


def _ids(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


@pytest.mark.parametrize("info", _with_error_inputs(), ids=_ids)
def test_error_inputs_raise_as_eager(info, request):
    limit = None if request.config.getoption("--opinfo-samples") == "all" else PER_OP
    for error_input in itertools.islice(info.error_inputs("cpu"), limit):
        sample = error_input.sample_input

        def fn(input, *args, _op=info.op, _kwargs=sample.kwargs):
            return _op(input, *args, **_kwargs)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                fn(sample.input, *sample.args)
                continue  # this torch accepts it
            except Exception as error:
                expected = RuntimeError if isinstance(error, RuntimeError) else type(error)
            with torch.no_grad(), pytest.raises(Exception) as raised:
                fulmen.jit(fn)(sample.input, *sample.args)
        if info.name not in OTHER_TYPE:
            assert isinstance(raised.value, expected), (info.name, raised.value)
