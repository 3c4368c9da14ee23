"""Sharp edges: layouts, zero-size and 0-d inputs, devices, recursion, threads."""

import random
import threading
import warnings

import numpy as np
import pytest
import torch

import fulmen


def f(x, y):
    return (x * y).sum(-1) + y.mean()


def test_channels_last_and_non_contiguous_inputs():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    y = torch.randn(2, 3, 4, 5)
    jfn = fulmen.jit(f)
    torch.testing.assert_close(jfn(x, y), f(x, y))
    torch.testing.assert_close(jfn(y, x), f(y, x))
    torch.testing.assert_close(jfn(x[..., ::2], y[..., ::2]), f(x[..., ::2], y[..., ::2]))


def test_zero_size_and_zero_dim_inputs():
    jfn = fulmen.jit(f)
    empty = torch.randn(0, 5)
    torch.testing.assert_close(jfn(empty, empty), f(empty, empty))
    scalar_tensor = torch.tensor(3.0)
    torch.testing.assert_close(jfn(torch.ones(4), scalar_tensor), f(torch.ones(4), scalar_tensor))
    g = fulmen.jit(lambda x, s: x * s)
    torch.testing.assert_close(g(torch.ones(2), 3.0), torch.full((2,), 3.0))
    torch.testing.assert_close(g(torch.ones(2), torch.tensor(3.0)), torch.full((2,), 3.0))
    assert fulmen.cache_misses(g) == 2  # a 0-d tensor and a Python number are different keys


def test_inputs_on_different_devices_raise_clearly():
    with pytest.raises((fulmen.FulmenError, RuntimeError), match="device"):
        fulmen.jit(lambda a, b: a + b)(torch.ones(2), torch.ones(2, device="meta"))


def test_recursive_call_of_a_jitted_function():
    @fulmen.jit
    def power(x, n):
        return x if n == 0 else x * power(x, n - 1)

    x = torch.rand(3) + 0.5
    torch.testing.assert_close(power(x, 3), x ** 4)


def test_calls_from_two_threads():
    jfn = fulmen.jit(f)
    errors, results = [], {}

    def worker(index):
        try:
            x = torch.full((8, 4), float(index))
            for _ in range(20):
                results[index] = jfn(x, x)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for index, value in results.items():
        x = torch.full((8, 4), float(index))
        torch.testing.assert_close(value, f(x, x))


def test_seeding_inside_the_function_runs_eagerly():
    def fn(x):
        torch.manual_seed(0)
        return x + torch.rand(2)

    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    with pytest.raises(fulmen.NotYetSupportedError, match="manual_seed"):
        fulmen.jit(fn, fullgraph=True)(torch.zeros(2))
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's stream is untouched
    jfn = fulmen.jit(fn)
    with pytest.warns(UserWarning, match="manual_seed"):
        first = jfn(torch.zeros(2))
    torch.testing.assert_close(jfn(torch.zeros(2)), first)  # seeded on every call, as eager
    after_jitted = torch.random.get_rng_state()
    torch.testing.assert_close(first, fn(torch.zeros(2)))
    assert torch.equal(after_jitted, torch.random.get_rng_state())


_SAVED_STATE = torch.random.get_rng_state()
_RESEEDS = {  # every spelling of setting the generator's state, each a different entry point
    "torch.random.manual_seed": lambda: torch.random.manual_seed(3),
    "torch.set_rng_state": lambda: torch.set_rng_state(_SAVED_STATE),
    "torch.random.set_rng_state": lambda: torch.random.set_rng_state(_SAVED_STATE),
}


@pytest.mark.parametrize("spelling", sorted(_RESEEDS))
def test_every_spelling_of_reseeding_inside_the_function_runs_eagerly(spelling):
    """A compiled call would not repeat the reseed, so every call after the first would draw
    other numbers than eager's (each spelling is its own Python entry point)."""
    reseed = _RESEEDS[spelling]

    def fn(x):
        reseed()
        return x + torch.rand(3)

    with pytest.raises(fulmen.NotYetSupportedError, match=spelling.rsplit(".", 1)[-1]):
        fulmen.jit(fn, fullgraph=True)(torch.zeros(3))
    jfn = fulmen.jit(fn)
    with pytest.warns(UserWarning):
        first = jfn(torch.zeros(3))
    for _ in range(2):
        torch.testing.assert_close(jfn(torch.zeros(3)), first)
    torch.testing.assert_close(first, fn(torch.zeros(3)))


