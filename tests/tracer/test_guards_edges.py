"""Cache keys tell apart what eager tells apart: 0.0 and -0.0 (a sign that `math.copysign`
or a division bakes into the trace), as arguments and as globals read; and everything else the
traced code reads besides its arguments, changed between calls: globals read by called
functions and by methods of held objects, config objects and their nested dataclasses, nested
dicts, a user's config module, private attributes of a user's module, dtypes, enums, functions
and sizes in globals, a partial's bound arguments (each was silently stale once)."""

import dataclasses
import enum
import functools
import math

import numpy as np
import pytest
import torch

import fulmen
from fulmen.tracer.explain import explain_change
from fulmen.tracer.leaf_keys import _leaf_key

SIGN = 0.0


def _signed(x, s):
    return x * math.copysign(1.0, s)


def test_signed_zero_arguments_get_separate_cache_entries():
    jfn = fulmen.jit(_signed)
    x = torch.ones(3)
    torch.testing.assert_close(jfn(x, 0.0), _signed(x, 0.0))
    torch.testing.assert_close(jfn(x, -0.0), _signed(x, -0.0))
    assert fulmen.compile_stats(jfn).cache_misses == 2


def test_signed_zero_global_is_guarded():
    global SIGN

    def fn(x):
        return x * math.copysign(1.0, SIGN)

    jfn = fulmen.jit(fn)
    x = torch.ones(2)
    try:
        SIGN = 0.0
        torch.testing.assert_close(jfn(x), fn(x))
        SIGN = -0.0
        torch.testing.assert_close(jfn(x), fn(x))
    finally:
        SIGN = 0.0


def test_signed_zero_added_to_a_negative_zero_tensor():
    def fn(x, s):
        return x + s

    jfn = fulmen.jit(fn)
    x = torch.tensor([-0.0])
    for s in (0.0, -0.0):
        assert torch.equal(jfn(x, s).signbit(), fn(x, s).signbit())


def test_keys_of_equal_and_distinct_floats():
    assert _leaf_key(0.0) != _leaf_key(-0.0)
    assert _leaf_key(math.nan) == _leaf_key(float("nan"))
    assert _leaf_key(1.5) == _leaf_key(1.5)
    assert _leaf_key(0.0) != _leaf_key(0)
    assert _leaf_key(complex(0.0, -0.0)) != _leaf_key(complex(0.0, 0.0))


def test_recompile_reason_names_the_sign_of_zero():
    assert explain_change({"s": 0.0}, {"s": -0.0}) == ["s changed from 0.0 to -0.0"]


SHIFT = torch.ones(3)
SETTINGS = {"scale": 2.0}


def _reads_globals(x):
    return x * SHIFT * SETTINGS["scale"]


def test_a_global_tensor_rebound_or_a_global_dict_changed_retraces():
    """The program captured the tensor object `SHIFT` named and baked in `SETTINGS["scale"]`:
    a new tensor bound to the name, or a new value in the dict, must not reuse it."""
    global SHIFT
    jfn = fulmen.jit(_reads_globals)
    x = torch.randn(3)
    try:
        torch.testing.assert_close(jfn(x), _reads_globals(x))
        SHIFT = torch.full((3,), 3.0)
        torch.testing.assert_close(jfn(x), _reads_globals(x))
        SHIFT.mul_(2)  # in place: the captured tensor is read by reference
        torch.testing.assert_close(jfn(x), _reads_globals(x))
        SETTINGS["scale"] = 5.0
        torch.testing.assert_close(jfn(x), _reads_globals(x))
    finally:
        SHIFT, SETTINGS["scale"] = torch.ones(3), 2.0


def test_closure_lists_and_module_attributes_are_guarded():
    weights = [1.0, 2.0]

    def fn(x):
        return x * weights[0] + weights[-1]

    jfn = fulmen.jit(fn)
    x = torch.randn(3)
    torch.testing.assert_close(jfn(x), fn(x))
    weights[0] = 10.0
    torch.testing.assert_close(jfn(x), fn(x))
    weights.append(7.0)
    torch.testing.assert_close(jfn(x), fn(x))

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.factor = torch.tensor(2.0)  # a plain attribute, not a buffer
            self.table = {"k": 1.0}

        def forward(self, x):
            return self.lin(x) * self.factor * self.table["k"]

    model = Scaled()
    jmodel = fulmen.jit(model)
    torch.testing.assert_close(jmodel(x), model(x))
    model.factor = torch.tensor(5.0)
    torch.testing.assert_close(jmodel(x), model(x))
    model.table["k"] = 4.0
    torch.testing.assert_close(jmodel(x), model(x))


