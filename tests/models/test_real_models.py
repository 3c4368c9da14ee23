"""Real models nobody here wrote (HF transformers, litgpt), tiny configs, random weights.

Forward: jit logits equal eager's. Training: 5 AdamW steps from the same weights give the same
losses and parameters as eager, within eager's own run-to-run noise (see `_noise_floor`).
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.tools.accuracy import assert_accurate

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
litgpt_model = pytest.importorskip("litgpt.model")
litgpt_config = pytest.importorskip("litgpt.config")

VOCAB = 96


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, hidden_size=32,
                                      intermediate_size=64, vocab_size=VOCAB,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def pythia():
    config = litgpt_config.Config.from_name("pythia-14m", vocab_size=VOCAB, padded_vocab_size=VOCAB)
    return litgpt_model.GPT(config)


def litgpt_llama():
    """litgpt's Llama architecture with grouped queries (`k.repeat_interleave(2, dim=1)`)."""
    config = litgpt_config.Config.from_name(
        "Llama-2-7b-hf", n_layer=2, n_embd=32, n_head=4, n_query_groups=2,
        intermediate_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=64)
    return litgpt_model.GPT(config)


MODELS = {"gpt2": (gpt2, "modeling_gpt2.py"), "llama": (llama, "modeling_llama.py"),
          "pythia-14m": (pythia, "model.py"), "litgpt-llama": (litgpt_llama, "model.py")}


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_logits_match_eager(name):
    make, source_file = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    jmodel = fulmen.jit(model)
    with torch.no_grad():
        expected = _logits(model(ids))
        actual = _logits(jmodel(ids))
        assert_accurate(actual, expected, lambda: _logits(copy.deepcopy(model).double()(ids)))
        _logits(jmodel(ids))
    assert fulmen.cache_hits(jmodel) == 1
    traced = str(fulmen.last_traces(jmodel)[0])
    assert f"# {source_file}:" in traced  # op groups point at the model's own source lines


def _train(model, steps: int, batches, seeds):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids, seed in zip(batches[:steps], seeds):
        optimizer.zero_grad()
        torch.manual_seed(seed)  # dropout masks (GPT-2) line up with eager's
        logits = _logits(model(ids))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _float64_losses(make, batches, seeds) -> torch.Tensor:
    """The losses of the same training run in float64: the accuracy reference."""
    torch.manual_seed(0)
    wide = make().train().double()
    return torch.tensor(_train(wide, len(batches), batches, seeds))


def _noise_floor(make, batches, seeds):
    """Per-parameter relative difference between eager runs that differ only by float32
    rounding: one with another thread count, one whose weights start one ulp away (a random
    sign per element). Five AdamW steps amplify such differences (parameters whose true
    gradient is zero, like a key bias, get pure-noise updates; tiny models are chaotic enough
    that a one-ulp start moves a small bias by ~1e-4 relative); a jitted run is held to the
    larger of the two."""
    torch.manual_seed(0)
    a = make().train()
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in c.parameters():
            signs = torch.randint(0, 2, p.shape, generator=generator) * 2 - 1
            p.mul_(1 + signs * torch.finfo(torch.float32).eps)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _train(b, len(batches), batches, seeds)
    finally:
        torch.set_num_threads(threads)
    _train(a, len(batches), batches, seeds)
    _train(c, len(batches), batches, seeds)

    def relative(pa, pb):
        return ((pa - pb).norm() / pa.norm().clamp_min(1e-12)).item()

    return [max(relative(pa, pb), relative(pa, pc))
            for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters())]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_five_adamw_steps_match_eager(name):
    make, _ = MODELS[name]
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(5)]
    seeds = list(range(100, 105))
    torch.manual_seed(0)
    eager = make().train()
    compiled = copy.deepcopy(eager)
    jmodel = fulmen.jit(compiled)

    eager_losses = _train(eager, 5, batches, seeds)
    jit_losses = _train(jmodel, 5, batches, seeds)
    assert_accurate(torch.tensor(jit_losses), torch.tensor(eager_losses),
                    lambda: _float64_losses(make, batches, seeds), what="losses")
    assert fulmen.last_backward_traces(jmodel), "training must go through fulmen's backward"
    assert fulmen.cache_misses(jmodel) == 1

    floor = _noise_floor(make, batches, seeds)
    for (pname, p_e), p_j, noise in zip(eager.named_parameters(), compiled.parameters(), floor):
        relative = ((p_j - p_e).norm() / p_e.norm().clamp_min(1e-12)).item()
        assert relative <= max(1e-4, 4 * noise), f"{pname}: {relative:.2e} (eager noise {noise:.2e})"