def test_enable_grad_inside_a_call_made_without_grad_runs_eagerly():
    # an energy model: the input gradient computed under enable_grad even when the caller
    # evaluates under no_grad
    w = torch.randn(3, 3, requires_grad=True)

    def fn(x):
        with torch.enable_grad():
            y = (x @ w).tanh()
        return y.sum(-1)

    x = torch.randn(2, 3)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="enable_grad"):
            out = fulmen.jit(fn)(x)
        want = fn(x)
    torch.testing.assert_close(out, want)
    assert out.requires_grad == want.requires_grad


def _grad_flags(x, w):
    y = x * 2
    with torch.no_grad():
        z = y + 1
    # code branches on these (`if hidden.requires_grad and self.training: checkpoint(...)`)
    return torch.tensor([y.requires_grad, (y @ w).requires_grad, z.requires_grad,
                         y.detach().requires_grad, x.long().requires_grad])


@pytest.mark.parametrize("grad", [True, False])
def test_requires_grad_of_intermediates_answers_as_eager(grad):
    # answered False for every intermediate (the proxies' own flag)
    x, w = torch.randn(2, 2, requires_grad=True), torch.randn(2, 2)
    with torch.set_grad_enabled(grad):
        assert torch.equal(fulmen.jit(_grad_flags)(x, w), _grad_flags(x, w))


class _LayerDrop(torch.nn.Module):
    """Skips its layer at random in training, drawing as HF wav2vec2 does (`np.random`) or with
    Python's `random`."""

    def __init__(self, draw):
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)
        self.draw = draw

    def forward(self, x):
        if self.training and self.draw() < 0.5:
            return x
        return self.layer(x)


@pytest.mark.parametrize("seed, draw", [(random.seed, random.random),
                                        (np.random.seed, np.random.random)])
def test_draws_from_python_and_numpy_generators_are_not_baked_in(seed, draw):
    # every call repeated the decision drawn while tracing
    model = _LayerDrop(draw)
    jitted = fulmen.jit(model)
    x = torch.randn(2, 3)
    seed(0)
    want = [torch.equal(model(x), x) for _ in range(12)]
    seed(0)
    with pytest.warns(UserWarning, match="random generator"):
        got = [torch.equal(jitted(x), x) for _ in range(12)]
    assert got == want and 0 < sum(want) < 12
    model.eval()  # no draws: compiled
    torch.testing.assert_close(jitted(x), model(x))
    assert fulmen.compile_stats(jitted).cache_misses >= 1
    assert fulmen.compile_stats(jitted).eager_calls == 12


@pytest.mark.parametrize("seed, draw", [(random.seed, random.random),
                                        (np.random.seed, np.random.random)])
def test_a_call_that_seeds_a_host_generator_keeps_eagers_state(seed, draw):
    # HF BigBird seeds NumPy's generator and draws on every call: traced right after an eager
    # call, the generator ended where it started, the draw went unseen and the compiled calls
    # left the generator alone, so the user's later draws differed from eager's
    def fn(x):
        seed(3)
        return x * (1 + draw())

    x = torch.randn(3)
    fn(x)
    jitted = fulmen.jit(fn)
    with pytest.warns(UserWarning, match="random generator"):
        jitted(x)
    draw()
    jitted(x)
    got = draw()
    fn(x)
    draw()
    fn(x)
    assert got == draw()


def _fresh_generator_noise(x):
    generator = torch.Generator().manual_seed(0)  # the same noise on every eager call
    return x + torch.randn(x.shape, generator=generator)


def _noise_from(x, generator):
    return x + torch.rand(x.shape, generator=generator)


_MODULE_GENERATOR = torch.Generator()


def _module_generator_noise(x):
    return x * torch.rand(x.shape, generator=_MODULE_GENERATOR)


def test_generators_made_inside_or_read_from_globals_are_not_baked_in():
    # the compiled program kept drawing from the generator made while tracing: each call
    # gave new noise where eager gives the same
    x = torch.zeros(3)
    jitted = fulmen.jit(_fresh_generator_noise)
    with pytest.warns(UserWarning, match="torch.Generator that is not one of its arguments"):
        for _ in range(3):
            torch.testing.assert_close(jitted(x), _fresh_generator_noise(x))
    assert fulmen.compile_stats(jitted).eager_calls == 3
    jitted = fulmen.jit(_module_generator_noise)
    _MODULE_GENERATOR.manual_seed(1)
    with pytest.warns(UserWarning, match="torch.Generator"):
        got = [jitted(x + 1) for _ in range(3)]
    _MODULE_GENERATOR.manual_seed(1)
    torch.testing.assert_close(got, [_module_generator_noise(x + 1) for _ in range(3)])


