"""Libraries asking "is this tensor traced?" (`tracer/library_flags.py`): HF's mask helpers get
yes for fulmen's proxies, so they take their value-free path instead of a graph break, with
eager's values, and the library's function is put back after every trace."""

import copy
import os
import sys
import types

import pytest
import torch

import fulmen
from fulmen.tools.accuracy import assert_accurate, to_float64
from fulmen.tracer.library_flags import answered_for_proxies


def _asks(x):
    """A helper written like HF's: read the values unless the tensor is traced."""
    module = sys.modules["transformers.masking_utils"]
    if not module.is_tracing(x) and bool((x == 1).all()):
        return None  # the shortcut: equal to `x * 1`
    return x


def test_a_proxy_is_traced_and_everything_else_asks_the_library(monkeypatch):
    calls = []

    def is_tracing(tensor=None):
        calls.append(tensor)
        return False

    fake = types.ModuleType("transformers.masking_utils")
    fake.is_tracing = is_tracing
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", fake)

    def fn(x, mask):
        kept = _asks(mask)
        return x + 0 if kept is None else x * kept

    jfn = fulmen.jit(fn)
    x = torch.randn(2, 3)
    for mask in (torch.ones(2, 3), torch.tensor([[1.0, 1, 0], [1, 1, 1]])):
        torch.testing.assert_close(jfn(x, mask), fn(x, mask))
    assert fulmen.compile_stats(jfn).graph_breaks == []  # the value question was not asked
    assert fulmen.compile_stats(jfn).cache_misses == 1
    assert fake.is_tracing is is_tracing  # put back after the trace
    assert _asks(torch.ones(2)) is None and calls  # real tensors: the library's own answer
    with answered_for_proxies():
        assert fake.is_tracing(torch.ones(2)) is False and fake.is_tracing() is False
    assert fake.is_tracing is is_tracing


def test_put_back_when_the_trace_fails(monkeypatch):
    fake = types.ModuleType("transformers.masking_utils")
    fake.is_tracing = original = lambda tensor=None: False
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", fake)
    with pytest.raises(ZeroDivisionError), answered_for_proxies():
        assert fake.is_tracing is not original
        raise ZeroDivisionError
    assert fake.is_tracing is original


def test_hf_causal_lm_has_no_graph_break_and_eager_values():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    T = pytest.importorskip("transformers")
    import transformers.masking_utils as masking

    original = masking.is_tracing
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=96, max_position_embeddings=64)).eval()
    reference = to_float64(copy.deepcopy(model))
    jmodel = fulmen.jit(model)
    ids = torch.randint(3, 96, (2, 8))
    masks = {"none padded": torch.ones_like(ids),
             "left padded": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]),
             "right padded": torch.tensor([[1] * 8, [1, 1, 1, 1, 1, 0, 0, 0]])}
    with torch.no_grad():
        for label, mask in masks.items():
            actual = jmodel(input_ids=ids, attention_mask=mask).logits
            expected = model(input_ids=ids, attention_mask=mask).logits
            exact = reference(input_ids=ids, attention_mask=mask).logits
            keep = mask.bool()  # padded query rows are not compared (eager's are arbitrary)
            assert_accurate(actual[keep], expected[keep], exact[keep], what=label)
    stats = fulmen.compile_stats(jmodel)
    assert stats.graph_breaks == [] and stats.cache_misses == 1
    assert masking.is_tracing is original
