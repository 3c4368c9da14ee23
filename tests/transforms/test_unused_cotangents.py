"""Outputs nobody backpropagates through get no zero-filled cotangent (issue 21).

A model called with labels returns (loss, logits) and only the loss is backpropagated: the
compiled backward for that call takes no logits cotangent and adds none into the logits'
gradient (`fulmen.transforms.unused_cotangents`). Gradients are eager's in every pattern.
"""

import torch
import torch.nn.functional as F

import fulmen


def _loss_and_logits(x, w, labels):
    logits = x @ w
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
    return loss, logits


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 4, generator=generator)
    w = torch.randn(4, 5, generator=generator)
    labels = torch.randint(0, 5, (2, 3), generator=generator)
    return x, w, labels


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def test_unused_logits_get_no_cotangent_and_grads_equal_eager():
    x, w, labels = _inputs()
    jfn = fulmen.jit(_loss_and_logits)
    ex, ew = _leaves(x, w)
    eager_loss, _ = _loss_and_logits(ex, ew, labels)
    eager_loss.backward()
    fx, fw = _leaves(x, w)
    loss, logits = jfn(fx, fw, labels)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(fx.grad, ex.grad)
    torch.testing.assert_close(fw.grad, ew.grad)
    variants = fulmen.compile_stats(jfn).last_backward_variants
    assert list(variants) == [(False, True)]
    executed = variants[(False, True)][-1]
    full = fulmen.last_backward_traces(jfn)[-1]
    logits_cotangent = full.args[-1]
    assert tuple(logits_cotangent.shape) == (2, 3, 5)
    assert logits_cotangent.name not in executed.arg_names
    assert len(executed.args) == len(full.args) - 1
    # the full backward adds the cotangent into the logits' gradient; the one executed does not
    (adder,) = [b for b in full.bsyms if logits_cotangent.name in b.input_names and not b.is_del]
    assert not any(b.sym is adder.sym for b in executed.bsyms)
    assert len(executed.bsyms) < len(full.bsyms)


def _sum_and_scaled(x, scale):
    return x.sum(), x * scale, x * float("inf")


def test_an_unused_output_does_not_turn_its_gradient_into_nan():
    # eager never runs the backward of the unused outputs; a zero cotangent times inf is nan
    x, scale = torch.randn(4), torch.full((4,), float("inf"))
    jfn = fulmen.jit(_sum_and_scaled)
    fx, ex = _leaves(x, x)
    jfn(fx, scale)[0].backward()
    _sum_and_scaled(ex, scale)[0].backward()
    torch.testing.assert_close(fx.grad, ex.grad)


def _two_inputs(x, y):
    return (x * 2).sum(), y.sin()


def test_an_input_reached_only_through_an_unused_output_gets_no_grad_as_in_eager():
    x, y = torch.randn(3), torch.randn(3)
    jfn = fulmen.jit(_two_inputs)
    fx, fy, ex, ey = _leaves(x, y, x, y)
    jfn(fx, fy)[0].backward()
    _two_inputs(ex, ey)[0].backward()
    torch.testing.assert_close(fx.grad, ex.grad)
    assert ey.grad is None and fy.grad is None


def _loss_and_stored_window(x, w, v):
    # the second output is what a model keeps in its cache (HF DeepSeek-V4's compressor
    # state): a clone of a slice along the last dimension. Its zero cotangent folds through
    # neither (the clone's VJP is torch.autograd's, the slice's zero is strided), so zeros
    # are materialized on the way to `w`
    return (x @ v).sum(), (x @ w)[..., :2].clone()


def test_an_input_reached_only_through_an_unused_output_and_unfolded_zeros_gets_no_grad():
    x, w, v = torch.randn(2, 3), torch.randn(3, 4), torch.randn(3, 4)
    jfn = fulmen.jit(_loss_and_stored_window)
    fx, fw, fv, ex, ew, ev = _leaves(x, w, v, x, w, v)
    jfn(fx, fw, fv)[0].backward()
    _loss_and_stored_window(ex, ew, ev)[0].backward()
    torch.testing.assert_close(fx.grad, ex.grad)
    torch.testing.assert_close(fv.grad, ev.grad)
    assert ew.grad is None and fw.grad is None  # zeros would be stepped by AdamW's decay


