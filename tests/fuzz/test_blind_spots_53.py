"""Blind spots of the mutant table found in session 53 (h53mut): behaviours no test of `make
test` pinned, each compared with eager (or with what the policy documents). Each test kills
one or more rows under `# --- session 53, h53mut` in `tests/fuzz/mutant_table.py`."""

import contextlib
import io
import sys
import threading
from pathlib import Path

import pytest
import torch

import fulmen

# --- tracer/slice_bounds.py: slices bounded by 0-d integer tensors -----------------------


def _start(x, n):
    return x[n:] * 2


def _step(x, n):
    return x[::n] + 1


def _stop_alone(x, n):
    return x[:n].sum(0)


def _second_dim(x, n):
    out = x.clone()
    out[:, n:] = 0.0
    return out


@pytest.mark.parametrize("fn", [_start, _step, _stop_alone, _second_dim])
def test_every_bound_of_a_slice_may_be_a_zero_dim_tensor(fn):
    """`x[n:]`, `x[::n]`, `x[:n]` (an index that is no tuple) and a write `x[:, n:] = 0`, with
    `n` a 0-d integer tensor, compiled (no eager call) and equal to eager for each `n`."""
    jfn = fulmen.jit(fn)
    x = torch.randn(7, 5)
    for k in (2, 3, 2):
        n = torch.tensor(k)
        torch.testing.assert_close(jfn(x, n), fn(x, n))
    assert fulmen.compile_stats(jfn).eager_calls == 0


def test_a_slice_bound_may_be_a_one_element_tensor():
    """Eager reads any integer tensor of one element with `__index__` (`x[:lengths.max(0,
    keepdim=True).values]`); a bound of shape [1] failed to trace (FulmenError
    'aten._local_scalar_dense ... reached the dispatcher with a traced tensor')."""
    jfn = fulmen.jit(_stop_alone)
    x = torch.randn(7, 5)
    for k in (2, 3):
        n = torch.tensor([k])
        torch.testing.assert_close(jfn(x, n), _stop_alone(x, n))
    assert fulmen.compile_stats(jfn).eager_calls == 0


def test_a_bool_slice_bound_reads_as_eager_and_a_float_one_raises_as_eager():
    """`x[:flag]` with a 0-d bool tensor slices to 0 or 1 rows in eager (bool is an integer
    there; it failed to trace, as the [1] bound did); a float tensor bound raises eager's
    TypeError (a complex one too)."""
    jfn = fulmen.jit(_stop_alone)
    x = torch.randn(7, 5)
    for flag in (True, False, True):
        torch.testing.assert_close(jfn(x, torch.tensor(flag)), _stop_alone(x, torch.tensor(flag)))
    for bound in (torch.tensor(2.0), torch.tensor(2 + 0j)):
        with pytest.raises(TypeError, match="integer tensors"):
            _stop_alone(x, bound)
        with pytest.raises(TypeError, match="integer tensors"):
            fulmen.jit(_stop_alone)(x, bound)


# --- tracer/host_output.py: prints while tracing -----------------------------------------


def _ticks(x):
    print("tick", end="")
    return x + 1


def test_a_print_with_no_line_end_prints_on_every_call():
    """`print("tick", end="")` ends by writing "": the trace printed all the same, so every
    call runs eagerly and prints, as eager does."""
    jfn = fulmen.jit(_ticks)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        for _ in range(3):
            torch.testing.assert_close(jfn(torch.ones(2)), torch.ones(2) + 1)
    assert text.getvalue() == "tick" * 3


def _prints_from_a_thread(x):
    worker = threading.Thread(target=lambda: print("from a thread"))
    worker.start()
    worker.join()
    return x * 2


def test_another_threads_print_while_tracing_passes_through():
    """A print of another thread while the function traces is that thread's, not the trace's:
    it reaches the stream and the trace stays compiled."""
    jfn = fulmen.jit(_prints_from_a_thread)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        torch.testing.assert_close(jfn(torch.ones(2)), torch.ones(2) * 2)
    assert text.getvalue() == "from a thread\n"
    assert fulmen.compile_stats(jfn).eager_calls == 0


def _reads_stream(x):
    return x * 2 if sys.stdout.encoding else x


def test_the_stream_attributes_are_read_while_tracing():
    """Code that asks `sys.stdout` for an attribute (`encoding`, `isatty`, as progress bars
    do) reads the real stream's while tracing, and compiles."""
    jfn = fulmen.jit(_reads_stream)
    torch.testing.assert_close(jfn(torch.ones(2)), _reads_stream(torch.ones(2)))
    assert fulmen.compile_stats(jfn).eager_calls == 0


