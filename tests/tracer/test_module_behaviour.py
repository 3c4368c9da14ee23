"""A jitted module behaves like the module it wraps: copies, pickling, state dicts, modes, hooks;
and the patterns it cannot compile fail with an error that says what to do."""

import copy
import io
import pickle

import pytest
import torch

import fulmen
from fulmen.core import FulmenError, NotYetSupportedError


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.drop(self.norm(self.linear(x)).relu()))


def _net():
    torch.manual_seed(0)
    return Net()


def _same_module(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> None:
    """`a` and `b` compute the same thing in eval and in training (same seed)."""
    a.eval(), b.eval()
    torch.testing.assert_close(a(x), b(x))
    a.train(), b.train()
    torch.manual_seed(1)
    expected = a(x)
    torch.manual_seed(1)
    torch.testing.assert_close(b(x), expected)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_compile_anew_and_are_independent(how):
    model = _net()
    jmodel = fulmen.jit(model)
    x = torch.randn(5, 6)
    jmodel(x).sum().backward()  # compiled, with a cache holding traces
    if how == "deepcopy":
        copied = copy.deepcopy(jmodel)
    elif how == "pickle":
        copied = pickle.loads(pickle.dumps(jmodel))
    else:
        buffer = io.BytesIO()
        torch.save(jmodel, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert isinstance(copied, type(jmodel))
    assert fulmen.cache_misses(copied) == 0  # compiled lazily, at the first call
    reference = copy.deepcopy(model)
    _same_module(copied, reference, x)
    assert fulmen.cache_misses(copied) == 2  # eval, train
    with torch.no_grad():  # independent parameters: the copy (an EMA model, say) moves alone
        for p in copied.parameters():
            p.mul_(0.5)
    assert not torch.equal(copied.linear.weight, model.linear.weight)
    copied.eval(), reference.eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.5)
    torch.testing.assert_close(copied(x), reference(x))


def test_copy_keeps_the_executors_and_options():
    jmodel = fulmen.jit(_net(), executors=["torch"], rematerialize=False)
    copied = copy.deepcopy(jmodel)
    copied(torch.randn(4, 6))
    assert "codegen" not in str(fulmen.last_traces(copied)[-1])


def test_state_dict_round_trips_with_the_modules_own_keys():
    model, jmodel = _net(), fulmen.jit(Net())
    assert list(jmodel.state_dict()) == list(model.state_dict())
    jmodel.load_state_dict(model.state_dict())  # eager checkpoint -> jitted
    x = torch.randn(5, 6)
    _same_module(jmodel, model, x)
    fresh = Net()
    fresh.load_state_dict(jmodel.state_dict())  # jitted checkpoint -> eager
    _same_module(fresh, model, x)
    prefixed = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    fulmen.jit(Net()).load_state_dict(prefixed)  # torch.compile's spelling loads too
    with pytest.raises(RuntimeError, match="Unexpected key"):
        jmodel.load_state_dict({**model.state_dict(), "bogus": torch.zeros(1)})


def test_named_parameters_and_buffers_have_the_modules_own_names():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    jmodel = fulmen.jit(model)
    assert [n for n, _ in jmodel.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in jmodel.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert all(p is q for p, q in zip(jmodel.parameters(), model.parameters()))
    # names from the jitted module address the same tensors in the module (optimizer groups
    # by name, functional_call, get_parameter)
    params = dict(jmodel.named_parameters())
    assert all(model.get_parameter(n) is p for n, p in params.items())
    # walking modules() with recurse=False counts each parameter once
    assert sum(p.numel() for m in jmodel.modules() for p in m.parameters(recurse=False)) \
        == sum(p.numel() for p in model.parameters())
    out = torch.func.functional_call(jmodel, {n: torch.zeros_like(p) for n, p in params.items()},
                                     (torch.randn(3, 4),))
    assert torch.equal(out, torch.zeros(3, 4))


def test_jitted_module_inside_a_parent_state_dict():
    parent = torch.nn.Sequential(fulmen.jit(_net()), torch.nn.Linear(3, 2))
    eager = torch.nn.Sequential(_net(), torch.nn.Linear(3, 2))
    assert list(parent.state_dict()) == list(eager.state_dict())
    parent.load_state_dict(eager.state_dict())
    eager.load_state_dict(parent.state_dict())


def test_train_and_eval_switch_the_compiled_program():
    model = _net()
    jmodel = fulmen.jit(model)
    x = torch.randn(5, 6)
    for mode in ("eval", "train", "eval"):
        getattr(jmodel, mode)()
        assert model.training == (mode == "train") and jmodel.training == model.training
        torch.manual_seed(2)
        actual = jmodel(x)
        torch.manual_seed(2)
        getattr(model, mode)()
        torch.testing.assert_close(actual, model(x))


def test_hooks_added_and_removed_after_jitting():
    model = _net()
    jmodel = fulmen.jit(model.eval())
    x = torch.randn(5, 6)
    plain = jmodel(x)

    def double(module, args, output):  # (no store into a list: such a call runs eagerly)
        return output * 2

    def shift(module, args):
        return (args[0] + 1,)

    handle = model.linear.register_forward_hook(double)
    torch.testing.assert_close(jmodel(x), model(x))
    pre = model.head.register_forward_pre_hook(shift)
    torch.testing.assert_close(jmodel(x), model(x))
    handle.remove()
    pre.remove()
    torch.testing.assert_close(jmodel(x), plain)
    hits = fulmen.cache_hits(jmodel)
    jmodel(x)
    assert fulmen.cache_hits(jmodel) == hits + 1  # unchanged hooks: the cache serves again
    assert fulmen.compile_stats(jmodel).eager_calls == 0  # the hooks were traced through


def test_global_module_hooks_after_jitting():
    model = _net().eval()
    jmodel = fulmen.jit(model)
    x = torch.randn(5, 6)
    jmodel(x)

    def negate_linear(module, args, output):
        return -output if isinstance(module, torch.nn.Linear) else output

    handle = torch.nn.modules.module.register_module_forward_hook(negate_linear)
    try:
        torch.testing.assert_close(jmodel(x), model(x))
    finally:
        handle.remove()
    torch.testing.assert_close(jmodel(x), model(x))


def test_hooks_on_the_jitted_module_run_eagerly():
    jmodel = fulmen.jit(_net().eval())
    calls = []
    jmodel.register_forward_hook(lambda module, args, output: calls.append(1))
    x = torch.randn(5, 6)
    jmodel(x)
    jmodel(x)
    assert calls == [1, 1] and fulmen.cache_hits(jmodel) == 1


def test_the_direct_call_path_still_runs_global_hooks_and_a_replaced_forward():
    """`JittedModule.__call__` skips `nn.Module.__call__` when that would just call the
    forward: a global module hook sees the wrapped module as in eager (not the wrapper), an
    instance `forward` still wins."""
    jmodel = fulmen.jit(_net().eval())
    x = torch.randn(5, 6)
    jmodel(x)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: seen.append(module))
    try:
        jmodel(x)
    finally:
        handle.remove()
    assert jmodel._orig_mod in seen and jmodel not in seen
    jmodel.forward = lambda x: x * 3
    torch.testing.assert_close(jmodel(x), x * 3)


def test_a_global_forward_hook_changing_outputs_is_compiled_once_per_module():
    """The same doubling global hook without a store into a list (which makes a call run
    eagerly): the compiled call applies it once per module, as eager does."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    jmodel = fulmen.jit(model)
    x = torch.randn(5, 6, requires_grad=True)
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: output * 2)
    try:
        results = []
        for fn in (model, jmodel):
            out = fn(x)
            results.append((out, torch.autograd.grad(out.sum(), x)[0]))
    finally:
        handle.remove()
    torch.testing.assert_close(results[1], results[0])
    assert fulmen.compile_stats(jmodel).eager_calls == 0


@pytest.mark.parametrize("register", ["register_module_forward_hook",
                                      "register_module_full_backward_hook",
                                      "register_module_full_backward_pre_hook"])
def test_a_global_hook_fires_once_per_module_as_in_eager(register):
    """A global module hook (forward, or either backward hook alone) fires for the wrapped
    module and its submodules as in eager, not for the `JittedModule` wrapper too: a hook that
    doubles each module's output or input gradient gave 2x eager's result under
    `fulmen.jit(model)` (the wrapper went through `nn.Module.__call__`, which ran the hook
    once more; found by h43mut's planted mutants)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    jmodel = fulmen.jit(model)
    x = torch.randn(5, 6, requires_grad=True)
    jmodel(x)

    def double(module, first, second):
        seen.append(module)
        if register == "register_module_forward_hook":
            return second * 2  # (module, args, output)
        if register == "register_module_full_backward_hook":
            return tuple(g * 2 for g in first)  # (module, grad_input, grad_output)
        return tuple(g * 2 for g in first)  # pre hook: (module, grad_output)

    results = []
    for fn in (model, jmodel):
        seen = []
        handle = getattr(torch.nn.modules.module, register)(
            double if register != "register_module_full_backward_pre_hook"
            else lambda module, grad_output: double(module, grad_output, None))
        try:
            out = fn(x)
            results.append((out, torch.autograd.grad(out.sum(), x)[0], list(seen)))
        finally:
            handle.remove()
    (want, want_grad, want_seen), (got, got_grad, got_seen) = results
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    assert got_seen == want_seen and jmodel not in got_seen


@pytest.mark.parametrize("spelling", ["method", "autograd.backward", "autograd.grad"])
def test_backward_inside_a_compiled_function_says_what_to_do_under_fullgraph(spelling):
    model = torch.nn.Linear(4, 1)

    def step(x):
        loss = model(x).square().mean()
        if spelling == "method":
            loss.backward()
        elif spelling == "autograd.backward":
            torch.autograd.backward(loss)
        else:
            return torch.autograd.grad(loss, model.weight)
        return loss

    with pytest.raises(FulmenError, match="inside a compiled function") as info:
        fulmen.jit(step, fullgraph=True)(torch.randn(3, 4))
    assert "call backward on the result" in str(info.value)
    assert "test_module_behaviour.py" in str(info.value)  # the user's line
    assert model.weight.grad is None


def _training_step(model, optimizer, x, y):
    """A whole training step as users write it under torch.compile: forward, backward,
    clipping, optimizer step, zeroing."""
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_whole_training_step_with_backward_inside_compiles_and_equals_eager():
    """(It ran eagerly before session 52: `fulmen.tracer.backward_in_trace`.) Compiled, the
    backward sums in another order than eager's, so not bit for bit; the activation comes
    before the batch norm: a linear layer's bias right before a batch norm gets a gradient of
    rounding noise only, which AdamW scales to full steps in either direction."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(),
                                torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 3))
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    step = fulmen.jit(_training_step)
    for i in range(4):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        torch.manual_seed(i)
        expected = _training_step(model, opt, x, y)
        torch.manual_seed(i)
        got = step(twin, twin_opt, x, y)
        torch.testing.assert_close(got, expected.detach())
    for mine, theirs in zip(twin.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(mine, theirs)
    assert fulmen.compile_stats(step).eager_calls == 0


def test_a_gradient_penalty_with_autograd_grad_inside_runs_eagerly():
    """WGAN-GP: torch.autograd.grad(create_graph=True) inside the jitted loss."""
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    twin = copy.deepcopy(critic)

    def loss_fn(net, real):
        real = real.requires_grad_(True)
        (grad,) = torch.autograd.grad(net(real).sum(), real, create_graph=True)
        return (grad.norm(dim=1) - 1).square().mean()

    real = torch.randn(5, 4)
    with pytest.warns(UserWarning, match="such calls run eagerly"):
        fulmen.jit(loss_fn)(twin, real.clone()).backward()
    loss_fn(critic, real.clone()).backward()
    for mine, theirs in zip(twin.parameters(), critic.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_backward_hooks_inside_run_eagerly_and_on_the_jitted_module_work():
    model = _net().eval()
    jmodel = fulmen.jit(model)
    x = torch.randn(5, 6, requires_grad=True)
    seen = []
    handle = model.linear.register_full_backward_hook(
        lambda module, grad_in, grad_out: seen.append(grad_out[0].shape))
    with pytest.warns(UserWarning, match="'linear'") as record:
        jmodel(x).sum().backward()
    assert "on the jitted module itself" in str(record[0].message)
    assert seen == [torch.Size([5, 8])] and fulmen.compile_stats(jmodel).eager_calls == 1  # the hook fired
    with pytest.raises(NotYetSupportedError, match="'linear'"):
        fulmen.jit(model, fullgraph=True)(x)
    with torch.no_grad():  # no backward, nothing to miss: compiled
        torch.testing.assert_close(jmodel(x), model(x))
    assert fulmen.compile_stats(jmodel).eager_calls == 1
    handle.remove()
    seen.clear()
    jmodel.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append("outer"))
    jmodel(x).sum().backward()
    assert seen == ["outer"] and fulmen.compile_stats(jmodel).eager_calls == 1


def test_a_parameter_set_to_none_between_calls():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    jmodel, x = fulmen.jit(model), torch.randn(3, 4)
    torch.testing.assert_close(jmodel(x), model(x))
    model[0].bias = None  # no registration hook, no dict entry added or removed
    torch.testing.assert_close(jmodel(x), model(x))
    model[0].bias = torch.nn.Parameter(torch.ones(4))
    torch.testing.assert_close(jmodel(x), model(x))


def test_forward_shows_the_wrapped_modules_signature():
    """Code that inspects `model.forward` to choose its arguments (HF `generate` passes
    `position_ids` only to a forward that takes them) sees the module's own parameters."""
    import inspect

    class Takes(torch.nn.Module):
        def forward(self, x, position_ids=None, *, scale=1.0):
            return x * scale

    jmodel = fulmen.jit(Takes())
    assert inspect.signature(jmodel.forward) == inspect.signature(Takes().forward)
    assert "position_ids" in inspect.signature(copy.deepcopy(jmodel).forward).parameters
    x = torch.randn(3)
    torch.testing.assert_close(jmodel.forward(x, scale=2.0), x * 2)
    forward = fulmen.jit(Takes()).forward  # keeps its module alive, like a bound method
    torch.testing.assert_close(forward(x), x)


class _Calls(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()

    def twice(self, x):  # as HF `generate` calls the model
        return self(x) + self.forward(x)


def test_a_method_calling_the_forward_reuses_the_programs_compiled_outside_it():
    # while the method runs, the module's `forward` is fulmen's wrapper of the compiled one;
    # `functools.wraps` gives it the module's `__module__`, and its globals (fulmen's) were
    # keyed as the user's: every call inside `generate` missed the programs compiled outside
    module = _Calls()
    jmodel = fulmen.jit(module)
    x = torch.randn(2, 4)
    with torch.no_grad():
        jmodel(x)
        torch.testing.assert_close(jmodel.twice(x), 2 * module(x))
    stats = fulmen.compile_stats(jmodel)
    assert (stats.calls, stats.cache_misses, stats.recompile_reasons) == (3, 1, [])


def test_a_replaced_submodule_or_parameter_recompiles():
    """`resize_token_embeddings`, a new head, a parameter assigned after jitting: the compiled
    program read the old ones; the next call compiles anew and answers as eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 4)
    jmodel(x)
    model[2] = torch.nn.Linear(3, 5)
    torch.testing.assert_close(jmodel(x), model(x))
    model[0].weight = torch.nn.Parameter(torch.randn(3, 4))
    torch.testing.assert_close(jmodel(x), model(x))
    del model[2]
    torch.testing.assert_close(jmodel(x), model(x))


def test_parameters_converted_in_place_recompile():
    """`model.to(dtype)` swaps each parameter's data under the same Parameter object (and the
    integer input keeps its key): the parameters' dtypes are part of the key."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3), torch.nn.GELU(),
                                torch.nn.LayerNorm(3))
    jmodel = fulmen.jit(model, executors=["codegen", "torch"])
    ids = torch.tensor([[1, 2, 3]])
    jmodel(ids)
    model.to(torch.float64)
    got, want = jmodel(ids), model(ids)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want)


