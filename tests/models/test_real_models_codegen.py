"""The real models of test_real_models.py (HF GPT-2 and Llama, litgpt pythia-14m; tiny configs)
with the codegen executor ahead of torch: forward logits and 5 AdamW steps match eager, and
both the forward and the backward trace contain generated kernels."""

import copy

import pytest
import torch

import fulmen
from fulmen.tools.accuracy import assert_accurate
from tests.models.test_real_models import (
    MODELS,
    VOCAB,
    _float64_losses,
    _logits,
    _noise_floor,
    _train,
)

pytestmark = pytest.mark.usefixtures("codegen_eager")

EXECUTORS = ["codegen", "torch"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_logits_match_eager_with_codegen(name):
    make, _ = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    jmodel = fulmen.jit(model, executors=EXECUTORS)
    with torch.no_grad():
        expected = _logits(model(ids))
        assert_accurate(_logits(jmodel(ids)), expected,
                        lambda: _logits(copy.deepcopy(model).double()(ids)))
    trace = str(fulmen.last_traces(jmodel)[-1])
    assert "codegen.fusion" in trace


@pytest.mark.parametrize("name", sorted(MODELS))
def test_five_adamw_steps_match_eager_with_codegen(name):
    make, _ = MODELS[name]
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(5)]
    seeds = list(range(100, 105))
    torch.manual_seed(0)
    eager = make().train()
    compiled = copy.deepcopy(eager)
    jmodel = fulmen.jit(compiled, executors=EXECUTORS)

    eager_losses = _train(eager, 5, batches, seeds)
    jit_losses = _train(jmodel, 5, batches, seeds)
    assert_accurate(torch.tensor(jit_losses), torch.tensor(eager_losses),
                    lambda: _float64_losses(make, batches, seeds), what="losses")
    assert "codegen.fusion" in str(fulmen.last_traces(jmodel)[-1])
    assert "codegen.fusion" in str(fulmen.last_backward_traces(jmodel)[-1])
    assert fulmen.cache_misses(jmodel) == 1

    floor = _noise_floor(make, batches, seeds)
    for (pname, p_e), p_j, noise in zip(eager.named_parameters(), compiled.parameters(), floor):
        relative = ((p_j - p_e).norm() / p_e.norm().clamp_min(1e-12)).item()
        assert relative <= max(1e-4, 4 * noise), f"{pname}: {relative:.2e} (eager noise {noise:.2e})"
