"""Autocast around a jitted call: the trace holds autocast's casts, the run adds none.

Over several calls with autocast on, off, nested and with another dtype, forward values and
gradients equal eager's, also through an inner `autocast(enabled=False)` region whose float32
results feed fused kernels.
"""

import pytest
import torch

import fulmen
from fulmen.core.ambient import autocast_key, run_without_autocast, without_autocast


class Mixed(torch.nn.Module):
    """A float32 island (`autocast(enabled=False)`) between autocast matmuls, then fusible ops."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 8)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            island = h.float() @ self.b.weight.t()
            h = torch.nn.functional.gelu(island + self.b.bias)
        h = (h * torch.sigmoid(h)).softmax(dim=-1)
        return island, self.c(h).float().sum(dim=-1)


def _states():
    """(label, context) for each ambient state of a call, in the order the test calls them."""
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    f16 = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    off = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731

    class Nested:
        def __enter__(self):
            self.outer, self.inner = bf16(), off()
            self.outer.__enter__()
            self.inner.__enter__()

        def __exit__(self, *exc):
            self.inner.__exit__(*exc)
            self.outer.__exit__(*exc)

    return [("bf16", bf16), ("none", lambda: torch.autocast("cpu", enabled=False)),
            ("bf16 again", bf16), ("f16", f16), ("bf16 then disabled", Nested),
            ("bf16 third time", bf16)]


@pytest.mark.parametrize("backward_inside", [False, True])
def test_module_with_an_enabled_false_region(codegen_eager, backward_inside):
    torch.manual_seed(0)
    model = Mixed()
    jmodel = fulmen.jit(model, executors=["codegen", "torch"])
    x = torch.randn(6, 16)
    for label, state in _states():
        grads = []
        outs = []
        for run in (model, jmodel):
            model.zero_grad()
            with state():
                island, out = run(x)
                if backward_inside:
                    (out.sum() + island.sum()).backward()
            if not backward_inside:
                (out.sum() + island.sum()).backward()
            outs.append((island, out))
            grads.append([p.grad.clone() for p in model.parameters()])
        (island_eager, expected), (island_jit, actual) = outs
        assert island_jit.dtype == island_eager.dtype == torch.float32, label
        torch.testing.assert_close(island_jit, island_eager, atol=1e-5, rtol=1e-5, msg=label)
        assert actual.dtype == expected.dtype, label
        tolerance = dict(atol=2e-2, rtol=2e-2) if label != "none" else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(actual, expected, **tolerance, msg=label)
        for g_jit, g_eager in zip(grads[1], grads[0]):
            torch.testing.assert_close(g_jit, g_eager, **tolerance, msg=label)


def test_llama_under_autocast():  # default executors and compile policy, as a user runs it
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, hidden_size=32,
                                      intermediate_size=64, vocab_size=64,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    jmodel = fulmen.jit(model)
    ids = torch.randint(0, 64, (2, 8))
    for enabled in (True, False, True):
        results = []
        for run in (model, jmodel):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                logits = run(ids).logits
            logits.float().square().mean().backward()
            results.append((logits, [p.grad.clone() for p in model.parameters()]))
        (expected, eager_grads), (actual, jit_grads) = results
        assert actual.dtype == expected.dtype
        tolerance = dict(atol=3e-2, rtol=3e-2) if enabled else dict(atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(actual.float(), expected.float(), **tolerance)
        for g_jit, g_eager in zip(jit_grads, eager_grads):
            assert torch.isfinite(g_jit).all()
            torch.testing.assert_close(g_jit, g_eager, **tolerance)


def test_autocast_dtype_is_part_of_the_cache_key():
    fn = lambda x, w: (x @ w).relu()  # noqa: E731
    jfn = fulmen.jit(fn)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype):
            assert jfn(x, w).dtype == fn(x, w).dtype == dtype
    assert fulmen.cache_misses(jfn) == 2
    assert any("autocast" in reason for reasons in fulmen.compile_stats(jfn).recompile_reasons
               for reason in reasons)


def test_without_autocast():
    a = torch.randn(4, 4)
    matmul = without_autocast(torch.matmul)
    assert autocast_key() == ()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_key() == (("cpu", torch.bfloat16),)
        assert torch.matmul(a, a).dtype == torch.bfloat16
        assert matmul(a, a).dtype == torch.float32
        assert run_without_autocast(torch.matmul, a, a).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")  # restored
        assert torch.matmul(a, a).dtype == torch.bfloat16
    assert matmul(a, a).dtype == torch.float32


def test_op_that_runs_only_with_autocasts_casts():
    # eager runs baddbmm(float32 bias, bfloat16, bfloat16) only because autocast casts all three
    def fn(bias, q, k):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return bias.baddbmm(q.bfloat16(), k.bfloat16(), beta=1.0, alpha=0.5).float()

    bias, q, k = torch.randn(2, 4, 4), torch.randn(2, 4, 8), torch.randn(2, 8, 4)
    torch.testing.assert_close(fulmen.jit(fn)(bias, q, k), fn(bias, q, k))


def test_bloom_training_under_autocast():
    # BLOOM: a custom autograd.Function (GeLU), and baddbmm of a float32 alibi bias
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4,
                                      hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config).train()
    jmodel = fulmen.jit(model)
    ids = torch.randint(0, 128, (2, 8))
    for enabled in (True, False, True):
        results = []
        for run in (model, jmodel):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                loss = run(ids, labels=ids).loss
                loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        (loss_eager, grads_eager), (loss_jit, grads_jit) = results
        torch.testing.assert_close(loss_jit, loss_eager, atol=1e-4, rtol=1e-4)
        for g_jit, g_eager in zip(grads_jit, grads_eager):
            torch.testing.assert_close(g_jit, g_eager, atol=1e-4, rtol=1e-3)
