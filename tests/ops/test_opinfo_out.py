"""OpInfo `out=` variants: the jitted call writes what eager writes into `out` (of the result's
shape, row-major or transposed) and returns `out` itself.

A dropped or misplaced write into `out=` is invisible to the out-of-place OpInfo tests.
Factories given `out=` (`torch.zeros(3, out=o)`) are refused with a clear error, as is an
`out=` of another shape, which eager resizes (test_factories_and_resizing_outs_are_refused).
"""

import warnings

import pytest
import torch

import fulmen
from tests.ops.opinfo_harness import matched_opinfos, samples

# F.gelu(x, out=transposed) leaves `out` unwritten in eager (torch 2.13): fulmen writes it
EAGER_SKIPS_A_TRANSPOSED_OUT = {"nn.functional.gelu"}


def _ids(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def _outs(result: torch.Tensor) -> dict:
    outs = {"row-major": lambda: torch.full_like(result, 7)}
    if result.ndim >= 2:  # the same shape, the first and last dims' strides swapped
        shape = (result.shape[-1], *result.shape[1:-1], result.shape[0])
        outs["transposed"] = lambda: torch.full(shape, 7, dtype=result.dtype).transpose(0, -1)
    return outs


@pytest.mark.parametrize("info", [i for i in matched_opinfos() if i.supports_out], ids=_ids)
def test_out_variant_writes_as_eager(info):
    for sample in samples(info, 3):
        if not isinstance(sample.input, torch.Tensor):
            continue  # a factory: refused (test_factories_and_resizing_outs_are_refused)

        def fn(input, out, *args, _op=info.op, _kwargs=sample.kwargs):
            return _op(input, *args, out=out, **_kwargs)

        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            result = info.op(sample.input, *sample.args, **sample.kwargs)
            if not isinstance(result, torch.Tensor):
                continue
            for layout, make in _outs(result).items():
                if layout == "transposed" and info.name in EAGER_SKIPS_A_TRANSPOSED_OUT:
                    continue
                expected, actual = make(), make()
                torch.manual_seed(0)
                fn(sample.input, expected, *sample.args)
                torch.manual_seed(0)
                returned = fulmen.jit(fn)(sample.input, actual, *sample.args)
                torch.testing.assert_close(actual, expected, equal_nan=True, msg=layout)
                assert actual.stride() == expected.stride() and returned is actual, layout


def _zeros_out(x, out):
    return torch.zeros(3, out=out)


def _add_out(x, out):
    return torch.add(x, 1, out=out)


@pytest.mark.parametrize("fn", [_zeros_out, _add_out])
def test_factories_and_resizing_outs_are_refused(fn):
    """Eager resizes an `out=` of another shape (here empty) and fills a factory's `out=`;
    fulmen refuses both with an error naming the op (under fullgraph=True for a resize, which
    otherwise runs eagerly: session 52), and writes nothing."""
    out = torch.empty(0)
    with pytest.raises(fulmen.FulmenError, match="zeros|add"):
        fulmen.jit(fn, fullgraph=fn is _add_out)(torch.randn(3), out)
    assert out.shape == (0,)
