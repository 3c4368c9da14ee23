"""Everyday module patterns no other test covers, each compared with eager PyTorch over several
calls with changing inputs and state: `nn.MultiheadAttention` in its option variants (attention
weights, input and parameter gradients), an EMA `AveragedModel` updated between jitted training
steps and its BatchNorm statistics recomputed by `update_bn`, `nn.Embedding(sparse=True)` (sparse
gradients) and `max_norm` (renormalises the weight in place), and hooks on parameters."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

import fulmen


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _Attention(nn.Module):
    def __init__(self, call_kwargs, **kwargs):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, **kwargs)
        self.call_kwargs = call_kwargs

    def forward(self, q, k, v, mask):
        kwargs = dict(self.call_kwargs)
        if kwargs.pop("padding", None) == "float":
            mask = mask.float() * -1e4
        return self.attn(q, k, v, key_padding_mask=mask, **kwargs)


_CAUSAL = torch.triu(torch.ones(3, 4, dtype=torch.bool), 1)

_MHA_VARIANTS = {
    "plain": ({}, {}),
    "batch_first_float_padding": ({"batch_first": True}, {"padding": "float"}),
    "kdim_vdim_per_head_weights": ({"kdim": 5, "vdim": 6}, {"average_attn_weights": False}),
    "bias_kv_zero_attn": ({"add_bias_kv": True, "add_zero_attn": True}, {}),
    "attn_mask_no_weights": ({"bias": False}, {"attn_mask": _CAUSAL, "need_weights": False}),
    "dropout": ({"dropout": 0.5}, {}),
}


@pytest.mark.parametrize("variant", list(_MHA_VARIANTS))
def test_multihead_attention_variants_match_eager(variant):
    """Outputs, attention weights, input and parameter gradients agree with eager on each of three
    calls whose inputs and key padding change (dropout draws the same mask from the same seed)."""
    module_kwargs, call_kwargs = _MHA_VARIANTS[variant]
    torch.manual_seed(0)
    eager = _Attention(call_kwargs, **module_kwargs)
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    kdim, vdim = module_kwargs.get("kdim", 8), module_kwargs.get("vdim", 8)
    batch_first = module_kwargs.get("batch_first", False)
    for call in range(3):
        shapes = [(3, 8), (4, kdim), (4, vdim)]
        inputs = [_randn(*((2, n, d) if batch_first else (n, 2, d)), seed=10 * call + i)
                  for i, (n, d) in enumerate(shapes)]
        mask = torch.tensor([[False] * 4, [False, call == 1, False, True]])
        results = []
        for module in (eager, jitted):
            leaves = [t.clone().requires_grad_() for t in inputs]
            torch.manual_seed(call)
            out, weights = module(*leaves, mask)
            (out.square().sum() + (0 if weights is None else weights.sum())).backward()
            results.append((out, weights, [t.grad for t in leaves]))
        torch.testing.assert_close(results[1], results[0])
        torch.testing.assert_close([p.grad for p in model.parameters()],
                                   [p.grad for p in eager.parameters()])


def test_ema_averaged_model_and_update_bn_match_eager():
    """An EMA copy updated after each jitted training step and called jitted itself tracks the
    eager EMA; `update_bn` then recomputes its BatchNorm statistics through the jitted call."""
    runs = []
    for jit in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        step, ema_call = (fulmen.jit(model), fulmen.jit(ema)) if jit else (model, ema)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outs = []
        for call in range(3):
            x = _randn(5, 3, seed=call)
            step(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model)
            outs.append(ema_call(x))
        update_bn([_randn(5, 3, seed=10 + i) for i in range(2)], ema_call)
        ema.eval()
        outs.append(ema_call(_randn(5, 3, seed=20)))
        runs.append((outs, [t.clone() for t in (*ema.parameters(), *ema.buffers())]))
    torch.testing.assert_close(runs[1], runs[0])


class _Lookup(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.emb = nn.Embedding(10, 3, **kwargs)

    def forward(self, ids):
        return self.emb(ids).sum(1)


@pytest.mark.parametrize("kwargs", [{"sparse": True}, {"max_norm": 0.5, "padding_idx": 1}],
                         ids=["sparse", "max_norm"])
def test_embedding_sparse_grad_and_max_norm_match_eager(kwargs):
    """A sparse embedding's gradient stays sparse; max_norm renormalises the looked-up rows of the
    weight in place on every call, so the second call reads the first call's renormalised rows."""
    torch.manual_seed(0)
    eager = _Lookup(**kwargs)
    model = copy.deepcopy(eager)
    jitted = fulmen.jit(model)
    for call in range(3):
        ids = torch.tensor([[1, 2, 1], [4, 1, 9 - call]])
        for module in (eager, jitted):
            out = module(ids)
            (out * torch.arange(6.0).view(2, 3)).sum().backward()
        torch.testing.assert_close(model.emb.weight, eager.emb.weight)
        assert model.emb.weight.grad.layout == eager.emb.weight.grad.layout
        torch.testing.assert_close(model.emb.weight.grad.to_dense(),
                                   eager.emb.weight.grad.to_dense())


def test_parameter_hooks_fire_as_in_eager():
    """A gradient hook on a parameter rescales its gradient and a post-accumulate hook sees each
    accumulated gradient, once per backward, as in eager."""
    runs = []
    for jit in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        seen = []
        model.weight.register_hook(lambda grad: grad * 3)
        model.bias.register_post_accumulate_grad_hook(lambda p, seen=seen: seen.append(p.grad.clone()))
        call = fulmen.jit(model) if jit else model
        for i in range(3):
            call(_randn(4, 3, seed=i)).sum().backward()
        runs.append((model.weight.grad, seen))
    torch.testing.assert_close(runs[1], runs[0])