def _loss_through_an_empty_slice(x, w):
    # HF CANINE's downsampling: a 7-character input gives one molecule, which `[:, 0:-1]`
    # drops, so the convolution reaches the loss only through an empty tensor (the second
    # output, unused, stands for the logits next to the loss)
    h = torch.cat([x[:, :1], (x @ w)[:, 0:-1]], 1)
    return h.sum(), h * 2


def test_an_input_reached_through_an_empty_tensor_gets_zeros_as_in_eager():
    x, w = torch.randn(2, 3), torch.randn(3, 1)
    jfn = fulmen.jit(_loss_through_an_empty_slice)
    fx, fw, ex, ew = _leaves(x, w, x, w)
    jfn(fx, fw)[0].backward()
    _loss_through_an_empty_slice(ex, ew)[0].backward()
    torch.testing.assert_close(fx.grad, ex.grad)
    assert ew.grad is not None and fw.grad is not None  # zeros: AdamW decays it
    torch.testing.assert_close(fw.grad, ew.grad)


def test_outputs_used_through_a_view_and_in_turns_with_retain_graph_equal_eager():
    x, w, labels = _inputs(1)
    jfn = fulmen.jit(_loss_and_logits)
    grads = []
    for fn in (_loss_and_logits, jfn):
        lx, lw = _leaves(x, w)
        loss, logits = fn(lx, lw, labels)
        logits[0, 1].pow(2).sum().backward(retain_graph=True)  # the logits only, by a view
        first = (lx.grad.clone(), lw.grad.clone())
        loss.backward(retain_graph=True)  # the loss only
        second = (lx.grad.clone(), lw.grad.clone())
        (loss * 3 + logits.sum()).backward()  # both
        grads.append((*first, *second, lx.grad, lw.grad))
    for actual, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(actual, expected)
    variants = fulmen.compile_stats(jfn).last_backward_variants
    assert set(variants) == {(True, False), (False, True)}


def _with_break(x, w):
    hidden = (x @ w).tanh()
    if hidden.sum() > 0:
        out = hidden * 2
    else:
        out = hidden - 1
    return out.sum(), hidden, out


def test_unused_outputs_of_graph_break_segments_equal_eager():
    generator = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 4, generator=generator), torch.randn(4, 4, generator=generator)
    jfn = fulmen.jit(_with_break)
    for sign in (1, -1):
        fx, fw, ex, ew = _leaves(x * sign, w, x * sign, w)
        jfn(fx, fw)[0].backward()
        _with_break(ex, ew)[0].backward()
        torch.testing.assert_close(fx.grad, ex.grad)
        torch.testing.assert_close(fw.grad, ew.grad)
        fx, fw, ex, ew = _leaves(x * sign, w, x * sign, w)
        jfn(fx, fw)[1].pow(2).sum().backward()
        _with_break(ex, ew)[1].pow(2).sum().backward()
        torch.testing.assert_close(fx.grad, ex.grad)
        torch.testing.assert_close(fw.grad, ew.grad)
    assert fulmen.compile_stats(jfn).branches == 2


