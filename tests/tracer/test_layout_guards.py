"""Strides and storage offsets that a program reads are guarded (issue 20): a compiled call
answers `x.stride(0)`, `is_contiguous(memory_format=...)` and `x.storage_offset()` as eager."""

import torch

import fulmen


def test_stride_reads_of_differently_strided_inputs():
    # both inputs are non-contiguous with the same shape; only their strides differ
    jfn = fulmen.jit(lambda x: x * x.stride(0) + x.stride(1))
    inputs = (torch.randn(6, 8)[:, :4], torch.randn(4, 6).t(), torch.randn(6, 12)[:, ::3])
    for x in inputs:
        torch.testing.assert_close(jfn(x), x * x.stride(0) + x.stride(1))


def test_channels_last_read_is_guarded():
    def fn(x):
        if x.is_contiguous(memory_format=torch.channels_last):
            return x + 1
        return x - 1

    jfn = fulmen.jit(fn)
    x = torch.randn(2, 3, 4, 4)
    permuted = x.permute(0, 1, 3, 2)  # not contiguous in either format
    channels_last = x.contiguous(memory_format=torch.channels_last)
    for value in (permuted, channels_last, permuted):
        torch.testing.assert_close(jfn(value), fn(value))


def test_storage_offset_read_is_guarded():
    jfn = fulmen.jit(lambda x: x * x.storage_offset())
    buf = torch.arange(20.0)
    for start in (0, 3, 5, 3):
        view = buf[start:start + 4]
        torch.testing.assert_close(jfn(view), view * start)
    assert fulmen.cache_misses(jfn) == 3


def test_storage_offset_read_through_keyword_argument():
    jfn = fulmen.jit(lambda x, *, y: x + y.storage_offset())
    buf = torch.arange(20.0)
    for start in (1, 2):
        torch.testing.assert_close(jfn(buf[:4], y=buf[start:]), buf[:4] + start)


def test_unread_offsets_share_one_compilation():
    jfn = fulmen.jit(lambda x: x * 2)
    buf = torch.arange(20.0)
    for start in range(4):
        torch.testing.assert_close(jfn(buf[start:start + 4]), buf[start:start + 4] * 2)
    assert fulmen.cache_misses(jfn) == 1