FACTOR = 2.0


def _helper(x):
    return x * FACTOR


class _UsesHelper(torch.nn.Module):
    def forward(self, x):
        return _helper(x) + 1


def test_globals_read_by_called_functions_and_submodules_are_guarded():
    """`FACTOR` is read by a helper the jitted code calls, not by the jitted code itself."""
    global FACTOR
    jfn = fulmen.jit(lambda x: _helper(x) - 1)
    outer = torch.nn.Sequential(_UsesHelper())
    jmodel = fulmen.jit(outer)
    x = torch.ones(2)
    try:
        jfn(x), jmodel(x)
        FACTOR = 5.0
        torch.testing.assert_close(jfn(x), _helper(x) - 1)
        torch.testing.assert_close(jmodel(x), outer(x))
    finally:
        FACTOR = 2.0


def test_a_config_object_held_by_a_module_is_guarded():
    """`self.config.scale` / `self.config.flag` read in forward: changing the config after a
    call retraces (HF modules read their `PretrainedConfig` the same way)."""
    import types

    class Configured(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x) * self.config.scale + (1.0 if self.config.flag else 0.0)

    config = types.SimpleNamespace(scale=2.0, flag=True)
    model = Configured(config)
    jmodel = fulmen.jit(model)
    x = torch.ones(1, 2)
    torch.testing.assert_close(jmodel(x), model(x))
    config.scale, config.flag = 5.0, False
    torch.testing.assert_close(jmodel(x), model(x))


ARGS = None  # a script's argparse namespace, set by the test


def _scaled_by_global_config(x):
    return x / ARGS.temperature * (2.0 if ARGS.double else 1.0)


def test_a_config_object_read_from_a_global_or_a_closure_is_guarded():
    """`args.temperature` of a global argparse namespace, a dataclass config in a closure:
    changing an attribute after a call retraces (they were not keyed: stale results)."""
    import argparse
    import dataclasses

    global ARGS
    ARGS = argparse.Namespace(temperature=1.0, double=False)
    jfn = fulmen.jit(_scaled_by_global_config)
    x = torch.ones(2)
    for temperature, double in ((1.0, False), (2.0, False), (2.0, True), (1.0, False)):
        ARGS.temperature, ARGS.double = temperature, double
        torch.testing.assert_close(jfn(x), _scaled_by_global_config(x))

    @dataclasses.dataclass
    class Config:
        scale: float = 1.0

    config = Config()

    def closure(x):
        return x * config.scale

    jclosure = fulmen.jit(closure)
    for scale in (1.0, 3.0, 1.0):
        config.scale = scale
        torch.testing.assert_close(jclosure(x), closure(x))


_SETTINGS_MODULE = '''
SCALE = 1.0
FLAGS = {"relu": True}
OFFSET = 0.0


def shift(x):
    return x + OFFSET


class Scaler:
    def apply(self, x):
        return x * GAIN


GAIN = 1.0
'''


