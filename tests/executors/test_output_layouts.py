"""Returned tensors have eager's strides (NOTE [output layout] in `fulmen/executors/claim.py`)
when their ops are decomposed to prims: run one by one by torch, a prim follows its operands'
layout where eager's op does not (a layer norm of a transposed input is row-major in eager)."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.transforms import decompose_to_prims

_CASES = {
    "layer_norm of a transposed input": (lambda x: F.layer_norm(x, (5,)),
                                         torch.randn(5, 4).T),
    "log_softmax over the outer dim of a transposed input": (lambda x: F.log_softmax(x, 0),
                                                             torch.randn(5, 4).T),
    "softmax over channels, channels_last": (lambda x: torch.softmax(x, 1),
                                             torch.randn(2, 3, 4, 5).to(
                                                 memory_format=torch.channels_last)),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_outputs_of_ops_decomposed_to_prims_have_eagers_strides(case):
    fn, x = _CASES[case]
    expected = fn(x)
    jfn = fulmen.jit(fn, executors=["torch"], transforms=[decompose_to_prims])
    for _ in range(2):
        actual = jfn(x)
        torch.testing.assert_close(actual, expected)
        assert actual.stride() == expected.stride()


def _layer_norm_of_transposed(x):
    return F.layer_norm(x, (64,)) * 2


def test_a_fusions_torch_fallback_returns_eagers_layout():
    """Before its kernel is ready (the lazy compile policy: the first calls), a codegen region
    runs its prims with torch, which lay the normalised transposed input out transposed; eager
    returns it row-major, as the kernel does (NOTE [the fallback's layouts])."""
    x = torch.randn(64, 32).T
    expected = _layer_norm_of_transposed(x)
    jfn = fulmen.jit(_layer_norm_of_transposed, executors=["codegen", "torch"])
    for call in range(2):
        actual = jfn(x)
        torch.testing.assert_close(actual, expected)
        assert actual.stride() == expected.stride(), call
