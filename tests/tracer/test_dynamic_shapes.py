"""Symbolic sizes (issue 16): one compilation serves every size of a dynamic dimension, and no
call ever hits an entry that is wrong for it."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import fulmen


def _program(x, y):
    h = torch.nn.functional.gelu(x @ y)
    flat = h.reshape(-1, 2).sum(-1)
    return flat.softmax(0) * x.shape[0]


def test_automatic_dynamic_compiles_twice_for_many_sizes():
    jfn = fulmen.jit(_program)
    y = torch.randn(4, 6)
    for n in (8, 5, 13, 7, 13, 21):
        x = torch.randn(n, 4)
        torch.testing.assert_close(jfn(x, y), _program(x, y))
    assert fulmen.cache_misses(jfn) == 2
    assert '"cpu f32[s' in str(fulmen.last_traces(jfn)[0])  # x's first size is a symbol


def test_dynamic_true_is_symbolic_from_the_first_call():
    jfn = fulmen.jit(_program, dynamic=True)
    for n, k in ((8, 4), (5, 6), (9, 2)):
        x, y = torch.randn(n, k), torch.randn(k, 6)
        torch.testing.assert_close(jfn(x, y), _program(x, y))
    assert fulmen.cache_misses(jfn) == 1


def test_dynamic_false_compiles_every_shape():
    jfn = fulmen.jit(_program, dynamic=False)
    y = torch.randn(4, 6)
    for n in (8, 5, 13):
        x = torch.randn(n, 4)
        torch.testing.assert_close(jfn(x, y), _program(x, y))
    assert fulmen.cache_misses(jfn) == 3


def test_mark_dynamic_and_mark_static():
    jfn = fulmen.jit(lambda x: (x * 2).sum(1), dynamic=False)
    x = torch.randn(6, 5)
    fulmen.mark_dynamic(x, 0)
    torch.testing.assert_close(jfn(x), (x * 2).sum(1))
    assert '"cpu f32[s' in str(fulmen.last_traces(jfn)[0])

    jfn = fulmen.jit(lambda x: (x * 2).sum(1), dynamic=True)
    x = torch.randn(6, 5)
    fulmen.mark_static(x, (0, 1))
    jfn(x)
    assert '"cpu f32[6, 5]"' in str(fulmen.last_traces(jfn)[0])
    with pytest.raises(IndexError):
        fulmen.mark_dynamic(x, 2)


def test_mark_dynamic_bounds_are_guarded():
    fn = lambda x: x.sum(0) * x.shape[0]  # noqa: E731
    jfn = fulmen.jit(fn, dynamic=False)
    for n in (4, 6, 9, 5, 12):
        x = torch.randn(n, 3)
        fulmen.mark_dynamic(x, 0, min=3, max=8)
        torch.testing.assert_close(jfn(x), fn(x))
    assert fulmen.cache_misses(jfn) == 3  # one symbolic entry for 3..8, then 9 and 12


def test_sizes_zero_and_one_are_specialised():
    fn = lambda x: x.sum(0) / x.shape[0]  # noqa: E731
    jfn = fulmen.jit(fn, dynamic=True)
    for n in (4, 1, 0, 7, 1):
        x = torch.randn(n, 3)
        torch.testing.assert_close(jfn(x), fn(x), equal_nan=True)
    assert fulmen.cache_misses(jfn) == 3  # sizes >= 2, 1, 0


def test_branch_on_a_size_is_guarded():
    def fn(x):
        if x.shape[0] > 6:
            return x.cumsum(0)
        return x * 3

    jfn = fulmen.jit(fn, dynamic=True)
    for n in (4, 9, 5, 12, 2):
        x = torch.randn(n)
        torch.testing.assert_close(jfn(x), fn(x))
    assert fulmen.cache_misses(jfn) == 2  # one entry per side of the branch


def test_equal_sizes_share_a_symbol_until_they_differ():
    fn = lambda x, y: x * y + x.shape[0]  # noqa: E731
    jfn = fulmen.jit(fn, dynamic=True)
    for n, m in ((4, 4), (6, 6), (5, 1), (7, 7), (3, 1), (2, 5)):
        x, y = torch.randn(n, 1), torch.randn(m)
        torch.testing.assert_close(jfn(x, y), fn(x, y))
    assert fulmen.cache_misses(jfn) <= 4


def test_training_with_a_varying_batch_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 3))
    jmodel = fulmen.jit(model)
    for n in (8, 5, 13, 7):
        x = torch.randn(n, 4)
        jmodel(x).square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).square().sum().backward()
        for got, want in zip(grads, [p.grad for p in model.parameters()]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        model.zero_grad()
    assert fulmen.cache_misses(jmodel) == 2


def _broadcasting(x, y):
    return (x * y).amax(-1) + x.mean()


def _views(x, y):
    n = x.shape[0]
    return x.view(n, -1).t().contiguous().sum(1) + y.flatten()[:1]


def _cat(x, y):
    return torch.cat([x, y.expand_as(x)], 0).softmax(-1)[:: 2]


def _squeeze(x, y):  # removes dim 0 only when it is 1: a generalised 1 must be guarded
    return x.squeeze(0).sum(-1) + y.sum(0).unsqueeze(0).expand(x.shape[0], -1).sum()


def _outer(x, y):  # (rows, 1, cols) + (1, y rows, cols): broadcasting on both sides
    return (x.unsqueeze(1) + y.unsqueeze(0)).logsumexp(1)


def _shift(x, y):  # contiguous() returns the slice itself only for one row (a causal LM's labels)
    shifted = torch.nn.functional.pad(x, (0, 1))[..., 1:].contiguous()
    return shifted.view(-1).cumsum(0) + y.sum()


PROGRAMS = [_broadcasting, _views, _cat, _squeeze, _outer, _shift]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(PROGRAMS), st.sampled_from([None, True]),
       st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4), st.booleans()),
                min_size=2, max_size=6))
def test_no_wrong_cache_hit_over_random_shapes(program, dynamic, calls):
    """Random sizes (0, 1, equal dims, broadcasting), calls alternating between them: every
    result equals eager's."""
    jfn = fulmen.jit(program, dynamic=dynamic, cache_size_limit=64)
    for rows, cols, broadcast in calls:
        x = torch.randn(rows, cols)
        y = torch.randn(1 if broadcast else rows, cols)
        if program is _cat and not broadcast:
            y = torch.randn(1, cols)
        try:
            want = program(x, y)
        except RuntimeError:
            with pytest.raises((RuntimeError, fulmen.FulmenError)):
                jfn(x, y)
            continue
        torch.testing.assert_close(jfn(x, y), want, equal_nan=True)


