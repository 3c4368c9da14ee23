"""The per-call checks of a jitted module after cache hits: the generated reader of the module
part of the key (`fulmen.tracer.source_reads`) and the flat memo (`KeyMemo`) must still see every
change the full key sees, and a change back must hit the entry made before."""

import functools

import pytest
import torch

import fulmen
from fulmen.tracer.source_reads import reads_dict_entry, source_reader
from tests.spies import count_traces


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("shift", torch.zeros(4))
        self.k = 2
        self.unused = 7
        self.a = [1.0, 2.0]
        self.b = [3.0]

    def forward(self, x):
        y = self.lin(x) * self.k + self.shift
        y = y * self.a[-1] + self.b[0]
        if self.training:
            y = y + 1
        return y + getattr(self, "extra", 0.0)


def _swap_attributes(m):
    del m.unused  # the same attribute count: only the reader's KeyError tells
    m.extra = 5.0


# change -> (how, whether the next call must trace)
CHANGES = {
    "parameter replaced": (lambda m: setattr(m.lin, "weight", torch.nn.Parameter(
        torch.randn(4, 4))), True),
    "parameter dtype changed in place": (lambda m: m.double(), True),
    "requires_grad toggled": (lambda m: m.lin.bias.requires_grad_(False), True),
    "train to eval": (lambda m: m.eval(), True),
    "hook added": (lambda m: m.lin.register_forward_hook(lambda mod, i, o: o * 2), True),
    "buffer mutated in place": (lambda m: m.shift.add_(1.0), False),
    "attribute int changed": (lambda m: setattr(m, "k", 3), True),
    "attribute int to an equal float": (lambda m: setattr(m, "k", 2.0), True),
    "item moved from one list to another": (lambda m: m.b.insert(0, m.a.pop()), True),
    "attribute deleted and another added": (_swap_attributes, True),
    "attribute added": (lambda m: setattr(m, "extra", 5.0), True),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_hits_traces_again_and_follows_eager(change, monkeypatch):
    torch.manual_seed(0)
    model = _Block()
    jmodel = fulmen.jit(model)
    x = torch.randn(3, 4)
    for _ in range(3):
        torch.testing.assert_close(jmodel(x), model(x))
    traced = count_traces(monkeypatch)
    how, retraces = CHANGES[change]
    how(model)
    if change == "parameter dtype changed in place":
        x = x.double()
    out, expected = jmodel(x), model(x)
    torch.testing.assert_close(out, expected)
    assert out.requires_grad == expected.requires_grad
    assert len(traced) == int(retraces)
    torch.testing.assert_close(jmodel(x), model(x))  # and then hits
    assert len(traced) == int(retraces)


@pytest.mark.parametrize("how", ["training", "attribute"])
def test_a_change_back_hits_the_entry_made_before(how, monkeypatch):
    model = _Block()
    jmodel = fulmen.jit(model)
    x = torch.randn(3, 4)
    first, second = ((model.train, model.eval) if how == "training" else
                     (lambda: setattr(model, "k", 2), lambda: setattr(model, "k", 3)))
    for change in (first, second):
        change()
        torch.testing.assert_close(jmodel(x), model(x))
    traced = count_traces(monkeypatch)
    for change in (first, second, first, second):
        change()
        torch.testing.assert_close(jmodel(x), model(x))
    assert traced == []


class _Shadowed(torch.nn.Module):
    """`scale` is a property: `self.scale` reads it, never the stale `__dict__` entry."""

    SCALES = [2.0]

    @property
    def scale(self):
        return _Shadowed.SCALES[0]

    def forward(self, x):
        return x * self.scale


def test_a_property_over_an_instance_entry_is_read_through_getattr():
    model = _Shadowed()
    model.__dict__["scale"] = 1.0  # an instance entry the property takes precedence over
    assert not reads_dict_entry(model, "scale")
    jmodel = fulmen.jit(model)
    x = torch.ones(2)
    for _ in range(2):
        torch.testing.assert_close(jmodel(x), x * 2.0)
    _Shadowed.SCALES[0] = 5.0
    torch.testing.assert_close(jmodel(x), x * 5.0)


class _Redirected(torch.nn.Module):
    """A class with its own `__getattribute__`: `getattr` is not the `__dict__` entry."""

    def __init__(self):
        super().__init__()
        self.scale = 1.0
        self.factor = [3.0]

    def __getattribute__(self, name):
        if name == "scale":
            return object.__getattribute__(self, "factor")[0]
        return super().__getattribute__(name)

    def forward(self, x):
        return x * self.scale


def test_a_class_with_its_own_getattribute_is_read_through_getattr():
    model = _Redirected()
    assert not reads_dict_entry(model, "scale")
    jmodel = fulmen.jit(model)
    x = torch.ones(2)
    for _ in range(2):
        torch.testing.assert_close(jmodel(x), x * 3.0)
    model.factor[0] = 4.0
    torch.testing.assert_close(jmodel(x), x * 4.0)


def test_the_reader_returns_what_the_readers_return():
    model = torch.nn.Sequential(_Block(), torch.nn.ReLU())
    model[1].eval()
    namespace = {"G": 3}
    sources = [("k", lambda: model[0].k),  # a reader of another shape: called
               ("a", functools.partial(getattr, model[0], "a")),
               ("g", functools.partial(namespace.get, "G")),
               ("missing", functools.partial(namespace.get, "H"))]
    modules = tuple(model.modules())
    read = source_reader(modules, sources)
    assert read() == [m.training for m in modules] + [r() for _, r in sources]
    namespace["H"] = 4  # a global that appears later: read as `dict.get` reads it
    assert read()[-1] == 4
    del model[0].a
    assert read() is None  # a module attribute gone: the caller collects the sources again


GLOBAL_SCALE = 2.0
GLOBAL_OFFSET = 0.0


def _scaled(x):
    return x * GLOBAL_SCALE + GLOBAL_OFFSET


def test_a_global_deleted_and_defined_again_is_keyed_each_time():
    jfn = fulmen.jit(_scaled)
    x = torch.ones(2)
    module = globals()
    try:
        for offset in (0.0, 1.0, 0.0):
            module["GLOBAL_OFFSET"] = offset
            for _ in range(2):
                torch.testing.assert_close(jfn(x), _scaled(x))
        del module["GLOBAL_OFFSET"]
        with pytest.raises(NameError):
            jfn(x)
        for offset in (2.0, 3.0):
            module["GLOBAL_OFFSET"] = offset
            torch.testing.assert_close(jfn(x), x * 2.0 + offset)
    finally:
        module["GLOBAL_OFFSET"] = 0.0