def test_hf_gpt2_with_labels_caches_and_hidden_states_trains_like_eager():
    transformers = __import__("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=32)).eval()
    ids = torch.randint(0, 128, (2, 16))
    jitted = fulmen.jit(model)
    grads = []
    for fn in (model, jitted):
        model.zero_grad()
        out = fn(input_ids=ids, labels=ids, use_cache=True, output_hidden_states=True)
        out.loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for actual, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(actual, expected)
    # the loss is used; the logits, key/value caches and hidden states are not
    (flags,) = fulmen.compile_stats(jitted).last_backward_variants
    assert flags[0] is False and all(flags[1:]) and len(flags) > 4


def _four_outputs(x):
    y = x * 2
    return y.sum(), y.cumsum(0), (y * 3).t(), y.sin()


def test_zeros_that_do_not_fold_are_materialized_and_grads_equal_eager():
    # cumsum's backward runs under torch.autograd and the transpose's zero would not be
    # contiguous: those statements read materialized zeros
    jfn = fulmen.jit(_four_outputs)
    x = torch.randn(3, 4)
    for used in range(4):
        fx, ex = _leaves(x, x)
        jfn(fx)[used].pow(2).sum().backward()
        _four_outputs(ex)[used].pow(2).sum().backward()
        torch.testing.assert_close(fx.grad, ex.grad)
    variants = fulmen.compile_stats(jfn).last_backward_variants
    assert len(variants) == 4
    assert all(any(b.sym.name == "full" for b in stages[0].bsyms) for stages in variants.values())


def test_a_pattern_that_fails_to_fold_materializes_the_zeros_as_autograd_did(monkeypatch):
    import fulmen.pipeline

    real = fulmen.pipeline.fold_unused_cotangents

    def failing(trace, unused, *, fold=True):
        if fold:
            raise RuntimeError("planted failure")
        return real(trace, unused, fold=fold)

    monkeypatch.setattr(fulmen.pipeline, "fold_unused_cotangents", failing)
    x, w, labels = _inputs(3)
    jfn = fulmen.jit(_loss_and_logits)
    fx, fw, ex, ew = _leaves(x, w, x, w)
    jfn(fx, fw, labels)[0].backward()
    _loss_and_logits(ex, ew, labels)[0].backward()
    torch.testing.assert_close(fx.grad, ex.grad)
    torch.testing.assert_close(fw.grad, ew.grad)
    (stages,) = fulmen.compile_stats(jfn).last_backward_variants.values()
    assert stages[0].bsyms[0].sym.name == "full"
    assert tuple(stages[0].bsyms[0].output.shape) == (2, 3, 5)



def test_the_backward_for_every_output_compiles_when_first_needed():
    """NOTE [the backward compiles when first needed] in fulmen/pipeline.py: a step whose
    logits nobody backpropagates runs only the backward without their cotangent, so the one
    for every output is not claimed at the miss; it compiles when its stages are asked for
    (or a call backpropagates both outputs), and its gradients are eager's."""
    x, w, labels = _inputs()
    jfn = fulmen.jit(_loss_and_logits)
    (jw,), (ew,) = _leaves(w), _leaves(w)
    loss, _ = jfn(x, jw, labels)
    loss.backward()
    stats = fulmen.compile_stats(jfn)
    assert "claiming by executors" in stats.stage_seconds
    assert "claiming by executors (backward)" not in stats.stage_seconds
    _loss_and_logits(x, ew, labels)[0].backward()
    torch.testing.assert_close(jw.grad, ew.grad)
    stages = [trace.provenance for trace in fulmen.last_backward_traces(jfn)]
    assert "after claiming by executors" in stages  # complete when asked for
    assert "claiming by executors (backward)" in stats.stage_seconds
    (jw,), (ew,) = _leaves(w), _leaves(w)
    loss, logits = jfn(x, jw, labels)
    (loss + logits.sum()).backward()
    loss, logits = _loss_and_logits(x, ew, labels)
    (loss + logits.sum()).backward()
    torch.testing.assert_close(jw.grad, ew.grad)
    assert fulmen.cache_misses(jfn) == 1


def test_a_backward_compiled_at_its_first_call_is_the_complete_one():
    """Without asking for its stages first, the backward for every output compiles at the
    first call that backpropagates both outputs."""
    x, w, labels = _inputs(1)
    jfn = fulmen.jit(_loss_and_logits)
    (jw,), (ew,) = _leaves(w), _leaves(w)
    loss, logits = jfn(x, jw, labels)
    assert "claiming by executors (backward)" not in fulmen.compile_stats(jfn).stage_seconds
    (loss * 2 + logits.square().sum()).backward()
    loss, logits = _loss_and_logits(x, ew, labels)
    (loss * 2 + logits.square().sum()).backward()
    torch.testing.assert_close(jw.grad, ew.grad)
    assert "claiming by executors (backward)" in fulmen.compile_stats(jfn).stage_seconds