def test_graph_breaks_with_symbolic_sizes():
    def fn(x, mask):
        h = x.reshape(x.shape[0], -1, 2).sum(-1)
        if (mask[:, -1] == 0).all():  # a graph break, as in transformers' masking utilities
            h = h * 2
        keep = h[mask.bool()]  # a data-dependent shape
        return h.softmax(-1), keep.sum()

    jfn = fulmen.jit(fn)
    for batch, seq, last in ((2, 8, 1), (2, 5, 1), (3, 11, 0), (2, 7, 1), (3, 6, 0)):
        x = torch.randn(batch, seq * 2)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[:, -1] = last
        for got, want in zip(jfn(x, mask), fn(x, mask)):
            torch.testing.assert_close(got, want)
    assert fulmen.cache_misses(jfn) <= 3


def _tiny_llama(max_positions: int):
    """A one-layer HF Llama with random weights (the installed transformers), in eval mode."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64,
                                      vocab_size=96, max_position_embeddings=max_positions)
    return transformers.LlamaForCausalLM(config).eval()


def test_hf_llama_forward_over_sequence_lengths():
    model = _tiny_llama(max_positions=64)
    jmodel = fulmen.jit(model)
    with torch.no_grad():
        for seq in (8, 5, 11, 6):
            ids = torch.randint(0, 96, (2, seq))
            torch.testing.assert_close(jmodel(ids, use_cache=False).logits,
                                       model(ids, use_cache=False).logits)
    assert fulmen.cache_misses(jmodel) == 2


def test_generate_with_a_dynamic_cache_decodes_symbolically():
    model = _tiny_llama(max_positions=128)
    jmodel = fulmen.jit(model)
    ids = torch.randint(0, 96, (1, 6))
    want = model.generate(ids, max_new_tokens=12, do_sample=False)
    got = jmodel.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    stats = fulmen.compile_stats(jmodel)
    assert stats.cache_misses <= 3 and stats.eager_calls == 0  # prefill, decode, symbolic decode


def test_flattened_token_count_equal_to_a_weight_dim_needs_no_recompile():
    """GPT-2's Conv1D: `addmm(bias, x.view(-1, d), w)`. The bias broadcast compared the token
    count `s0*s1` with the weight dims (guards `s0*s1 != 96`), so a batch x length product equal
    to a weight dim compiled again."""
    w, bias = torch.randn(32, 96), torch.randn(96)

    def conv1d(x):
        return torch.addmm(bias, x.view(-1, x.size(-1)), w).view(*x.shape[:-1], 96)

    jfn = fulmen.jit(conv1d)
    for batch, seq in ((2, 5), (3, 7), (4, 8), (3, 32), (2, 48), (4, 24), (6, 5)):
        x = torch.randn(batch, seq, 32)
        torch.testing.assert_close(jfn(x), conv1d(x))
    assert fulmen.cache_misses(jfn) == 2


@pytest.mark.parametrize("backward", [False, True])
def test_a_batch_of_one_is_generalised_beside_a_varying_length(backward):
    """(1, s) token ids whose length varies: the batch of 1 is traced as a symbol too, so the
    batches that follow reuse the entry (two compilations, not three)."""
    torch.manual_seed(0)
    table, w = torch.randn(16, 8, requires_grad=backward), torch.randn(8, 8)

    def fn(ids):
        h = table[ids] + table[:1]  # (b, s, 8) + (1, 8)
        return (h @ w).softmax(-1).mean(1).square().sum()

    jfn = fulmen.jit(fn)
    for batch, seq in ((1, 5), (1, 8), (2, 5), (4, 11), (1, 3), (3, 2)):
        ids = torch.randint(0, 16, (batch, seq))
        got, want = jfn(ids), fn(ids)
        torch.testing.assert_close(got, want)
        if backward:
            (grad,) = torch.autograd.grad(got, table)
            torch.testing.assert_close(grad, torch.autograd.grad(want, table)[0])
    assert fulmen.cache_misses(jfn) == 2


def test_a_generalised_one_that_a_branch_depends_on_is_guarded():
    def fn(x):
        h = x.squeeze(0)  # drops the batch only when it is 1
        return h.cumsum(-1) if h.ndim == 1 else h.sum(0)

    jfn = fulmen.jit(fn)
    for shape in ((1, 5), (1, 7), (3, 7), (1, 9), (2, 4)):
        x = torch.randn(shape)
        torch.testing.assert_close(jfn(x), fn(x))


def test_a_generalised_one_that_broadcasts_is_specialised_again():
    """`(1, s, 4) @ (3, 4, 5)`: the batch of 1 broadcasts against 3, which PyTorch's kernels
    (size-oblivious about the generalised 1) cannot trace; the call is traced again with the 1
    specialised, and the length stays symbolic."""
    y = torch.randn(3, 4, 5)
    fn = lambda x: (x @ y).softmax(-1)  # noqa: E731
    jfn = fulmen.jit(fn)
    for seq in (5, 8, 11, 6):
        x = torch.randn(1, seq, 4)
        torch.testing.assert_close(jfn(x), fn(x))
    assert fulmen.cache_misses(jfn) == 2


def test_a_constant_pad_keeps_its_sizes_symbolic():
    """A causal LM loss pads `labels` (`F.pad(labels, (0, 1), value=-100)`): describing the
    pad's layout must not specialise the length (PyTorch's C++ pad reads int sizes)."""
    fn = lambda x: torch.nn.functional.pad(x, (0, 1), value=-100)[..., 1:] * 2  # noqa: E731
    jfn = fulmen.jit(fn)
    for seq in (5, 8, 11, 6):
        x = torch.randint(0, 9, (2, seq))
        torch.testing.assert_close(jfn(x), fn(x))
    assert fulmen.cache_misses(jfn) == 2


@pytest.mark.parametrize("make", [
    lambda x: torch.ones(x.shape[0], x.shape[1]),
    lambda x: torch.zeros(x.shape),
    lambda x: torch.full((x.shape[0], x.shape[1]), 3.0),
    lambda x: torch.empty(x.shape[0], x.shape[1]).fill_(2.0),
], ids=["ones", "zeros", "full", "empty"])
def test_a_factory_sized_by_a_symbolic_size_keeps_it_symbolic(make):
    """`torch.ones(batch, length)` with sizes read from an argument (HF T5 builds its decoder
    mask so): the factory's sizes stay symbols, so a decoder without a cache compiles twice
    for every length, not once per length."""
    fn = lambda x: x * make(x) + 1  # noqa: E731
    jfn = fulmen.jit(fn)
    for seq in (1, 2, 5, 8, 11):
        x = torch.randn(2, seq)
        torch.testing.assert_close(jfn(x), fn(x))
    assert fulmen.cache_misses(jfn) == 2


def test_a_constant_sliced_by_a_symbolic_size_and_a_list_index_stay_symbolic():
    """BERT slices its `position_ids` buffer by the sequence length; Falcon picks heads with a
    list index (`qkv[..., [-2]]`). Both used to specialise the length (a plain meta tensor
    cannot take a symbolic slice; the list became a tensor the fake mode refused)."""
    positions = torch.arange(64).unsqueeze(0)

    def fn(x):
        picked = x.unflatten(-1, (2, 3))[..., [-2], :].flatten(-2)
        return picked * positions[:, : x.shape[1], None]

    jfn = fulmen.jit(fn)
    for seq in (5, 9, 13, 7):
        x = torch.randn(2, seq, 6)
        torch.testing.assert_close(jfn(x), fn(x))
    assert fulmen.cache_misses(jfn) == 2


def test_a_meta_kernel_failing_on_symbolic_sizes_logs_nothing(caplog):
    """BLOOM's alibi `baddbmm`: PyTorch's meta kernel cannot describe it with symbolic sizes
    (fulmen keeps its own layout) and its fake mode logs that at ERROR with a traceback; the
    user sees nothing of it."""
    import transformers

    config = transformers.BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config).eval()
    jmodel = fulmen.jit(model)
    with caplog.at_level("WARNING"), torch.no_grad():
        for seq in (5, 9, 7):
            ids = torch.randint(1, 64, (2, seq))
            mask = torch.ones_like(ids)
            mask[1, :2] = 0
            torch.testing.assert_close(jmodel(ids, attention_mask=mask).logits,
                                       model(ids, attention_mask=mask).logits)
    assert fulmen.cache_misses(jmodel) == 2
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")], caplog.text


def test_a_hook_added_after_a_symbolic_compile_retraces():
    """A forward hook registered on a submodule after the module was compiled with symbolic
    sizes: the hook check cleared the static entries only, so the symbolic one kept serving
    calls without the hook (found by the model fuzzer)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    jmodel = fulmen.jit(model)
    for length in (3, 5):
        x = torch.randn(length, 4)
        torch.testing.assert_close(jmodel(x), model(x))
    handle = model[0].register_forward_hook(lambda module, args, out: out * 0.5)
    for length in (6, 7):
        x = torch.randn(length, 4)
        torch.testing.assert_close(jmodel(x), model(x))
    handle.remove()
    x = torch.randn(8, 4)
    torch.testing.assert_close(jmodel(x), model(x))


