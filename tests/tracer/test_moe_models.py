"""Tiny HF MoE models (eager experts: `torch.where` routing) and litgpt's LLaMAMoE: training
steps with AdamW and changing routing compile at most twice, never run eagerly, and equal eager
at every step (NOTE [symbolic counts at a break site] in `fulmen.tracer.break_sizes`). Slow
(3-6 s of compiling per model on the shared machine): `pytest -m slow`."""

import copy

import pytest
import torch

import fulmen


def _hf(kind: str):
    transformers = pytest.importorskip("transformers")
    from tests.sweeps.tiny_config import tiny_config

    return transformers.AutoModelForCausalLM.from_config(tiny_config(kind),
                                                         experts_implementation="eager")


def _litgpt():
    litgpt = pytest.importorskip("litgpt")
    config = litgpt.Config(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=128,
                           padded_vocab_size=128, mlp_class_name="LLaMAMoE",
                           intermediate_size=64, n_expert=4, n_expert_per_token=2, bias=False,
                           norm_class_name="RMSNorm")
    return litgpt.GPT(config)


def _loss(model, ids):
    out = model(ids)
    logits = out if torch.is_tensor(out) else out.logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "olmoe", "litgpt"])
def test_moe_training_steps_reuse_the_symbolic_counts(kind):
    torch.manual_seed(0)
    model = (_litgpt() if kind == "litgpt" else _hf(kind)).float()
    eager = copy.deepcopy(model)
    jitted = fulmen.jit(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    for _ in range(5):
        ids = torch.randint(0, 128, (2, 16))
        losses = [_loss(m, ids) for m in (jitted, eager)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1])
        for got, want in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    stats = fulmen.compile_stats(jitted)
    assert stats.graph_breaks  # routed by `torch.where` (else the test is vacuous)
    assert stats.eager_calls == 0 and len(stats.recompile_reasons) <= 1, stats.recompile_reasons
