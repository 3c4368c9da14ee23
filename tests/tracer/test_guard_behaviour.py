"""A call that differs from a cached one in one guarded property only gets eager's answer.

`test_cache.py` checks that a change of each property retraces from a contiguous first call;
these tests change a property between two calls that agree on everything coarser (two
non-contiguous layouts of one shape), where code that reads the property answers differently.
"""

import contextlib
import os

import pytest
import torch

import fulmen


def _reads_strides(x):
    y = x * 2
    return y + x.stride(1), torch.tensor(y.stride())


def test_two_non_contiguous_layouts_of_one_shape_are_two_entries():
    base = torch.randn(6, 12)
    step2 = base[:, ::2]  # shape (6, 6), strides (12, 2)
    step3 = torch.randn(6, 18)[:, ::3]  # shape (6, 6), strides (18, 3)
    transposed = torch.randn(6, 6).t()  # strides (1, 6)
    jfn = fulmen.jit(_reads_strides)
    for x in (step2, step3, transposed, step2):
        expected, expected_strides = _reads_strides(x)
        actual, strides = jfn(x)
        torch.testing.assert_close(actual, expected)
        assert strides.tolist() == expected_strides.tolist(), x.stride()
        assert actual.stride() == expected.stride(), x.stride()


def _scaled_sum(x, w):
    return (x * w).sum(0)


def test_requires_grad_is_keyed_in_a_symbolic_entry(codegen_eager):
    """Two sizes make the entry symbolic in x; a third call whose x, of a new size, requires
    grad must not reuse the no-grad trace (nor the reverse): eager's outputs and gradients.
    (With compiled kernels: torch ops alone would build an autograd graph of their own.)"""
    jfn = fulmen.jit(_scaled_sum)
    for n, grad in ((4, False), (6, False), (8, True), (10, False), (12, True)):
        x, w = torch.randn(n, 3, requires_grad=grad), torch.randn(3)
        expected, actual = _scaled_sum(x, w), jfn(x, w)
        torch.testing.assert_close(actual, expected)
        assert actual.requires_grad == expected.requires_grad, n
        if grad:
            (expected_grad,) = torch.autograd.grad(expected.sum(), x)
            (actual_grad,) = torch.autograd.grad(actual.sum(), x)
            torch.testing.assert_close(actual_grad, expected_grad)


class _ReadsLateAttributes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.act = torch.nn.functional.relu

    def forward(self, x):
        return self.act(self.linear(x)) * getattr(self, "temperature", 1.0)


def test_an_attribute_added_after_jitting_and_a_replaced_function_retrace():
    # both were baked in silently: the attributes were collected once, functions not keyed
    model = _ReadsLateAttributes()
    jitted = fulmen.jit(model)
    x = torch.randn(2, 3)
    torch.testing.assert_close(jitted(x), model(x))
    for change in (lambda: setattr(model, "temperature", 0.5),
                   lambda: setattr(model, "temperature", 0.25),
                   lambda: setattr(model, "act", torch.tanh),
                   lambda: setattr(model, "act", lambda t: t * 3)):
        change()
        torch.testing.assert_close(jitted(x), model(x))


class _CFG:
    scale = 2.0
    use_relu = True


def _reads_a_config_class(x):
    y = x * _CFG.scale
    return y.relu() if _CFG.use_relu else y


class _ScaledByClass(torch.nn.Module):
    factor = 2.0

    def forward(self, x):
        return x * self.factor


class _Counter:
    calls = 0


def _counts_in_a_class(x):
    _Counter.calls += 1
    return x + 1


def test_class_attributes_read_or_stored_by_the_code_are_not_baked_in():
    # a `class CFG:` namespace, a module's class attribute: changed between calls, they were
    # baked in; a class attribute the code stores was stored only while tracing
    x = torch.randn(8)
    jitted = fulmen.jit(_reads_a_config_class)
    for scale, relu in [(2.0, True), (3.0, True), (3.0, False), (2.0, True)]:
        _CFG.scale, _CFG.use_relu = scale, relu
        torch.testing.assert_close(jitted(x), _reads_a_config_class(x))
    model = _ScaledByClass()
    jmodel = fulmen.jit(model)
    for factor in (2.0, 5.0):
        _ScaledByClass.factor = factor
        torch.testing.assert_close(jmodel(x), x * factor)
    _ScaledByClass.factor = 2.0
    counting = fulmen.jit(_counts_in_a_class)
    with pytest.warns(UserWarning, match="stores attributes of the class _Counter"):
        for _ in range(3):
            counting(x)
    assert _Counter.calls == 3