class _Counter:
    def __init__(self) -> None:
        self.keys = torch.ones(2)
        self.seen = 0


def _count_tokens(x, counter):
    counter.seen = counter.seen + x.shape[0]  # a size stored into an object that outlives the call
    return x * 2


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_symbolic_size_stored_into_an_object_is_the_calls_number(dynamic):
    """The object keeps the call's int, as eager's: the stored `SymInt` (`s0 + s1`) is
    evaluated from each call's sizes (NOTE [traced numbers in stores]), so the symbolic entry
    serves every call after the second."""
    jfn = fulmen.jit(_count_tokens, dynamic=dynamic)
    counter, expected = _Counter(), 0
    for n in (3, 5, 7, 5, 9):
        jfn(torch.ones(n), counter)
        expected += n
        assert type(counter.seen) is int and counter.seen == expected
    assert fulmen.compile_stats(jfn).cache_misses <= 2


def _pad_by_length(x):
    return torch.nn.functional.pad(x, (0, x.shape[0])) * 2


def test_an_op_run_for_real_with_a_symbolic_size_argument_equals_eager():
    # F.pad by a symbolic size has no meta answer, so it ran for real between segments and
    # every later call passed the symbol itself to the kernel (a RuntimeError on each call)
    jfn = fulmen.jit(_pad_by_length)
    for rows in (3, 5, 7, 4):
        x = torch.randn(rows, 6)
        torch.testing.assert_close(jfn(x), _pad_by_length(x))
    assert fulmen.compile_stats(jfn).eager_calls == 0