def test_torch_compile_does_not_recompile_on_fulmens_registration_count():
    """fulmen counts submodule/parameter assignments with global hooks; a forward that assigns
    a submodule (as HF's output capturing does) compiled by torch.compile must not guard on
    that count (it recompiled at every call)."""
    from torch._dynamo.testing import CompileCounter

    fulmen.jit(torch.nn.Linear(2, 2))(torch.randn(1, 2))  # installs the counting hooks

    class Assigns(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

        def forward(self, x):
            self.inner = self.inner  # a module registration inside forward
            return self.inner(x)

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(Assigns(), backend=counter)
    for _ in range(3):
        compiled(torch.randn(1, 2))
    assert counter.frame_count == 1


class _Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.temperature = 1.0

    def forward(self, x):
        return self.linear(x) / self.temperature


def test_attributes_set_on_the_jitted_module_reach_the_module():
    # `jmodel.temperature = 2.0` was set on the wrapper only: the forward kept reading 1.0
    model = _Tempered()
    jitted = fulmen.jit(model)
    x = torch.randn(2, 3)
    jitted(x)
    jitted.temperature = 2.0
    assert model.temperature == 2.0 and jitted.temperature == 2.0
    torch.testing.assert_close(jitted(x), model(x))
    jitted.extra = torch.ones(1)  # a new attribute lands on the module too
    assert torch.equal(model.extra, torch.ones(1))
    del jitted.extra
    assert not hasattr(model, "extra")


@pytest.mark.parametrize("make", [lambda: torch.nn.Linear(4, 3),
                                  lambda: torch.nn.Sequential(torch.nn.Linear(4, 3),
                                                              torch.nn.ReLU(),
                                                              torch.nn.Linear(3, 2))],
                         ids=["top-level", "nested"])
def test_functional_call_on_a_jitted_module(make):
    # `torch.func.functional_call(jmodel, params, x)` (MAML, PEFT, model soups) swaps plain
    # tensors in for the parameters: it raised TypeError on top-level parameters
    torch.manual_seed(0)
    model = make()
    jitted = fulmen.jit(copy.deepcopy(model))
    x = torch.randn(2, 4)
    for scale in (2.0, 3.0):  # the second call is a hit with other tensors swapped in
        leaves = [{k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
                  for _ in range(2)]
        params = [{k: v * scale for k, v in leaf.items()} for leaf in leaves]
        expected = torch.func.functional_call(model, params[0], (x,))
        actual = torch.func.functional_call(jitted, params[1], (x,))
        torch.testing.assert_close(actual, expected)
        expected.sum().backward()
        actual.sum().backward()
        for name in leaves[0]:
            torch.testing.assert_close(leaves[1][name].grad, leaves[0][name].grad)
    # the module's own parameters are back
    assert all(isinstance(p, torch.nn.Parameter) for p in jitted.parameters())
    torch.testing.assert_close(jitted(x), model(x))


@pytest.mark.parametrize("transform", ["grad", "vmap", "jacrev"])
def test_calls_inside_torch_func_transforms_run_eagerly(transform):
    # the compiled program would run outside the transform's levels: torch.func.grad raised
    # from inside the trace; such calls run eagerly (fullgraph=True raises)
    def f(a):
        return torch.sin(a).sum() if transform == "grad" else torch.sin(a) * a

    x = torch.randn(3, 4)
    wrap = {"grad": torch.func.grad, "vmap": torch.func.vmap, "jacrev": torch.func.jacrev}[transform]
    jf = fulmen.jit(f)
    with pytest.warns(UserWarning, match="torch.func transform"):
        actual = wrap(jf)(x)
    torch.testing.assert_close(actual, wrap(f)(x))
    torch.testing.assert_close(jf(x), f(x))  # outside the transform: compiled
    assert fulmen.compile_stats(jf).cache_misses == 1
    with pytest.raises(NotYetSupportedError, match="torch.func transform"):
        wrap(fulmen.jit(f, fullgraph=True))(x)