def test_stdout_is_given_back_after_tracing():
    """After a compiled call (traced or refused for its print), `print` reaches the stream."""
    for fn in (_ticks, lambda x: x - 1):
        jfn = fulmen.jit(fn)
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            jfn(torch.ones(2))
            print("after")
        assert text.getvalue().endswith("after\n")


# --- transforms/region_size.py: which CPU regions stay on torch ----------------------------


def _fused_regions(jfn) -> list:
    trace = fulmen.last_traces(jfn)[-1]
    return [b for b in trace.bsyms if "fusion" in b.sym.tags]


def _four_ops(x, y):
    return torch.relu(x * y + 1.0) * 2.0


def _five_ops(x, y):
    return (torch.relu(x * y + 1.0) * 2.0).exp()


@pytest.mark.parametrize("dynamic", [False, True])
def test_tiny_region_bounds_are_inclusive(monkeypatch, dynamic):
    """`TINY_REGION` (4 torch ops, 16384 elements) is the largest region kept on torch: 4 ops
    on 16384 elements stay, a 5th op or a 16385th element (or 2-d sizes whose product, not
    each size, passes the limit) fuse; results equal eager either way."""
    from fulmen.transforms.region_size import TINY_REGION

    monkeypatch.delenv("FULMEN_FUSE_TINY")
    max_ops, max_numel = TINY_REGION
    assert max_ops == 4
    cases = ((_four_ops, (max_numel,), False), (_five_ops, (max_numel,), True),
             (_four_ops, (max_numel + 1,), True), (_four_ops, (128, 128), False),
             (_four_ops, (129, 128), True))
    for fn, shape, fused in cases:
        if dynamic and len(shape) == 1:
            continue  # (symbolic sizes: the 2-d cases cover the bound and the product)
        jfn = fulmen.jit(fn, executors=["codegen", "torch"], dynamic=dynamic)
        x, y = torch.randn(shape), torch.randn(shape)
        torch.testing.assert_close(jfn(x, y), fn(x, y))
        assert bool(_fused_regions(jfn)) == fused, (fn.__name__, shape)



# --- tracer/key_memo.py: the memo of the sources key --------------------------------------


class _Settings:
    def __init__(self):
        self.double = True


class _Reads(torch.nn.Module):
    """Asks whether its settings object has an attribute, as HF code asks of its config."""

    def __init__(self):
        super().__init__()
        self.settings = _Settings()

    def forward(self, x):
        return x * 2 if hasattr(self.settings, "double") else x - 1


def test_an_attribute_renamed_with_its_value_misses_the_cache():
    """Renaming a config attribute (same count, same value object) changes what `hasattr`
    answers: the remembered key must not be reused."""
    model = _Reads()
    jmodel = fulmen.jit(model)
    x = torch.ones(3)
    for _ in range(3):
        torch.testing.assert_close(jmodel(x), model(x))
    value = model.settings.double
    del model.settings.double
    model.settings.triple = value
    torch.testing.assert_close(jmodel(x), model(x))


class _ModeA:
    __slots__ = ()  # (no `__dict__`: a leaf keyed by identity and type, not a holder walked)


class _ModeB:
    __slots__ = ()


class _Moded(torch.nn.Module):
    """Branches on the class of an object its settings hold (an activation chosen by type)."""

    def __init__(self):
        super().__init__()
        self.settings = _Settings()
        self.settings.mode = _ModeA()

    def forward(self, x):
        return x * 2 if isinstance(self.settings.mode, _ModeA) else x * 3


def test_an_item_whose_class_is_reassigned_misses_the_cache():
    """The very object under `settings.mode`, its `__class__` reassigned: the remembered key
    must not be reused (the full key holds each item's type)."""
    model = _Moded()
    jmodel = fulmen.jit(model)
    x = torch.ones(3)
    for _ in range(3):
        torch.testing.assert_close(jmodel(x), model(x))
    model.settings.mode.__class__ = _ModeB
    torch.testing.assert_close(jmodel(x), model(x))


class _Mode:
    pass


class _Scaler:
    """A jitted method's own object (`fulmen.jit(scaler.apply)`, keyed by `ObjectKeyMemo`)."""

    def __init__(self):
        self.mode = _Mode()  # (a plain object: the memo remembers a key of plain values)

    def apply(self, x):
        if isinstance(self, _LoudScaler):
            return x * 5
        mode = getattr(self, "mode", None)
        return x - 1 if mode is None else x * 2