def test_generator_arguments_are_compiled_and_drawn_at_run_time():
    x = torch.zeros(3)
    jitted = fulmen.jit(_noise_from)
    for seed in (1, 2, 1):
        got = [jitted(x, torch.Generator().manual_seed(seed)) for _ in range(2)]
        want = [_noise_from(x, torch.Generator().manual_seed(seed)) for _ in range(2)]
        torch.testing.assert_close(got, want)
    shared, twin = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    torch.testing.assert_close([jitted(x, shared) for _ in range(3)],
                               [_noise_from(x, twin) for _ in range(3)])
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_vmap_inside_is_emulated_or_runs_the_call_eagerly():
    """HF's mask utilities vmap a mask function over index tensors when a model adds its own
    (T5Gemma2's sliding bidirectional window): an elementwise mapped function is emulated by
    broadcasting (`fulmen.tracer.vmap`); one broadcasting would get wrong (a reduction of the
    mapped row) runs eagerly, with eager's values, and raises under fullgraph=True."""

    def masked(x, padding):
        keep = torch.vmap(lambda row, pad: (row > 0) & pad, in_dims=(0, 0))(x, padding)
        return torch.where(keep, x, x.sum()), keep

    def centred(x):
        return torch.vmap(lambda row: row - row.mean())(x)

    x, padding = torch.randn(4, 5), torch.rand(4, 5) > 0.3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            for actual, expected in zip(fulmen.jit(masked)(x, padding), masked(x, padding)):
                torch.testing.assert_close(actual, expected)
    with pytest.warns(UserWarning, match="torch.vmap over traced tensors"):
        torch.testing.assert_close(fulmen.jit(centred)(x), centred(x))
    with pytest.raises(fulmen.NotYetSupportedError, match="not elementwise"):
        fulmen.jit(centred, fullgraph=True)(x)


def test_formatting_a_traced_tensor_gives_eagers_text():
    """`self[f"expert_{idx[0]}"]` (HF Switch Transformers picks an expert by a 0-d index
    tensor): formatting a traced tensor is a value-dependent question, answered as eager."""
    experts = {f"expert_{i}": float(i + 1) for i in range(3)}

    def route(x, picked):
        out = torch.zeros_like(x)
        for idx in picked.nonzero():
            out = out + x * experts[f"expert_{idx[0]}"] + len(f"{x.sum():.3f}")
        return out

    jitted, x = fulmen.jit(route), torch.randn(4)
    for picked in (torch.tensor([0, 1, 1]), torch.tensor([1, 0, 1]), torch.tensor([0, 1, 1])):
        torch.testing.assert_close(jitted(x, picked), route(x, picked))


def test_a_module_moved_to_its_own_dtype_inside_the_forward():
    """`self.classifier = self.classifier.to(self.dtype)` in a forward (HF Switch Transformers'
    router): `nn.Module._apply` sets `p.data = p` and reads `p.grad`, no-ops fulmen compiles."""

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = torch.nn.Linear(4, 3)

        def forward(self, x):
            self.classifier = self.classifier.to(torch.float32)
            return self.classifier(x).softmax(-1)

    model, x = Router(), torch.randn(2, 4)
    jitted = fulmen.jit(model)
    jitted(x).sum().backward()
    expected = model(x)
    torch.testing.assert_close(jitted(x), expected)
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_setting_data_to_another_tensor_is_not_dropped():
    """`p.data = t` with another tensor changes what later code reads: never a no-op."""
    weight = torch.nn.Parameter(torch.ones(3))

    def reset(x):
        weight.data = x * 2
        return weight * 1

    x = torch.arange(3.0)
    with pytest.warns(UserWarning, match="__set__"):
        out = fulmen.jit(reset)(x)
    torch.testing.assert_close(out, x * 2)
    torch.testing.assert_close(weight.detach(), x * 2)


def test_an_attribute_stored_on_a_tensor_runs_the_call_eagerly():
    # eager keeps `w.last_input` on the caller's tensor; a compiled call dropped it silently
    def fn(x, w):
        y = x * 2
        w.last_input = y
        return (y * w).sum()

    w = torch.ones(2)
    with pytest.warns(UserWarning, match="'last_input'"):
        fulmen.jit(fn)(torch.full((2,), 3.0), w)
    assert type(w.last_input) is torch.Tensor and w.last_input.tolist() == [6.0, 6.0]


