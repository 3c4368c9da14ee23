"""The memo of the sources key (`fulmen.tracer.key_memo`) and the flat-argument key path: cheaper
cache keys that still catch every change the full key catches."""

import pytest
import torch
import torch.utils._pytree as pytree

import fulmen
from fulmen.tracer import guards, leaf_keys, objects
from fulmen.tracer.guards import CacheKeyBuilder
from fulmen.tracer.key_memo import HashedKey, KeyMemo, holder_snapshot


class _Configured(torch.nn.Module):
    """Reads a config object, a list and a dict it holds, as HF modules read theirs."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.sizes = [1.0, 2.0]
        self.table = {"k": 3.0}

    def forward(self, x):
        y = x * self.config.scale * self.sizes[0] + self.table["k"]
        return y + (1.0 if self.config.flag is True else 0.0)


class _Config:
    def __init__(self, **values):
        self.__dict__.update(values)


class _Other:
    pass


def _model():
    return _Configured(_Config(scale=2.0, flag=True, extra=None))


CHANGES = {
    "config attribute": lambda m: setattr(m.config, "scale", 5.0),
    "config attribute to an equal value of another type": lambda m: setattr(m.config, "flag", 1),
    "config attribute deleted and added back": lambda m: (delattr(m.config, "flag"),
                                                         setattr(m.config, "flag", False)),
    "config __dict__ replaced": lambda m: setattr(m.config, "__dict__",
                                                  {"scale": 7.0, "flag": True, "extra": None}),
    "config class reassigned": lambda m: setattr(m.config, "__class__", _Other),
    "list item in place": lambda m: m.sizes.__setitem__(0, 4.0),
    "dict item in place": lambda m: m.table.__setitem__("k", 9.0),
    "attribute rebound": lambda m: setattr(m, "sizes", [6.0, 2.0]),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_cache_hits_retraces(change):
    """After several hits (the memo holds the key), each kind of change the full key sees
    misses the cache and the result follows eager."""
    model = _model()
    jmodel = fulmen.jit(model)
    x = torch.ones(2)
    for _ in range(3):
        torch.testing.assert_close(jmodel(x), model(x))
    misses = fulmen.compile_stats(jmodel).cache_misses
    CHANGES[change](model)
    torch.testing.assert_close(jmodel(x), model(x))
    assert fulmen.compile_stats(jmodel).cache_misses == misses + 1
    torch.testing.assert_close(jmodel(x), model(x))  # and the new entry is hit
    assert fulmen.compile_stats(jmodel).cache_misses == misses + 1


def test_the_memo_skips_walking_the_config_on_hits(monkeypatch):
    """The point of the memo: an unchanged config is not walked again."""
    model = _model()
    jmodel = fulmen.jit(model)
    x = torch.ones(2)
    jmodel(x)
    walks = []
    original = guards.object_source_key
    monkeypatch.setattr(guards, "object_source_key",
                        lambda value: walks.append(value) or original(value))
    for _ in range(3):
        jmodel(x)
    assert walks == []
    model.config.scale = 3.0
    jmodel(x)
    assert walks and all(walked is model.config for walked in walks)


def test_memo_lookup_compares_identity_not_equality():
    memo = KeyMemo()
    one, other_one = 1000, int("1000")
    assert one == other_one and one is not other_one
    items = [one]
    memo.store([items], HashedKey(("k",)), [holder_snapshot(items)])
    assert memo.lookup([items]) == HashedKey(("k",))
    items[0] = other_one  # equal, but another object: recompute
    assert memo.lookup([items]) is None
    memo.store([items], HashedKey(("k",)), None)  # a key the snapshots do not cover
    assert memo.lookup([items]) is None


def test_hashed_key_equality_follows_the_key():
    assert HashedKey((1, "a")) == HashedKey((1, "a"))
    assert HashedKey((1, "a")) != HashedKey((2, "a"))
    assert hash(HashedKey((1, "a"))) == hash((1, "a"))
    assert HashedKey((1,)) != (1,)


def test_flat_keyword_arguments_key_like_pytree():
    """Plain keyword arguments skip pytree flattening: the leaves are pytree's, in its order,
    and a change of a keyword's value, type or order still misses the cache."""

    def fn(x, *, scale, bias, flag=None):
        return x * scale + bias if flag is None else x - bias

    builder = CacheKeyBuilder(fn=fn)
    x, bias = torch.ones(2), torch.zeros(2)
    kwargs = {"scale": 2.0, "bias": bias, "flag": None}
    _, leaves = builder.key((x,), kwargs)
    assert leaves == pytree.tree_flatten(((x,), kwargs))[0]
    key = builder.key((x,), kwargs)[0]
    assert builder.key((x,), dict(kwargs))[0] == key
    assert builder.key((x,), {**kwargs, "scale": 3.0})[0] != key
    assert builder.key((x,), {**kwargs, "scale": 2})[0] != key
    assert builder.key((x,), {"bias": bias, "scale": 2.0, "flag": None})[0] != key
    assert builder.key((x,), {**kwargs, "bias": torch.zeros(3)})[0] != key
    assert builder.key((x,), {**kwargs, "flag": [1]})[0] != key  # a container: pytree path

    jfn = fulmen.jit(fn)
    for scale, flag in ((2.0, None), (2, None), (2.0, True), (2.0, None)):
        torch.testing.assert_close(jfn(x, scale=scale, bias=bias, flag=flag),
                                   fn(x, scale=scale, bias=bias, flag=flag))
    assert fulmen.compile_stats(jfn).cache_misses == 3