class _LoudScaler(_Scaler):
    pass


def test_the_jitted_methods_object_whose_class_is_reassigned_misses_the_cache():
    """`scaler.__class__` reassigned (the same attributes): the memo must not answer."""
    scaler = _Scaler()
    jfn = fulmen.jit(scaler.apply)
    x = torch.ones(3)
    for _ in range(3):
        torch.testing.assert_close(jfn(x), scaler.apply(x))
    scaler.__class__ = _LoudScaler
    torch.testing.assert_close(jfn(x), scaler.apply(x))


def test_an_attribute_of_the_jitted_methods_object_renamed_with_its_value_misses_the_cache():
    """`scaler.mode` renamed `scaler.other` (the same object, as many attributes): the
    remembered key of the jitted method's object must not be reused."""
    scaler = _Scaler()
    jfn = fulmen.jit(scaler.apply)
    x = torch.ones(3)
    for _ in range(3):
        torch.testing.assert_close(jfn(x), scaler.apply(x))
    scaler.other = scaler.__dict__.pop("mode")
    torch.testing.assert_close(jfn(x), scaler.apply(x))


def test_a_change_after_the_objects_dict_was_replaced_misses_the_cache():
    """`scaler.__dict__` replaced by a copy (the same items: the key is unchanged), then an
    attribute set through the new dict: the memo must not compare the old dict's items."""
    scaler = _Scaler()
    jfn = fulmen.jit(scaler.apply)
    x = torch.ones(3)
    for _ in range(3):
        torch.testing.assert_close(jfn(x), scaler.apply(x))
    scaler.__dict__ = dict(scaler.__dict__)
    torch.testing.assert_close(jfn(x), scaler.apply(x))
    scaler.mode = None
    torch.testing.assert_close(jfn(x), scaler.apply(x))


def _closing_over_a_scaler():
    scaler = _Scaler()

    def fn(x):
        return scaler.apply(x)

    def swap(new):
        nonlocal scaler
        scaler = new

    return fn, swap


def test_another_object_in_the_closure_misses_the_cache():
    """The closure's object rebound to another of the same contents' types: the memo of the
    first object's key must not answer for the second."""
    fn, swap = _closing_over_a_scaler()
    jfn = fulmen.jit(fn)
    x = torch.ones(3)
    for _ in range(3):
        torch.testing.assert_close(jfn(x), fn(x))
    other = _Scaler()
    other.mode = None
    swap(other)
    torch.testing.assert_close(jfn(x), fn(x))


def _doubled(x):
    return x * 2.0


def test_a_transposed_argument_after_hits_keeps_eagers_strides():
    """The memo of positional tensor keys (`ArgumentKeyMemo`) checks strides too: a square
    input transposed after several calls gives eager's (transposed) output strides."""
    jfn = fulmen.jit(_doubled)
    x = torch.randn(4, 4)
    for _ in range(3):
        jfn(x)
    out, want = jfn(x.t()), _doubled(x.t())
    torch.testing.assert_close(out, want)
    assert out.stride() == want.stride() == (1, 4)


SHIFT = -1


def _shifted(x):
    return x + SHIFT


def test_keys_of_equal_hash_are_told_apart():
    """hash(-1) == hash(-2) in Python: cache keys that differ only there have equal hashes and
    must still be told apart by their values."""
    global SHIFT
    jfn = fulmen.jit(_shifted)
    x = torch.zeros(2)
    try:
        for shift in (-1, -2, -1):
            SHIFT = shift
            torch.testing.assert_close(jfn(x), _shifted(x))
    finally:
        SHIFT = -1


# --- executors/codegen/cpu/compiler.py: the kernel cache's key -----------------------------


def test_the_kernel_cache_key_follows_flags_and_compiler(monkeypatch):
    """A kernel built with other flags, or by another compiler, is another cache entry."""
    from fulmen.executors.codegen.cpu import compiler

    source = "int f() { return 1; }"
    key = compiler.cache_key(source, "/nonexistent/g++")
    assert key == compiler.cache_key(source, "/nonexistent/g++")
    assert key != compiler.cache_key(source, "/nonexistent/clang++")
    monkeypatch.setattr(compiler, "CXX_FLAGS", (*compiler.CXX_FLAGS[:-1], "-ffp-contract=fast"))
    assert key != compiler.cache_key(source, "/nonexistent/g++")


