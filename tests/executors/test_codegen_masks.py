"""Codegen kernels whose masks or escaping views look alike but differ: each compared with
eager (values, and for views the storage they share)."""

import pytest
import torch
import torch.nn.functional as F

import fulmen

pytestmark = pytest.mark.usefixtures("codegen_eager")

EXECUTORS = ["codegen", "torch"]


def test_pads_of_one_output_size_and_start_but_different_widths_match_eager():
    # pad (1, 2) of 3 and pad (1, 1) of 4 both give 6 points from 1: the masks differ in length
    def padder(high):
        return lambda a: F.pad(a * 2, (1, high), value=-1.0) + 1

    for n, high in ((3, 2), (4, 1), (3, 2)):
        a = torch.randn(5, n)
        fn = padder(high)
        jfn = fulmen.jit(fn, executors=EXECUTORS)
        torch.testing.assert_close(jfn(a), fn(a), rtol=0, atol=0)


@pytest.mark.parametrize("offset", [0, 7])
def test_views_of_an_input_returned_beside_a_kernel_share_eagers_storage(offset):
    def fn(x):
        return x * 2 + 1, x.t()[1:], x[:, 1:]

    base = torch.randn(offset + 24)
    x = base[offset:].view(4, 6)
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    for _ in range(2):  # the second call takes the cached plan
        got, expected = jfn(x), fn(x)
        for actual, reference in zip(got, expected):
            torch.testing.assert_close(actual, reference, rtol=0, atol=0)
        for actual, reference in zip(got[1:], expected[1:]):
            assert actual.data_ptr() == reference.data_ptr()
            assert actual.stride() == reference.stride()
