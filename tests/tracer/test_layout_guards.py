"""Strides and storage offsets that a program reads are guarded (issue 20): a compiled call
answers `x.stride(0)`, `is_contiguous(memory_format=...)` and `x.storage_offset()` as eager."""

import pytest
import torch
import torch.nn.functional as F

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


def test_basic_indexing_strides_are_eagers_views():
    """`basic_index_strides` (NOTE [layout queries stay cheap]) against eager's views: ints,
    slices with steps, None and Ellipsis, on contiguous, permuted and strided tensors."""
    from fulmen.proxies import TensorProxy
    from fulmen.tracer.layout import basic_index_strides

    bases = [torch.empty(3, 4, 5), torch.empty(4, 5, 3).permute(2, 0, 1),
             torch.empty(3, 4, 10)[..., ::2], torch.empty(1, 4, 5)]
    indices = [(None, slice(1, 3)), (Ellipsis, None), (0, None, slice(None, None, 2)),
               (slice(None), -1, None), (None, Ellipsis, 1, None), 2, slice(1, None),
               (None,), (Ellipsis, slice(None, None, 3), None), (0, 1, 2), ()]
    for base in bases:
        proxy = TensorProxy("x", tuple(base.shape), base.dtype, "cpu", strides=base.stride())
        for index in indices:
            if base.shape[0] == 1 and index in (2, (0, 1, 2)):
                continue  # out of range in eager too
            assert basic_index_strides(proxy, index) == base[index].stride(), (base.stride(),
                                                                               index)
    proxy = TensorProxy("x", (3, 4), torch.float32, "cpu")
    for index in (torch.tensor([0, 1]), True, [0, 1], (slice(None), torch.tensor(1)),
                  (Ellipsis, Ellipsis)):
        assert basic_index_strides(proxy, index) is None


def test_symbolic_slices_cats_and_keepdim_reductions_ask_no_meta_kernel(monkeypatch):
    """With symbolic sizes, a meta kernel runs on fake tensors (milliseconds each): basic
    indexing, `cat` where an input suggests no channels-last format (NOTE [cat layout]: a
    rotary `rotate_half` of a transposed query, a fresh KV cache's empty tensor), `keepdim`
    reductions and embeddings are laid out by rule, with eager's strides; a cat of
    channels-last tensors still asks the meta kernel and gets eager's layout."""
    import fulmen.tracer.layout_truth as layout_truth

    asked = []
    real = layout_truth.eager_layouts
    monkeypatch.setattr(layout_truth, "eager_layouts",
                        lambda fn, *a: asked.append(fn) or real(fn, *a))

    def fn(x):
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[:, None, 1:, half:]
        c = torch.cat((b[:, 0], a[:, 1:]), dim=-1)
        q = x[None].transpose(1, 2)  # rank 4, a transposed view
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        cached = torch.cat((torch.tensor([]), q), dim=-2)
        rms = x.contiguous().pow(2).mean(-1, keepdim=True)
        looked_up = F.embedding(torch.zeros(x.shape[0], 3, dtype=torch.long), x[0].contiguous())
        outs = (c, rotated, cached, rms, looked_up)
        return outs, [o.stride() for o in outs], a[None, ::2].stride()

    jfn = fulmen.jit(fn)
    for n in (6, 8, 10):
        x = torch.randn(n, 5, 8).transpose(0, 1)
        got, want = jfn(x), fn(x)
        torch.testing.assert_close(got[0], want[0])
        assert [o.stride() for o in got[0]] == [o.stride() for o in want[0]]
        assert got[1:] == want[1:]
    assert fulmen.cache_misses(jfn) == 2
    assert not {torch.Tensor.__getitem__, torch.cat, torch.mean, torch.Tensor.mean,
                F.embedding} & set(asked), asked

    def channels_last_cat(x):
        return torch.cat((x, x * 2), dim=1).stride()  # read inside: returned ones are restrided

    jcat = fulmen.jit(channels_last_cat)
    for n in (6, 8, 10):
        x = torch.randn(2, 3, n, 5).contiguous(memory_format=torch.channels_last)
        assert jcat(x) == channels_last_cat(x)


class _OffsetReader(torch.nn.Module):
    """A module whose parameter is a slice of a flat buffer (as flat-parameter wrappers make),
    reading the parameter's and a buffer's offsets."""

    def __init__(self, flat):
        super().__init__()
        self.w = torch.nn.Parameter(flat[2:6], requires_grad=False)
        self.register_buffer("b", flat[:4].clone())

    def forward(self, x):
        return x * self.w.storage_offset() + self.w + self.b.storage_offset()


def test_a_module_parameters_storage_offset_read_is_guarded():
    flat = torch.arange(20.0)
    module = _OffsetReader(flat)
    jitted = fulmen.jit(module)
    x = torch.ones(4)
    for start in (2, 5, 2, 7):
        module.w.data = flat[start:start + 4]
        torch.testing.assert_close(jitted(x), module(x))
    module.b = flat[8:12]
    torch.testing.assert_close(jitted(x), module(x))


_FLAT = torch.arange(20.0)
_HELD = _FLAT[2:6]


class _AttributeOffsetReader(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t = _FLAT[2:6]  # a plain tensor attribute, neither parameter nor buffer

    def forward(self, x):
        return x * self.t.storage_offset() + self.t


def _global_offset(x):
    return x * _HELD.storage_offset() + _HELD


def test_the_storage_offset_of_a_tensor_the_code_closes_over_is_eagers():
    """No key holds the offset of a global or a tensor attribute, and `.data =` keeps the
    tensor: such a call runs eagerly rather than answer with the traced offset."""
    module = _AttributeOffsetReader()
    cases = [(fulmen.jit(_global_offset), _global_offset, _HELD),
             (fulmen.jit(module), module, module.t)]
    x = torch.ones(4)
    for jitted, eager, held in cases:
        for start in (2, 5, 7):
            held.data = _FLAT[start:start + 4]
            if start == 2:  # the first call warns that such calls run eagerly
                with pytest.warns(UserWarning, match="storage offset"):
                    out = jitted(x)
            else:
                out = jitted(x)
            torch.testing.assert_close(out, eager(x))