def test_the_kernel_cache_key_follows_the_cpu_features(monkeypatch):
    """`-march=native` builds for this CPU: a cache shared with a machine of other features
    (a home directory on a network share) must not hand it this machine's kernels."""
    from fulmen.executors.codegen.cpu import compiler

    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    keys = []
    for line in ("flags : fpu sse2", "flags : fpu sse2 avx512f"):
        monkeypatch.setattr(compiler, "cpu_features", lambda text, line=line: line)
        compiler._toolchain_id.cache_clear()
        keys.append(compiler.cache_key("int f() { return 1; }", "/nonexistent/g++"))
    compiler._toolchain_id.cache_clear()
    assert keys[0] != keys[1]


def test_cxx_names_the_compiler(monkeypatch, tmp_path):
    """`CXX` chooses the compiler (before g++ or c++ on PATH), a bare name found on the PATH
    of the moment."""
    from fulmen.executors.codegen.cpu import compiler

    fakes = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        fake = tmp_path / folder / "my-c++"
        fake.write_text("#!/bin/sh\nexit 1\n")
        fake.chmod(0o755)
        fakes.append(str(fake))
    monkeypatch.setenv("CXX", fakes[0])
    assert compiler.compiler() == fakes[0]
    monkeypatch.setenv("CXX", "my-c++")
    for fake in fakes:
        monkeypatch.setenv("PATH", str(Path(fake).parent))
        assert compiler.compiler() == fake


# --- core/symbol.py: statements renamed after common subexpression elimination --------------


def _keyword_reads(x, w):
    a, b = w * 2.0, w * 2.0  # one value twice: CSE keeps the first
    c, d = w.exp(), w.exp()
    return torch.nn.functional.layer_norm(x, (4,), weight=a, bias=b), torch.lerp(x, end=c,
                                                                                    weight=d)


def test_values_read_through_keyword_arguments_are_renamed_with_the_rest():
    """A repeat removed by CSE is renamed to the value kept wherever it is read, keyword
    arguments (`weight=`, `bias=`, `end=`) as well as positional ones."""
    jfn = fulmen.jit(_keyword_reads)
    x, w = torch.randn(3, 4), torch.randn(4)
    torch.testing.assert_close(jfn(x, w), _keyword_reads(x, w))


# --- executors/codegen/cpu/plans.py: the iteration order of a pointwise kernel -------------


def _with_reversed(x, y):
    return (x + y.permute(*reversed(range(y.dim())))) * 2.0


@pytest.mark.usefixtures("codegen_eager")
@pytest.mark.parametrize("shape", [(128, 4)])
def test_a_short_inner_axis_is_iterated_outermost_with_its_strides(shape):
    """A fused pointwise kernel over a short inner axis (4 elements, not coalesced: the
    other input is a reversed permutation) runs its longest axis innermost (`long_inner`);
    every input's strides move with the sizes, so the result is eager's."""
    jfn = fulmen.jit(_with_reversed, executors=["codegen", "torch"])
    x, y = torch.randn(shape), torch.randn(tuple(reversed(shape)))
    for _ in range(2):
        torch.testing.assert_close(jfn(x, y), _with_reversed(x, y))
    assert _fused_regions(jfn)


# --- tracer/object_inputs.py: deletions from an object argument ----------------------------


class _State:
    def __init__(self):
        self.scale, self.scratch = 2.0, 1


def _deletes_scratch(state, x):
    del state.scratch
    return x * state.scale


def test_a_deletion_from_an_object_argument_is_refused_not_lost():
    """A compiled call would not repeat `del state.scratch` (the object is put back after
    tracing): the call is refused, not compiled without the deletion."""
    from fulmen.core import NotYetSupportedError

    jfn, state = fulmen.jit(_deletes_scratch), _State()
    with pytest.raises(NotYetSupportedError, match="deletes"):
        jfn(state, torch.ones(2))


# --- core/symbol.py: an unused random draw still advances the generator ---------------------


def _unused_draw(x):
    torch.rand(3)  # its value unused: the draw still moves the generator
    return x + torch.rand(2)


def test_an_unused_random_draw_is_kept():
    """Dead code elimination keeps a draw whose value is unused, so the next draw gets eager's
    numbers."""
    jfn = fulmen.jit(_unused_draw)
    x = torch.zeros(2)
    for seed in (0, 1):
        torch.manual_seed(seed)
        want = _unused_draw(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(jfn(x), want)