@pytest.mark.parametrize("make", [
    lambda x: torch.ones(x.size(), dtype=int) - x,  # HF BigBird's question mask
    lambda x: torch.zeros(3, dtype=float) + x,
    lambda x: torch.full((3,), 1, dtype=bool) & (x > 0),
    lambda x: x.new_ones(3, dtype=int) * x,
    lambda x: torch.ones_like(x, dtype=complex) * 2,
    lambda x: torch.arange(3, dtype=float) + x,
    lambda x: (torch.zeros(3, dtype=int).dtype, x + 1),
], ids=["ones", "zeros", "full", "new_ones", "ones_like", "arange", "dtype_read"])
def test_a_python_type_as_dtype_means_what_torch_makes_of_it(make):
    x = torch.arange(3)
    expected = make(x)
    actual = fulmen.jit(make)(x)
    if isinstance(expected, tuple):
        assert actual[0] is expected[0]
        expected, actual = expected[1], actual[1]
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected)


def test_a_branch_on_the_conjugate_or_negative_bit_takes_eagers_path():
    # a proxy carries neither lazy bit and the key does not tell `z.conj()` from `z`: the traced
    # answer was False, and the conjugate argument got the other branch's value
    def pick(z):
        if z.is_conj():
            return z.resolve_conj() * 2
        return z * 3

    def sign(x):
        return x * (2 if x.is_neg() else 3)

    z = torch.randn(5, dtype=torch.complex64)
    jpick, jsign = fulmen.jit(pick), fulmen.jit(sign)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the calls run eagerly, warning once)
        for value in (z.conj(), z, z.conj()):
            torch.testing.assert_close(jpick(value), pick(value))
        for value in (z.conj().imag, z.imag):
            torch.testing.assert_close(jsign(value), sign(value))


def test_isinstance_of_a_parameter_argument_is_eagers():
    # an argument that is an `nn.Parameter` was traced as a plain tensor and keyed as one: the
    # branch on `isinstance(w, nn.Parameter)` took the other path, for Parameters and tensors
    def scale(w, x, shift):  # (a number among the arguments: no key of plain tensors alone)
        return w * (2 if isinstance(w, torch.nn.Parameter) else 3) + x + shift

    def parameter(t):
        return torch.nn.Parameter(t, requires_grad=False)  # keyed as the plain tensor but for it

    jscale = fulmen.jit(scale)
    x = torch.ones(3)
    for make in (parameter, lambda t: t, parameter, lambda t: t):
        w = make(torch.ones(3))
        torch.testing.assert_close(jscale(w, x, 0.5), scale(w, x, 0.5))
    jdynamic = fulmen.jit(scale, dynamic=True)  # the key with symbolic sizes tells them apart too
    for n in (3, 4, 5):
        for make in (parameter, lambda t: t):
            w = make(torch.ones(n))
            torch.testing.assert_close(jdynamic(w, torch.ones(n), 0.5), scale(w, torch.ones(n), 0.5))
    holder = type("Holder", (), {})()  # a plain object holding it: its tensors are inputs too

    def held(h, shift):
        return scale(h.w, h.x, shift)

    jheld = fulmen.jit(held)
    for make in (parameter, lambda t: t, parameter):
        holder.w, holder.x = make(torch.ones(3)), x
        torch.testing.assert_close(jheld(holder, 0.5), held(holder, 0.5))


class _Doubling(torch.Tensor):
    """A tensor subclass whose `__torch_function__` doubles every sum taken of it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is torch.Tensor.sum else out


def test_an_argument_with_its_own_torch_function_runs_eagerly():
    # it was traced as a plain tensor (its hook saw no call) and keyed as one: the sum was not
    # doubled, and a plain tensor's entry served it
    def total(x, shift):
        return x.sum() + shift

    jtotal = fulmen.jit(total)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the calls run eagerly, warning once)
        for x in (torch.ones(3), torch.ones(3).as_subclass(_Doubling), torch.ones(3)):
            torch.testing.assert_close(jtotal(x, 0.5), total(x, 0.5))
        holder = type("Holder", (), {})()
        jheld = fulmen.jit(lambda h: total(h.x, 0.5))
        for x in (torch.ones(3), torch.ones(3).as_subclass(_Doubling)):
            holder.x = x
            torch.testing.assert_close(jheld(holder), total(x, 0.5))
