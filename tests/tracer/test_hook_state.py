"""Forward hooks on a jitted module's submodules run inside the trace, so what they read and
what they store is the program's: a global or closure value they read is part of the cache key,
and a traced tensor they keep (feature extraction: `feats[name] = output`) makes the call run
eagerly, leaving real tensors there as eager does."""

import warnings

import torch

import fulmen

SCALE = 2.0


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _scale_by_global(module, args, output):
    return output * SCALE


def test_a_hook_reading_a_global_or_a_closure_value_retraces_when_it_changes():
    global SCALE
    model = _model()
    factor = [3.0]
    model[0].register_forward_hook(_scale_by_global)
    model[1].register_forward_hook(lambda module, args, output: output * factor[0])
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 3)
    try:
        torch.testing.assert_close(jmodel(x), model(x))
        SCALE = 5.0
        torch.testing.assert_close(jmodel(x), model(x))
        factor[0] = 7.0
        torch.testing.assert_close(jmodel(x), model(x))
    finally:
        SCALE = 2.0


def test_a_hook_added_after_jitting_reading_a_closure_value():
    model = _model()
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 3)
    jmodel(x)
    factor = [3.0]
    model[2].register_forward_pre_hook(lambda module, args: (args[0] * factor[0],))
    torch.testing.assert_close(jmodel(x), model(x))
    factor[0] = -1.0
    torch.testing.assert_close(jmodel(x), model(x))


class _Recorder:
    """Grad-CAM style: a bound method as the hook keeps the activation on its object."""

    def __init__(self):
        self.activation = None

    def keep(self, module, args, output):
        self.activation = output


def test_hooks_keeping_activations_leave_real_tensors_as_eager_does():
    model, twin = _model(), _model()
    feats, twin_feats = [], []
    named, twin_named = {}, {}
    recorder, twin_recorder = _Recorder(), _Recorder()
    for m, f, d, r in ((model, feats, named, recorder), (twin, twin_feats, twin_named,
                                                          twin_recorder)):
        m[0].register_forward_hook(lambda module, args, output, f=f: f.append(output))
        m[1].register_forward_hook(lambda module, args, output, d=d: d.__setitem__("a", output))
        m[2].register_forward_hook(r.keep)
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            actual = jmodel(x)
            (actual.sum() + named["a"].pow(2).sum() + feats[-1].sum()).backward()
            expected = twin(x)
            (expected.sum() + twin_named["a"].pow(2).sum() + twin_feats[-1].sum()).backward()
            torch.testing.assert_close(actual, expected)
    assert len(feats) == len(twin_feats) == 3
    assert all(type(t) is torch.Tensor for t in (*feats, named["a"], recorder.activation))
    torch.testing.assert_close(feats, twin_feats)
    torch.testing.assert_close(recorder.activation, twin_recorder.activation)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


GAIN = 2.0


def _tanh_times_gain(self, x):
    return torch.tanh(x) * GAIN


def test_a_submodule_forward_replaced_after_jitting_is_used_and_its_reads_keyed():
    """`layer.forward = patched` after jitting (a closure, a bound method, accelerate's
    `partial(new_forward, module)` wrapper): the compiled program kept the old forward, and
    a value the new one reads changed nothing."""
    global GAIN
    import functools
    import types

    model = _model()
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 3)
    jmodel(x)
    scale = [2.0]
    original = model[1].forward
    model[1].forward = lambda inputs: original(inputs) * scale[0]
    torch.testing.assert_close(jmodel(x), model(x))
    scale[0] = 5.0
    torch.testing.assert_close(jmodel(x), model(x))
    model[1].forward = types.MethodType(_tanh_times_gain, model[1])
    try:
        torch.testing.assert_close(jmodel(x), model(x))
        GAIN = 4.0
        torch.testing.assert_close(jmodel(x), model(x))
    finally:
        GAIN = 2.0

    def new_forward(module, inputs, shift):
        return original(inputs) + shift[0]

    shift = [1.0]
    model[1].forward = functools.update_wrapper(functools.partial(new_forward, model[1],
                                                                  shift=shift), original)
    torch.testing.assert_close(jmodel(x), model(x))
    shift[0] = -3.0
    torch.testing.assert_close(jmodel(x), model(x))
    del model[1].forward
    torch.testing.assert_close(jmodel(x), model(x))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.linear(x)


def test_a_class_forward_patched_after_jitting_is_used():
    """`LlamaRMSNorm.forward = patched` (or a user class's, or torch's own `nn.GELU.forward`)
    after jitting: the compiled program kept the old forward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), torch.nn.GELU(), _Block())
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 3)
    torch.testing.assert_close(jmodel(x), model(x))
    original, gelu = _Block.forward, torch.nn.GELU.forward
    try:
        _Block.forward = lambda self, x: original(self, x) * 3.0
        torch.testing.assert_close(jmodel(x), model(x))
        torch.nn.GELU.forward = lambda self, x: torch.tanh(x)
        torch.testing.assert_close(jmodel(x), model(x))
    finally:
        _Block.forward, torch.nn.GELU.forward = original, gelu
    torch.testing.assert_close(jmodel(x), model(x))
