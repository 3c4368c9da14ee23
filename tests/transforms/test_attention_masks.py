"""A boolean attention mask read by several flash attention calls is made additive once in the
trace (`additive_attention_masks`), with eager's values bit for bit."""

import pytest
import torch
import torch.nn.functional as F

import fulmen


def _layers(q, k, v, mask):  # two "layers" reading one mask, as an HF decoder does
    h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(h * 0.5, k, v, attn_mask=mask, scale=0.3)


def _inputs(dtype, requires_grad, padded=True):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g).to(dtype) for _ in range(3))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    if padded:
        mask[0, :, :, :2] = False  # left padding: two fully masked query rows
    return [t.requires_grad_(requires_grad) for t in (q, k, v)] + [mask]


def _mask_conversions(jfn) -> int:
    """How many `where`s over a whole mask the final forward trace runs."""
    trace = fulmen.last_traces(jfn)[-1]
    return sum(1 for b in trace.bsyms if b.sym.name == "where"
               and tuple(b.output.shape) == (2, 1, 6, 6))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_shared_boolean_mask_is_converted_once_with_eagers_values(dtype, grad):
    jfn = fulmen.jit(_layers, executors=["torch"])
    inputs, reference = _inputs(dtype, grad), _inputs(dtype, grad)
    with torch.set_grad_enabled(grad):
        out, expected = jfn(*inputs), _layers(*reference)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)  # the kernel received eager's additive mask
    if grad:
        out.sum().backward()
        expected.sum().backward()
        for a, b in zip(inputs[:3], reference[:3]):
            assert torch.equal(a.grad, b.grad)
    assert _mask_conversions(jfn) == 1
    readers = [b.sym.name for b in fulmen.last_traces(jfn)[-1].bsyms if b.sym.name != "del"
               and "mask" in {p.name for p in b.read_proxies}]
    assert readers == ["where"]  # the attention calls read the converted mask


def test_the_converted_mask_follows_the_mask_on_every_call():
    """The conversion is a statement of the trace, not a constant: a new mask of the same
    shape gives eager's answer."""
    jfn = fulmen.jit(_layers, executors=["torch"])
    for padded in (True, False, True):
        inputs = _inputs(torch.float32, False, padded)
        assert torch.equal(jfn(*inputs), _layers(*inputs))


@pytest.mark.parametrize("case", ["dropout", "three_dims", "float_mask"])
def test_calls_eager_does_not_run_on_flash_keep_their_mask(case):
    """Dropout (eager's math backend), 3-d inputs (math) and masks that are already additive
    are left as written."""
    q, k, v, mask = _inputs(torch.float32, False)
    if case == "three_dims":
        q, k, v, mask = q[0], k[0], v[0], mask[0]
    if case == "float_mask":
        mask = torch.where(mask, 0.0, -1e4)

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              dropout_p=0.5 if case == "dropout" else 0.0)

    jfn = fulmen.jit(fn, executors=["torch"])
    torch.manual_seed(0)
    out = jfn(q, k, v, mask)
    torch.manual_seed(0)
    assert torch.equal(out, fn(q, k, v, mask))
    stages = [t.provenance for t in fulmen.last_traces(jfn)]
    assert "after additive attention masks" not in stages