class _ReadsModes(torch.nn.Module):
    """Branches on the ambient modes PyTorch code reads as flags (`F.interpolate` and `F.pad`
    read the deterministic flag on CUDA)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        if torch.is_inference_mode_enabled():
            y = y * 2
        if torch.are_deterministic_algorithms_enabled():
            y = y + 1
        return y


def test_inference_and_deterministic_mode_read_inside_are_keyed():
    """Under `no_grad` and `inference_mode` grad mode reads the same: the first call's trace
    served the second, branch and all (and so for deterministic mode)."""
    model = _ReadsModes()
    jmodel, x = fulmen.jit(model), torch.randn(2, 4)

    def deterministic():  # (under no_grad, as the first call)
        torch.use_deterministic_algorithms(True)
        try:
            with torch.no_grad():
                yield
        finally:
            torch.use_deterministic_algorithms(False)

    contexts = [torch.no_grad, torch.inference_mode, torch.no_grad,
                contextlib.contextmanager(deterministic), torch.inference_mode]
    for context in contexts:
        with context():
            expected, got = model(x), jmodel(x)
        torch.testing.assert_close(got, expected)
        assert got.is_inference() == expected.is_inference()
    assert fulmen.compile_stats(jmodel).cache_misses == 3


def _flag_setter(setter, value):
    """A context that sets a process-wide flag through `setter` and puts its old value back."""

    @contextlib.contextmanager
    def context(getter):
        old = getter()
        setter(value)
        try:
            yield
        finally:
            setter(old)

    return context


def _setattr(holder, name):
    def set_flag(value):
        setattr(holder, name, value)

    return set_flag


def _default_device(device):
    @contextlib.contextmanager
    def context(getter):
        torch.set_default_device(device)
        try:
            yield
        finally:
            torch.set_default_device(None)

    return context


def _anomaly(check_nan):
    @contextlib.contextmanager
    def context(getter):
        with torch.autograd.set_detect_anomaly(True, check_nan=check_nan):
            yield

    return context


def _sdpa_math(getter):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.MATH])


def _meta_device(getter):
    return torch.device("meta")


_C = torch._C
_cuda, _cudnn, _mkldnn = torch.backends.cuda, torch.backends.cudnn, torch.backends.mkldnn
# name -> (what user code reads, a context under which it reads another value)
_PROCESS_STATES = {
    "float32 matmul precision": (torch.get_float32_matmul_precision,
                                 _flag_setter(torch.set_float32_matmul_precision, "medium")),
    "cuBLAS TF32": (lambda: _cuda.matmul.allow_tf32,
                    _flag_setter(_setattr(_cuda.matmul, "allow_tf32"), True)),
    # the newer API: the legacy getters raise once a program mixed the two
    "fp32_precision API": (lambda: _cuda.matmul.fp32_precision,
                           _flag_setter(_setattr(_cuda.matmul, "fp32_precision"), "tf32")),
    "cuDNN TF32": (lambda: _cudnn.allow_tf32, _flag_setter(_setattr(_cudnn, "allow_tf32"), False)),
    "cuBLAS fp16 reduction": (
        lambda: _cuda.matmul.allow_fp16_reduced_precision_reduction,
        _flag_setter(_setattr(_cuda.matmul, "allow_fp16_reduced_precision_reduction"), False)),
    "cuBLAS bf16 reduction": (
        lambda: _cuda.matmul.allow_bf16_reduced_precision_reduction,
        _flag_setter(_setattr(_cuda.matmul, "allow_bf16_reduced_precision_reduction"), False)),
    "CPU fp16 reduction": (_C._get_cpu_allow_fp16_reduced_precision_reduction,
                           _flag_setter(_C._set_cpu_allow_fp16_reduced_precision_reduction,
                                        True)),
    "cuDNN enabled": (lambda: _cudnn.enabled, _flag_setter(_setattr(_cudnn, "enabled"), False)),
    "cuDNN deterministic": (lambda: _cudnn.deterministic,
                            _flag_setter(_setattr(_cudnn, "deterministic"), True)),
    "cuDNN benchmark": (lambda: _cudnn.benchmark, _flag_setter(_setattr(_cudnn, "benchmark"),
                                                               True)),
    "oneDNN enabled": (lambda: _mkldnn.enabled, _flag_setter(_setattr(_mkldnn, "enabled"),
                                                             False)),
    "oneDNN deterministic": (lambda: _mkldnn.deterministic,
                             _flag_setter(_setattr(_mkldnn, "deterministic"), True)),
    "anomaly detection": (torch.is_anomaly_enabled, _anomaly(check_nan=True)),
    "anomaly check_nan": (torch.is_anomaly_check_nan_enabled, _anomaly(check_nan=False)),
    "threads": (torch.get_num_threads, _flag_setter(torch.set_num_threads, 1)),
    "default device": (torch.get_default_device, _default_device("meta")),
    "with torch.device": (torch.get_default_device, _meta_device),
    "sdpa_kernel": (_cuda.flash_sdp_enabled, _sdpa_math),
    "flash attention": (_cuda.flash_sdp_enabled,
                        _flag_setter(_cuda.enable_flash_sdp, False)),
    "memory-efficient attention": (_cuda.mem_efficient_sdp_enabled,
                                   _flag_setter(_cuda.enable_mem_efficient_sdp, False)),
    "math attention": (_cuda.math_sdp_enabled, _flag_setter(_cuda.enable_math_sdp, False)),
    "cuDNN attention": (_cuda.cudnn_sdp_enabled, _flag_setter(_cuda.enable_cudnn_sdp, False)),
}


@pytest.mark.parametrize("name", list(_PROCESS_STATES))
def test_process_state_read_inside_is_keyed(name):
    """Code that branches on a process-wide flag (`if torch.get_float32_matmul_precision() ==
    ...`) took the first call's branch for every later call, whatever the flag had become
    (NOTE [process state in the key]); the same flag again hits the cache."""
    read, changed = _PROCESS_STATES[name]
    before = read()

    def branches(x):
        return x * 2 if read() == before else x * 3

    jfn, x = fulmen.jit(branches), torch.randn(3)
    try:
        with changed(read):
            pass
    except RuntimeError as error:  # (CPU fp16 reductions on a CPU without them)
        pytest.skip(f"cannot change {name} here: {error}")
    for step in range(4):
        with changed(read) if step % 2 else contextlib.nullcontext():
            assert (read() == before) == (step % 2 == 0)  # the context changes the flag
            torch.testing.assert_close(jfn(x), branches(x))
    assert fulmen.compile_stats(jfn).cache_misses == 2


_ENVIRONMENT_READS = {
    "os.environ.get": lambda: os.environ.get("FULMEN_TEST_FLAG_H43"),
    "os.getenv": lambda: os.getenv("FULMEN_TEST_FLAG_H43", "unset"),
    "in os.environ": lambda: "FULMEN_TEST_FLAG_H43" in os.environ,
    "os.environ[name]": lambda: os.environ["FULMEN_TEST_FLAG_H43"] if "FULMEN_TEST_FLAG_H43"
    in os.environ else None,
    "dict(os.environ)": lambda: dict(os.environ).get("FULMEN_TEST_FLAG_H43"),
}


@pytest.mark.parametrize("name", list(_ENVIRONMENT_READS))
def test_environment_variables_read_inside_are_keyed(name, monkeypatch):
    """`if os.environ.get("X")` inside the traced code took the first call's branch for every
    later call (NOTE [environment reads]); an unchanged environment hits the cache."""
    read = _ENVIRONMENT_READS[name]
    monkeypatch.delenv("FULMEN_TEST_FLAG_H43", raising=False)

    def branches(x):
        return x * 2 if read() in (None, False, "unset") else x * 3

    jfn, x = fulmen.jit(branches), torch.randn(3)
    for value in (None, "1", None, "1", "1"):
        if value is None:
            monkeypatch.delenv("FULMEN_TEST_FLAG_H43", raising=False)
        else:
            monkeypatch.setenv("FULMEN_TEST_FLAG_H43", value)
        torch.testing.assert_close(jfn(x), branches(x))
    assert fulmen.compile_stats(jfn).cache_misses == 2
    assert type(os.environ).__name__ == "_Environ"  # put back after tracing


def test_fused_cpu_kernels_allocate_on_the_cpu_under_another_default_device(codegen_eager):
    """CPU kernels allocated their outputs on the default device: called after
    `torch.set_default_device("meta")`, a kernel wrote through a meta tensor's null pointer
    (a segfault); a small output (`torch.empty_strided`) and a pooled one (`pool.empty`)."""

    def fn(x, y):
        return (x * 2).exp() + 1, (y * 3).sin() - 1

    jfn, x, y = fulmen.jit(fn), torch.randn(1024, 1024), torch.randn(8, 8)
    torch.set_default_device("meta")
    try:
        expected, got = fn(x, y), jfn(x, y)
    finally:
        torch.set_default_device(None)
    assert [t.device for t in got] == [x.device, y.device]
    torch.testing.assert_close(got, expected)


def test_number_carriers_are_made_on_the_cpu_under_another_default_device():
    """A float argument read at run time crosses into the trace as a float64 CPU tensor made
    on each call: under `torch.set_default_device("meta")` it was made on the meta device and
    reading it raised."""
    jfn, x = fulmen.jit(lambda x, scale: x * scale), torch.randn(4)
    torch.set_default_device("meta")
    try:
        for scale in (0.5, 0.7, 0.9):  # varying: read at run time from the second miss
            torch.testing.assert_close(jfn(x, scale), x * scale)
    finally:
        torch.set_default_device(None)


def test_anomaly_detection_catches_a_nan_made_in_the_compiled_backward():
    """Under `torch.autograd.detect_anomaly()` a NaN gradient raises as in eager (the compiled
    backward is one autograd Function, checked like eager's `SqrtBackward0`)."""

    def fn(x):
        return x.sqrt().sum()

    jfn, x = fulmen.jit(fn), torch.tensor([1.0, -1.0], requires_grad=True)
    for function in (fn, jfn):
        with torch.autograd.detect_anomaly(), pytest.warns(UserWarning):
            with pytest.raises(RuntimeError, match="returned nan values"):
                function(x).backward()


def test_a_function_setting_an_environment_variable_runs_eagerly(monkeypatch):
    """The write ran once, while tracing, and the compiled calls skipped it (a counter kept in
    the environment stopped); now the call runs eagerly, the trace's write undone, with a
    warning naming the variable."""
    monkeypatch.setenv("FULMEN_TEST_COUNT_H43", "0")

    def counts(x):
        os.environ["FULMEN_TEST_COUNT_H43"] = str(int(os.environ["FULMEN_TEST_COUNT_H43"]) + 1)
        return x + 1

    jfn, x = fulmen.jit(counts), torch.randn(3)
    with pytest.warns(UserWarning, match="FULMEN_TEST_COUNT_H43"):
        for _ in range(3):
            torch.testing.assert_close(jfn(x), x + 1)
    assert os.environ["FULMEN_TEST_COUNT_H43"] == "3"


def test_a_function_deleting_an_environment_variable_runs_eagerly(monkeypatch):
    """`del os.environ[X]` (and `os.environ.pop(X)`) is a write too: as in eager, every call
    deletes the variable the caller set again (a compiled call would have deleted it once,
    while tracing)."""
    def consumes(x):
        if "FULMEN_TEST_ONCE_H46" in os.environ:
            del os.environ["FULMEN_TEST_ONCE_H46"]
        return x + 1

    jfn, x = fulmen.jit(consumes), torch.randn(3)
    with pytest.warns(UserWarning, match="FULMEN_TEST_ONCE_H46"):
        for _ in range(3):
            monkeypatch.setenv("FULMEN_TEST_ONCE_H46", "1")
            torch.testing.assert_close(jfn(x), x + 1)
            assert "FULMEN_TEST_ONCE_H46" not in os.environ
