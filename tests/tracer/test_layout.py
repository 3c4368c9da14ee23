"""Layouts as eager has them: strides read while tracing (issue 18) and the strides of the
tensors a compiled program returns (issue 20), with fusion on and off."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fulmen

EXECUTORS = {"codegen": ["codegen", "torch"], "torch": ["torch"]}


def channels_last(*shape):
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


def _same_layout(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return all(actual.stride(d) == expected.stride(d)
               for d in range(expected.dim()) if expected.shape[d] > 1)


@pytest.mark.parametrize("executors", list(EXECUTORS))
def test_elementwise_chain_keeps_channels_last(executors, codegen_eager):
    fn = lambda x: torch.relu(x * 2 + 1)  # noqa: E731
    x = channels_last(2, 3, 4, 5)
    jfn = fulmen.jit(fn, executors=EXECUTORS[executors])
    for _ in range(3):  # codegen's kernel and the torch fallback alike
        out = jfn(x)
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert _same_layout(out, fn(x))
        torch.testing.assert_close(out, fn(x))


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("executors", list(EXECUTORS))
@pytest.mark.parametrize("converted", ["input", "model"])
def test_conv_bn_relu_keeps_channels_last(executors, converted, codegen_eager):
    model = ConvBlock().eval()
    x = torch.randn(2, 3, 8, 8)
    if converted == "input":
        x = x.contiguous(memory_format=torch.channels_last)
    else:  # CPU's convolution follows the weight's layout too
        model = model.to(memory_format=torch.channels_last)
    expected = model(x)
    assert expected.is_contiguous(memory_format=torch.channels_last)
    jmodel = fulmen.jit(model, executors=EXECUTORS[executors])
    for _ in range(3):
        with torch.no_grad():
            out = jmodel(x)
        assert _same_layout(out, expected)
        torch.testing.assert_close(out, expected)


def test_training_output_keeps_channels_last(codegen_eager):
    model = ConvBlock()
    x = channels_last(2, 3, 8, 8)
    out = fulmen.jit(model)(x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    out.sum().backward()
    assert model.conv.weight.grad is not None


def test_strides_read_while_tracing_are_eagers():
    def fn(x):
        y = x.permute(0, 2, 1, 3) * 3
        z = x[:, :1].expand(2, 3, 4, 5)
        return (y.sum(), y.stride(0), y.stride(), z.stride(), y.is_contiguous(),
                (x + 1).is_contiguous(memory_format=torch.channels_last),
                torch.zeros_like(x.transpose(1, 2)).stride(), x[:, :, ::2].stride())

    for x in (torch.randn(2, 3, 4, 5), channels_last(2, 3, 4, 5)):
        expected = fn(x)
        actual = fulmen.jit(fn)(x)
        assert actual[1:] == expected[1:]


def test_view_follows_eager_strides(codegen_eager):
    """`view` on an intermediate succeeds or fails as in eager (HF Swin failed with "view size
    is not compatible with input tensor's size and stride": a fusion had written contiguous
    what eager keeps channels_last, and the view after a permute ran on that)."""

    def merge(x, bias, weight):  # channels_last + contiguous bias is channels_last in eager
        y = (x + bias).permute(0, 2, 3, 1)
        b, h, w, c = y.shape
        return y.view(b, h, w * c) @ weight

    x, bias, weight = channels_last(2, 3, 4, 4), torch.randn(1, 3, 1, 1), torch.randn(12, 2)
    jfn = fulmen.jit(merge)
    for _ in range(3):
        torch.testing.assert_close(jfn(x, bias, weight), merge(x, bias, weight))

    def bad_view(x):  # an expand is no contiguous tensor
        return x[:, :1].expand(2, 3, 4).view(-1)

    x = torch.randn(2, 3, 4)
    with pytest.raises(RuntimeError):
        bad_view(x)
    with pytest.raises(Exception, match="view|stride"):
        fulmen.jit(bad_view)(x)


def test_dense_non_contiguous_operands():
    def fn(x):
        return ((x.transpose(-1, -2) @ x).stride(), torch.where(x > 0, x, 0.0).stride(),
                x.clamp(0, 1).stride(), torch.lerp(x, x, 0.5).stride(),
                x.chunk(2, -1)[1].stride(), x.narrow(-1, 1, 2).stride(),
                x.transpose(1, 2).contiguous().stride())

    x = torch.randn(4, 3, 2).permute(2, 1, 0)  # dense, dims in reverse memory order
    assert fulmen.jit(fn)(x) == fn(x)


@pytest.mark.parametrize("other", ["unbroadcastable", "transposed"])
def test_type_as_is_laid_out_by_its_input_alone(other):
    """HF Longformer / LED / PEGASUS-X: `mask.type_as(query)` with a query of another shape
    failed to trace (the query was taken for a broadcast operand); one of the same shape but
    another layout must not lend its strides either."""

    def fn(mask, query):
        out = mask.type_as(query)
        return out.masked_fill(out > 0, -1.0), out.stride()

    mask = torch.randint(0, 2, (2, 6, 1, 1), dtype=torch.int64)
    query = torch.randn(2, 6, 3, 4)
    if other == "transposed":
        mask = torch.randint(0, 2, (2, 6, 3, 4), dtype=torch.int64)
        query = torch.randn(4, 3, 6, 2).permute(3, 2, 1, 0)
    expected, expected_strides = fn(mask, query)
    actual, strides = fulmen.jit(fn)(mask, query)
    torch.testing.assert_close(actual, expected)
    assert strides == expected_strides and actual.stride() == expected.stride()


def _upsampled_dropout(b, w):
    # SegFormer's decode head: a projection of a 1x1 feature map viewed back as (n, c, 1, 1)
    # keeps strides (c, 1, c, c) at its size-1 dims, so eager's bilinear upsample of it is
    # channels-last, and the dropout after it draws its mask in that memory order
    t = F.linear(b.flatten(2).transpose(1, 2), w).transpose(1, 2).reshape(2, -1, 1, 1)
    up = F.interpolate(t, size=(4, 4), mode="bilinear", align_corners=False)
    return F.dropout(up, 0.5), t.stride()


def test_a_view_keeps_eagers_strides_at_size_one_dims():
    b, w = torch.randn(2, 6, 1, 1), torch.randn(8, 6, requires_grad=True)
    torch.manual_seed(0)
    want, want_strides = _upsampled_dropout(b, w)
    torch.manual_seed(0)
    got, got_strides = fulmen.jit(_upsampled_dropout)(b, w)
    assert got_strides == want_strides == (8, 1, 8, 8)
    torch.testing.assert_close(got, want)  # the same mask


def _view_of_a_made_transpose(x):
    return torch.zeros(4, 6).t().view(24) + x  # eager: "view size is not compatible"


def _written_reshape_of_a_made_transpose(x):
    z = torch.ones(4, 6)
    r = z.t().reshape(24)  # a copy in eager (a transpose cannot be viewed flat)
    r.add_(1)
    return z + x.view(4, 6), r


def test_tensors_made_in_the_call_have_known_strides():
    """A tensor the call makes from no tensor (`torch.zeros`, `torch.arange`) has eager's
    strides, known while tracing (layout truth marks an output exact when *every* tensor
    argument is, which holds for none): a `view` its transpose cannot give raises eager's
    error, and a `reshape` of it is known to copy, so writing into that copy leaves the
    made tensor alone."""
    x = torch.randn(24)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        _view_of_a_made_transpose(x)
    with pytest.raises(Exception, match="view size is not compatible"):
        fulmen.jit(_view_of_a_made_transpose)(x)
    expected = _written_reshape_of_a_made_transpose(x)
    actual = fulmen.jit(_written_reshape_of_a_made_transpose)(x)
    torch.testing.assert_close(actual, expected)
