"""The process-wide state a trace may depend on: one table, read into every call's cache key.

NOTE [process state in the key]: traced code runs real Python, so any process-wide flag it
reads (`if torch.is_inference_mode_enabled()`, `torch.get_float32_matmul_precision()`,
`torch.backends.cuda.flash_sdp_enabled()` inside `F.scaled_dot_product_attention`'s layout
choice, `torch.get_num_threads()`) is answered once, at trace time, and the branch it took is
baked into the trace. Each such flag is a row of `PROCESS_STATES`: its name (as
`fulmen.compile_stats` explains a recompile) and its reader. `process_state_key` reads every
row on every call (the guard on the whole table, as torch.compile's global-state guard does:
each reader is one C call, and none of these change in ordinary use, so they cause no
recompiles), so a call made under another answer traces again instead of reusing the branch.

The state a compiled trace *runs* under needs no row: torch ops read it when they run (a
matmul picks TF32 at run time). Environment variables are keyed per variable read
(`fulmen.tracer.environment`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.optim.optimizer as _optimizer_module

from fulmen.core.ambient import autocast_key

_C = torch._C
_call = operator.call
_any_autocast = _C._is_any_autocast_enabled
# `torch.backends.mha.get_fastpath_enabled()` outside TorchScript, without its Python frame
_fastpath_enabled = functools.partial(getattr, torch.backends.mha, "_is_fastpath_enabled")
_function_mode_count = _C._len_torch_function_stack
_function_mode_at = _C._get_function_stack_at
_matmul_precision = _C._get_float32_matmul_precision
_precision_getter = _C._get_fp32_precision_getter
# (backend, op) pairs of the float32 precision API (`torch.backends.*.fp32_precision`)
_PRECISION_SLOTS = (("generic", "all"), ("cuda", "matmul"), ("cuda", "all"),
                    ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"),
                    ("mkldnn", "all"))


def float32_precision() -> object:
    """`torch.get_float32_matmul_precision()` (`"high"` where cuBLAS may use TF32:
    `torch.backends.cuda.matmul.allow_tf32` reads it); where a program mixed the legacy
    switches with `torch.backends.*.fp32_precision` (the legacy getter then raises), the
    precision of each backend and op instead."""
    try:
        return _matmul_precision()
    except RuntimeError:
        return tuple([_precision_getter(backend, op) for backend, op in _PRECISION_SLOTS])


def autocast_state() -> tuple:
    """`()` when autocast is off, else its devices and dtypes (`autocast_key`)."""
    return _any_autocast() and autocast_key()


# the global optimizer step hooks (`torch.optim.optimizer.register_optimizer_step_pre_hook`),
# read by every `Optimizer.step`: a jitted `opt.step` ran the hooks it was traced with (a hook
# registered later never ran, one removed kept running); live views, read as tuples of the
# hooks
_optimizer_pre_hooks = functools.partial(
    tuple, _optimizer_module._global_optimizer_pre_hooks.values())
_optimizer_post_hooks = functools.partial(
    tuple, _optimizer_module._global_optimizer_post_hooks.values())


def function_modes() -> tuple:
    """The torch function modes active at the call, by type (a `DeviceContext`, which
    `torch.set_default_device` and `with torch.device(...)` push, by its device): factory
    calls traced without a device take the default device's."""
    if not _function_mode_count():
        return ()
    modes = [_function_mode_at(i) for i in range(_function_mode_count())]
    return tuple([(type(mode), getattr(mode, "device", None)) for mode in modes])


class ProcessState(NamedTuple):
    """One row of `PROCESS_STATES`: the state's name and its reader."""

    name: str
    read: Callable[[], object]


PROCESS_STATES: tuple[ProcessState, ...] = (
    ProcessState("grad mode", _C.is_grad_enabled),
    # under no_grad and inference_mode grad mode reads the same
    ProcessState("inference mode", torch.is_inference_mode_enabled),
    # F.interpolate/F.pad read it on CUDA
    ProcessState("deterministic algorithms", _C._get_deterministic_algorithms),
    ProcessState("deterministic algorithms warn only", _C._get_deterministic_algorithms_warn_only),
    # a traced nn.TransformerEncoder gives its fast path's zeros at padded positions only
    # where eager takes it (`fast_paths.py`)
    ProcessState("attention fast path", _fastpath_enabled),
    ProcessState("default dtype", torch.get_default_dtype),
    ProcessState("default device and torch function modes", function_modes),
    ProcessState("autocast", autocast_state),  # devices and dtypes: bf16 != f16 regions
    # (raises once a program mixed the legacy switches and `fp32_precision`: `float32_precision`)
    ProcessState("float32 matmul precision and cuBLAS TF32", _matmul_precision),
    ProcessState("cuDNN TF32", _C._get_cudnn_allow_tf32),
    ProcessState("cuBLAS fp16 reduced-precision reduction",
                 _C._get_cublas_allow_fp16_reduced_precision_reduction),
    ProcessState("cuBLAS bf16 reduced-precision reduction",
                 _C._get_cublas_allow_bf16_reduced_precision_reduction),
    ProcessState("CPU fp16 reduced-precision reduction",
                 _C._get_cpu_allow_fp16_reduced_precision_reduction),
    ProcessState("cuDNN enabled", _C._get_cudnn_enabled),
    ProcessState("cuDNN deterministic", _C._get_cudnn_deterministic),
    ProcessState("cuDNN benchmark", _C._get_cudnn_benchmark),
    ProcessState("oneDNN enabled", _C._get_mkldnn_enabled),
    ProcessState("oneDNN deterministic", _C._get_mkldnn_deterministic),
    ProcessState("anomaly detection", _C.is_anomaly_enabled),
    ProcessState("anomaly detection checks NaN", _C.is_anomaly_check_nan_enabled),
    ProcessState("threads", _C.get_num_threads),
    # `torch.nn.attention.sdpa_kernel`: SDPA's kernel choice (and so its output layout,
    # `kernel_layouts.py`) is made while tracing
    ProcessState("flash attention enabled", _C._get_flash_sdp_enabled),
    ProcessState("memory-efficient attention enabled", _C._get_mem_efficient_sdp_enabled),
    ProcessState("math attention enabled", _C._get_math_sdp_enabled),
    ProcessState("cuDNN attention enabled", _C._get_cudnn_sdp_enabled),
    ProcessState("global optimizer step pre-hooks", _optimizer_pre_hooks),
    ProcessState("global optimizer step post-hooks", _optimizer_post_hooks),
)

_READERS = tuple([state.read for state in PROCESS_STATES])
# the same, never raising (each reader called from C: no Python frame per row on a hit)
_SAFE_READERS = tuple([float32_precision if read is _matmul_precision else read
                       for read in _READERS])


def process_state_key() -> tuple:
    """Every row of `PROCESS_STATES`, read now (NOTE [process state in the key])."""
    try:
        return tuple(map(_call, _READERS))
    except RuntimeError:  # the legacy float32 precision getter, with the APIs mixed
        return tuple(map(_call, _SAFE_READERS))


def describe_process_state() -> dict[str, object]:
    """`{name: value}` of every row, for explaining a recompile in words."""
    return {state.name: read() for state, read in zip(PROCESS_STATES, _SAFE_READERS)}


__all__ = ["PROCESS_STATES", "ProcessState", "describe_process_state", "process_state_key"]