def test_attributes_of_a_users_config_module_are_guarded(tmp_path, monkeypatch):
    """`import settings; settings.SCALE` and `settings.FLAGS["relu"]` read by the traced code,
    and the globals of a function it calls through the module (`settings.shift`), changed
    between calls: retraced (they were not keyed: stale results)."""
    import importlib

    (tmp_path / "fulmen_test_settings.py").write_text(_SETTINGS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = importlib.import_module("fulmen_test_settings")

    def fn(x):
        y = settings.shift(x * settings.SCALE)
        return y.relu() if settings.FLAGS["relu"] else y

    jfn, x = fulmen.jit(fn), torch.randn(5)
    for change in (None, "SCALE", "FLAGS", "OFFSET"):
        if change == "SCALE":
            settings.SCALE = -3.0
        elif change == "FLAGS":
            settings.FLAGS["relu"] = False
        elif change == "OFFSET":
            settings.OFFSET = 10.0
        torch.testing.assert_close(jfn(x), fn(x), msg=f"after changing {change}")


def test_globals_read_by_methods_of_objects_the_code_holds_are_guarded(tmp_path, monkeypatch):
    """`self.helper.apply(x)` and a closed-over `scaler.apply(x)`, whose method reads its
    module's global `GAIN`: changed between calls, retraced (the methods of plain objects were
    not scanned for the globals they read)."""
    import importlib

    (tmp_path / "fulmen_test_scalers.py").write_text(_SETTINGS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    scalers = importlib.import_module("fulmen_test_scalers")

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.helper = scalers.Scaler()

        def forward(self, x):
            return self.helper.apply(x) - 1

    scaler = scalers.Scaler()

    def closure(x):
        return scaler.apply(x) + 1

    model, x = Holder(), torch.randn(3)
    jmodel, jclosure = fulmen.jit(model), fulmen.jit(closure)
    for gain in (1.0, -2.0):
        scalers.GAIN = gain
        torch.testing.assert_close(jmodel(x), model(x))
        torch.testing.assert_close(jclosure(x), closure(x))


def test_the_bound_arguments_of_a_jitted_partial_are_guarded():
    import functools

    scaled = functools.partial(lambda x, k: x * k, k=2.0)
    jfn, x = fulmen.jit(scaled), torch.randn(3)
    torch.testing.assert_close(jfn(x), scaled(x))
    scaled.keywords["k"] = 7.0
    torch.testing.assert_close(jfn(x), scaled(x))


NESTED = {"model": {"act": "relu", "sizes": [1.0, 2.0]}}


def _nested_config(x):
    y = x * NESTED["model"]["sizes"][1]
    return y.relu() if NESTED["model"]["act"] == "relu" else y.tanh()


def test_a_nested_config_dict_changed_in_place_retraces():
    jfn, x = fulmen.jit(_nested_config), torch.randn(4)
    try:
        torch.testing.assert_close(jfn(x), _nested_config(x))
        NESTED["model"]["act"] = "tanh"  # the inner dict, not the global, changes
        torch.testing.assert_close(jfn(x), _nested_config(x))
        NESTED["model"]["sizes"][1] = -3.0  # two levels in
        torch.testing.assert_close(jfn(x), _nested_config(x))
    finally:
        NESTED["model"] = {"act": "relu", "sizes": [1.0, 2.0]}


@dataclasses.dataclass
class _Attention:
    scale: float = 1.0
    act: str = "relu"


@dataclasses.dataclass
class _ModelConfig:
    attention: _Attention
    sizes: list


def test_a_nested_config_object_changed_in_place_retraces():
    """`self.cfg.attention.scale` (a dataclass inside a dataclass) and `self.cfg.sizes[1]`
    read by a jitted module, changed in place between calls: retraced (the key looked one
    level into the module's config object)."""

    class Configured(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = _ModelConfig(_Attention(), [1.0, 2.0])

        def forward(self, x):
            y = x * self.cfg.attention.scale * self.cfg.sizes[1]
            return y.relu() if self.cfg.attention.act == "relu" else y.tanh()

    model = Configured()
    jmodel, x = fulmen.jit(model), torch.randn(4)
    for change in (None, "scale", "act", "sizes"):
        if change == "scale":
            model.cfg.attention.scale = -3.0
        elif change == "act":
            model.cfg.attention.act = "tanh"
        elif change == "sizes":
            model.cfg.sizes[1] = 5.0
        torch.testing.assert_close(jmodel(x), model(x), msg=f"after changing {change}")


class _Mode(enum.Enum):
    DOUBLE = 1
    TRIPLE = 2


DTYPE = torch.float32
MODE = _Mode.DOUBLE
ACT = torch.relu
SHAPE = torch.Size([2, 2])


def _reads_atoms(x):
    y = x.to(DTYPE)
    y = y * 2 if MODE is _Mode.DOUBLE else y * 3
    return ACT(y).reshape(SHAPE)


def test_globals_holding_dtypes_enums_functions_and_sizes_are_guarded():
    """A global dtype, enum member, activation function or `torch.Size` rebound between
    calls: retraced (they were not keyed: the old dtype, branch, function or shape)."""
    global DTYPE, MODE, ACT, SHAPE
    jfn, x = fulmen.jit(_reads_atoms), torch.randn(4)
    try:
        for name, value in (("none", None), ("DTYPE", torch.float64), ("MODE", _Mode.TRIPLE),
                            ("ACT", torch.tanh), ("SHAPE", torch.Size([4]))):
            if name != "none":
                globals()[name] = value
            got, want = jfn(x), _reads_atoms(x)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            torch.testing.assert_close(got, want, msg=f"after changing {name}")
    finally:
        DTYPE, MODE, ACT, SHAPE = torch.float32, _Mode.DOUBLE, torch.relu, torch.Size([2, 2])


class _Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._temperature = 1.0  # private, set by the user between calls
        self._mode = "plain"

    def forward(self, x):
        y = x / self._temperature
        return y if self._mode == "plain" else y.softmax(-1)


def test_private_attributes_of_a_users_module_are_guarded():
    model = _Tempered()
    jmodel, x = fulmen.jit(model), torch.randn(2, 4)
    torch.testing.assert_close(jmodel(x), model(x))
    model._temperature = 0.5
    torch.testing.assert_close(jmodel(x), model(x))
    model._mode = "softmax"
    torch.testing.assert_close(jmodel(x), model(x))


def test_a_logger_used_inside_does_not_retrace():
    """A logger is keyed by its attributes, not by the levels its `_cache` fills in as it is
    asked (and empties on any `setLevel`): that would recompile on logging alone."""
    import logging

    log = logging.getLogger("fulmen_test_quiet")  # closed over: an object the code reads

    def fn(x):
        if log.isEnabledFor(logging.DEBUG):
            log.debug("never")
        return x * 2

    jfn, x = fulmen.jit(fn), torch.randn(3)
    jfn(x)
    log.isEnabledFor(logging.INFO)  # fills its `_cache`
    logging.getLogger("fulmen_test_other").setLevel(logging.WARNING)  # clears every `_cache`
    jfn(x)
    jfn(x)
    assert fulmen.compile_stats(jfn).cache_misses == 1, fulmen.compile_stats(jfn).recompile_reasons


class _NoCopy:
    def __deepcopy__(self, memo):
        raise TypeError("cannot copy _NoCopy")


def test_a_store_that_cannot_be_rebuilt_runs_eagerly():
    class Holder:
        def __init__(self):
            self.handle, self.calls = None, 0

    holder = Holder()

    def fn(x):
        holder.handle = _NoCopy()  # a compiled call could not rebuild it (it crashed)
        holder.calls += 1
        return x * 2

    jfn = fulmen.jit(fn)
    with pytest.warns(UserWarning, match="cannot be copied"):
        jfn(torch.ones(2))
    jfn(torch.ones(2))
    assert holder.calls == 2 and isinstance(holder.handle, _NoCopy)


class _ScaledBase(torch.nn.Module):
    SCALE = 1.0  # a class attribute of the module's base class


class _Scaled(_ScaledBase):
    def forward(self, x):
        return x * self.SCALE


def test_class_attributes_of_a_modules_base_class_are_guarded():
    model = _Scaled()
    jmodel, x = fulmen.jit(model), torch.randn(3)
    try:
        torch.testing.assert_close(jmodel(x), model(x))
        _ScaledBase.SCALE = -2.0
        torch.testing.assert_close(jmodel(x), model(x))
    finally:
        _ScaledBase.SCALE = 1.0


ALPHA = 1.0


def _times_alpha(t):
    return t * ALPHA


_ACTIVATIONS = {"scaled": lambda t: t * ALPHA}


BETA = 1.0


@functools.cache
def _factor(n):
    return n * BETA  # read by nothing else


def _apply(x, fn):
    return fn(x)


def _from_table(x):
    return _ACTIVATIONS["scaled"](x) + x * _factor(2)


def test_globals_read_by_functions_given_held_in_dicts_or_cached_are_guarded():
    """A function passed as an argument and one held in a global dict, reading the global
    `ALPHA`, and one wrapped by `functools.cache` reading `BETA`: changed between calls (and
    the cache cleared), retraced (their globals were not scanned: stale results)."""
    global ALPHA, BETA
    japply, jtable, x = fulmen.jit(_apply), fulmen.jit(_from_table), torch.randn(3)
    try:
        for alpha, beta in ((1.0, 1.0), (-4.0, 1.0), (-4.0, 3.0)):
            ALPHA, BETA = alpha, beta
            _factor.cache_clear()
            torch.testing.assert_close(japply(x, _times_alpha), _apply(x, _times_alpha))
            torch.testing.assert_close(jtable(x), _from_table(x))
    finally:
        ALPHA = BETA = 1.0
        _factor.cache_clear()


class _Options:
    SCALE = 1.0  # a class attribute read through an argument object

    def __init__(self):
        self.bias = 0.0


def _with_options(x, options):
    return x * options.SCALE + options.bias


def test_class_attributes_read_through_an_argument_object_are_guarded():
    jfn, options, x = fulmen.jit(_with_options), _Options(), torch.randn(3)
    try:
        torch.testing.assert_close(jfn(x, options), _with_options(x, options))
        _Options.SCALE = 3.0
        torch.testing.assert_close(jfn(x, options), _with_options(x, options))
    finally:
        _Options.SCALE = 1.0


RUNNING = {"loss": None}
HISTORY = []


def _records(x):
    loss = (x * 2).sum()
    RUNNING["loss"] = loss  # a traced tensor stored into a global dict
    HISTORY.append(loss)
    return loss


def test_a_traced_tensor_stored_into_a_global_container_runs_eagerly():
    """Stores into global containers are not replayed: such a call left a `TensorProxy` in the
    user's dict and list. It now runs eagerly, and the containers hold real tensors."""
    jfn, x = fulmen.jit(_records), torch.ones(3)
    try:
        with pytest.warns(UserWarning, match="global"):
            jfn(x)
        jfn(x)
        assert type(RUNNING["loss"]) is torch.Tensor and RUNNING["loss"].item() == 6.0
        assert len(HISTORY) == 2 and all(type(t) is torch.Tensor for t in HISTORY)
    finally:
        RUNNING["loss"] = None
        HISTORY.clear()


LAST = None


def _keeps_last(x):
    global LAST
    LAST = x * 2  # the global name rebound to a traced tensor
    return LAST + 1


def test_a_global_name_rebound_to_a_traced_tensor_runs_eagerly():
    global LAST
    jfn = fulmen.jit(_keeps_last)
    try:
        with pytest.warns(UserWarning, match="'LAST'"):
            jfn(torch.ones(2))
        jfn(torch.full((2,), 3.0))
        assert type(LAST) is torch.Tensor and LAST.tolist() == [6.0, 6.0]
    finally:
        LAST = None


def test_a_closure_variable_or_dict_given_a_traced_tensor_runs_eagerly():
    last, holder = None, {}

    def fn(x):
        nonlocal last
        last = x * 2
        holder["y"] = x + 1
        return last + 1

    jfn = fulmen.jit(fn)
    with pytest.warns(UserWarning, match="enclosing function|global dict"):
        jfn(torch.ones(2))
    jfn(torch.full((2,), 3.0))
    assert type(last) is torch.Tensor and last.tolist() == [6.0, 6.0]
    assert type(holder["y"]) is torch.Tensor and holder["y"].tolist() == [4.0, 4.0]



def test_a_call_run_eagerly_for_a_kept_tensor_makes_the_other_stores_once():
    """The trace's other stores (a counter, a rebound global) are put back with the kept
    tensor, since the eager run makes them again: the counter counted twice per call."""
    calls, kept = [0], []
    step = {"n": 0}

    def fn(x):
        calls[0] += 1
        step["n"] = step["n"] + 1
        kept.append(x * 2)
        return x + 1

    jfn = fulmen.jit(fn)
    with pytest.warns(UserWarning, match="global list"):
        jfn(torch.ones(2))
    for _ in range(2):
        jfn(torch.ones(2))
    assert calls == [3] and step == {"n": 3} and len(kept) == 3

GAIN32 = np.float32(2.0)
OFFSET64 = np.int64(3)


def _numpy_scalars(x):
    return x * float(GAIN32) + int(OFFSET64)


def test_numpy_scalars_in_globals_are_guarded():
    global GAIN32, OFFSET64
    jfn, x = fulmen.jit(_numpy_scalars), torch.ones(2)
    try:
        torch.testing.assert_close(jfn(x), _numpy_scalars(x))
        GAIN32, OFFSET64 = np.float32(5.0), np.int64(7)  # were not keyed: stale
        torch.testing.assert_close(jfn(x), _numpy_scalars(x))
        GAIN32 = np.float32("nan")  # keyed as a float is: one entry, not one per call
        jfn(x), jfn(x)
        assert fulmen.compile_stats(jfn).cache_misses == 3
    finally:
        GAIN32, OFFSET64 = np.float32(2.0), np.int64(3)
