"""litgpt paths beyond `GPT`'s forward, training step and decode (session 52): a MoE model
trained at changing lengths, and the patterns behind what went wrong there.

Tiny configs (`tests.sweeps.litgpt_sweep.tiny`), random weights; values by fulmen's float64
accuracy rule, compiles and eager calls counted."""

import copy

import pytest
import torch

import fulmen
from fulmen.tools.accuracy import assert_accurate, to_float64

litgpt_model = pytest.importorskip("litgpt.model")


def test_a_returned_slice_of_a_buffer_to_a_symbolic_length_follows_the_length():
    # `self.cos[:T]` returned from a differentiated program with a symbolic T (litgpt's rope
    # cache handed across a MoE graph break): its view was replayed with the length of the
    # compile (11), so the 13-token call got 11 rows
    table = torch.randn(64, 16)

    def rope(x, cos):
        return cos[:x.shape[1]].unsqueeze(0), x * 2

    jitted = fulmen.jit(rope)
    for length in (8, 11, 13, 5):
        x = torch.randn(2, length, requires_grad=True)
        got, doubled = jitted(x, table)
        assert torch.equal(got, table[:length].unsqueeze(0)), length
        assert torch.equal(doubled, x * 2)
    stats = fulmen.compile_stats(jitted)
    assert stats.cache_misses == 2 and stats.eager_calls == 0


def _train(model, call, data):
    out = []
    for ids, targets in data:
        model.zero_grad(set_to_none=True)
        logits = call(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        out.append([loss.detach(), logits.detach(), *[p.grad for p in model.parameters()]])
    return out


@pytest.mark.slow
def test_mixtral_trains_like_eager_at_three_lengths():
    from tests.sweeps.litgpt_sweep import VOCAB, tiny

    torch.manual_seed(0)
    model = litgpt_model.GPT(tiny("Mixtral-8x7B-v0.1"))
    twin, reference = copy.deepcopy(model), to_float64(copy.deepcopy(model))
    jitted = fulmen.jit(twin)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, VOCAB, (2, n), generator=gen),
             torch.randint(0, VOCAB, (2, n), generator=gen)) for n in (8, 11, 13)]
    assert_accurate(_train(twin, jitted, data), _train(model, model, data),
                    lambda: _train(reference, reference, data), what="mixtral train")
    assert fulmen.compile_stats(jitted).eager_calls == 0