def _encode_or_decode(x, memory=None):
    if memory is None:
        return torch.tanh(x).sum(-1)
    return (x * memory.mean(-1)).sum(-1)


def test_a_size_that_changed_under_another_call_structure_becomes_symbolic():
    # an encoder-decoder's generate: the call with a memory (each decode step) follows a call
    # without one (the encoder); the memory's length changes only between generates, never
    # between two calls of the same structure, and must still become symbolic
    jfn = fulmen.jit(_encode_or_decode)
    for length in (7, 9, 11, 13, 5):
        x, token, memory = torch.randn(2, length), torch.randn(2, 1), torch.randn(2, length, 3)
        torch.testing.assert_close(jfn(x), _encode_or_decode(x))
        torch.testing.assert_close(jfn(token, memory), _encode_or_decode(token, memory))
    assert fulmen.cache_misses(jfn) == 4  # each structure: its first length, then symbolic


def test_a_cache_length_back_at_1_is_generalised():
    """A cache whose length goes 1, 2, 3 once per memory length (a decoder's self-attention
    cache beside its cross-attention memory): at the second memory length, the cache length 1
    was seen to grow from 1 already, so it is traced with a symbol and the entry serves the
    lengths 2 and 3 too (three compilations; four when the 1 was specialised: NOTE [a varying
    size back at 1])."""
    torch.manual_seed(0)

    def step(token, cache, memory):
        keys = torch.cat([cache, token], dim=2)  # (b, h, n + 1, d)
        scores = keys @ memory.transpose(-1, -2)  # (b, h, n + 1, m)
        return (scores.softmax(-1) @ memory).sum(2)

    jfn = fulmen.jit(step)
    for memory_length in (5, 7, 9):
        memory = torch.randn(2, 4, memory_length, 8)
        for length in (1, 2, 3):
            token, cache = torch.randn(2, 4, 1, 8), torch.randn(2, 4, length, 8)
            torch.testing.assert_close(jfn(token, cache, memory), step(token, cache, memory))
    stats = fulmen.compile_stats(jfn)
    assert stats.eager_calls == 0 and stats.cache_misses == 3, stats.recompile_reasons


def test_a_failed_trace_with_a_cache_length_at_1_drops_only_that():
    """The policy's fallback (`DynamicDims.drop_ones`): a trace with a restarted cache length
    generalised at 1 failed, so that 1 is specialised from then on, while the batch of 1 beside
    a varying size stays generalised."""
    from fulmen.tracer.shape_policy import DynamicDims

    policy, names = DynamicDims(None), ["token", "cache"]
    label = names.__getitem__
    calls = [(torch.empty(1, 1), torch.empty(1, 4, n)) for n in (1, 2, 1)]
    assert policy.dims_for(list(calls[0]), label) == {}
    assert policy.dims_for(list(calls[1]), label) == {1: (0, 2)}  # grown from 1; the batch
    assert policy.dims_for(list(calls[2]), label) == {1: (0, 2)}  # back at 1: generalised
    assert policy.drop_ones()
    assert policy.dims_for(list(calls[2]), label) == {1: (0,)}