def _transposed_layout(p):
    p.data = p.data.t().contiguous().t()  # same shape and values, column-major strides


PARAMETER_CHANGES = {
    "dtype": lambda m: m.double(),
    "shape": lambda m: (setattr(m[0].weight, "data", torch.randn(5, 3)),
                        setattr(m[0].bias, "data", torch.randn(5))),
    "requires_grad": lambda m: m[0].bias.requires_grad_(False),
    "strides": lambda m: _transposed_layout(m[0].weight),
}


@pytest.mark.parametrize("change", list(PARAMETER_CHANGES))
def test_a_parameter_changed_in_place_after_cache_hits_retraces(change):
    """The parameters' key is reused while PyTorch's tensor check passes: a parameter whose
    metadata changes behind the same slot (dtype, shape, requires_grad, strides) still
    misses the cache."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 3)
    for _ in range(3):
        jmodel(x)
    misses = fulmen.compile_stats(jmodel).cache_misses
    PARAMETER_CHANGES[change](model)
    if change == "dtype":
        x = x.double()
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(jmodel(x), model(x))
    assert fulmen.compile_stats(jmodel).cache_misses == misses + 1
    torch.testing.assert_close(jmodel(x).detach(), expected)


def test_tensor_key_memo_checks_every_field():
    from fulmen.tracer.key_memo import TensorKeyMemo
    from fulmen.tracer.leaf_keys import _tensor_key

    memo = TensorKeyMemo(_tensor_key)
    base = [torch.randn(4, 4), torch.randn(3, requires_grad=True)]
    key = memo.key(base)
    assert memo.key([torch.randn(4, 4), torch.randn(3, requires_grad=True)]) is key
    others = {
        "device": [torch.empty(4, 4, device="meta"), base[1]],
        "dtype": [base[0].double(), base[1]],
        "shape": [torch.randn(4, 5), base[1]],
        "strides": [base[0].t(), base[1]],
        "requires_grad": [base[0], base[1].detach()],
        "count": [base[0]],
    }
    for name, tensors in others.items():
        memo.key(base)
        assert memo.key(tensors) != key, name


class _Cache:
    """An object argument holding tensors whose sizes grow from call to call (a KV cache)."""

    def __init__(self, n, flag=True, dtype=torch.float32):
        self.keys = torch.arange(float(n * 3), dtype=dtype).reshape(n, 3)
        self.flag = flag


def _read_cache(x, cache):
    return x.sum(0) + cache.keys.sum(0) * (2.0 if cache.flag else 1.0)


def test_a_symbolic_lookup_reuses_the_static_leaf_keys_of_the_same_call(monkeypatch):
    """The symbolic entry's lookup keys again only the leaves with symbolic sizes: the object
    argument is keyed for the static key and once for its masked key, not a third time, from
    one walk; and
    the leaf keys it reuses are the call's own (a change of the object's flag or of a tensor's
    dtype between calls still misses)."""
    jfn = fulmen.jit(_read_cache, dynamic=True)
    for n in (4, 5, 6):
        cache = _Cache(n)
        torch.testing.assert_close(jfn(torch.ones(n, 3), cache), _read_cache(torch.ones(n, 3),
                                                                            cache))
        assert jfn._guard._walks == {}  # the call's objects are not held past it, miss or hit
    stats = fulmen.compile_stats(jfn)
    misses = stats.cache_misses
    walks = []
    original = guards.object_key
    for module in (guards, leaf_keys):  # the masked key's object_key, the static key's
        monkeypatch.setattr(module, "object_key",
                            lambda *args, **kwargs: walks.append(args[0]) or original(*args,
                                                                                      **kwargs))
    walked = []
    for module in (leaf_keys, objects):  # the static key's walk, and object_key's own
        original_walk = module.walk
        monkeypatch.setattr(module, "walk", lambda root, original_walk=original_walk:
                            walked.append(root) or original_walk(root))
    cache = _Cache(7)
    torch.testing.assert_close(jfn(torch.ones(7, 3), cache), _read_cache(torch.ones(7, 3), cache))
    assert stats.cache_misses == misses  # a hit of the symbolic entry
    assert walks == [cache, cache]  # its static key and its masked key ...
    assert walked == [cache]  # ... from one walk
    assert jfn._guard._walks == {}  # (not held past the call)
    for changed in (_Cache(8, flag=False), _Cache(8, dtype=torch.float64), _Cache(9)):
        x = torch.ones(changed.keys.shape[0], 3)
        torch.testing.assert_close(jfn(x, changed), _read_cache(x, changed))
    assert stats.cache_misses == misses + 2  # the flag and the dtype; not the size


class _Held(dict):
    """A dict subclass pytree has no node for: a leaf, as an object argument is."""


def test_object_keyword_arguments_skip_flattening_like_pytree(monkeypatch):
    """Keyword arguments that pytree treats as leaves (an object such as a KV cache, an
    unregistered dict subclass) skip flattening, with pytree's leaves; a namedtuple or a dict
    among them is still flattened."""
    from collections import namedtuple

    builder = CacheKeyBuilder(fn=_read_cache)
    flattened = []
    original = pytree.tree_flatten
    monkeypatch.setattr(pytree, "tree_flatten",
                        lambda tree, *rest, **options: flattened.append(tree)
                        or original(tree, *rest, **options))
    x = torch.ones(2, 3)
    for kwargs in ({"cache": _Cache(2), "held": _Held(a=1), "dtype": torch.float32},):
        _, leaves = builder.key((x,), kwargs)
        assert leaves == original(((x,), kwargs))[0]
    assert flattened == []
    pair = namedtuple("Pair", "a b")
    for kwargs in ({"cache": pair(x, x)}, {"cache": {"a": x}}):
        _, leaves = builder.key((x,), kwargs)
        assert leaves == original(((x,), kwargs))[0] and flattened[-1][1] is kwargs
    monkeypatch.undo()
    jfn = fulmen.jit(_read_cache)
    for n in (2, 2, 3):
        cache = _Cache(n)
        torch.testing.assert_close(jfn(torch.ones(n, 3), cache=cache),
                                   _read_cache(torch.ones(n, 3), cache))
    assert fulmen.compile_stats(jfn).cache_misses == 2
