"""fulmen: a trace-based, source-to-source compiler for PyTorch.

    import fulmen
    jfn = fulmen.jit(fn)
    jfn(x)
    print(fulmen.last_traces(jfn)[-1])
"""

from fulmen import executors as _executors  # noqa: F401
from fulmen.core import FulmenError, NotYetSupportedError, Trace
from fulmen.executors import (
    get_default_executors,
    get_executor,
    register_executor,
    set_default_executors,
)
from fulmen.executors.codegen import codegen_ex as _codegen_ex
from fulmen.executors.codegen import kernel_sources as _kernel_sources
from fulmen.executors.python import python_ex
from fulmen.executors.torch import torch_ex
from fulmen.functional import grad, value_and_grad, vjp
from fulmen.jit import (
    cache_hits,
    cache_misses,
    compile_stats,
    jit,
    last_backward_traces,
    last_traces,
)
from fulmen.tools.examine import ExamineReport, examine
from fulmen.tools.memory import MemoryEstimate, memory_estimate, plot_memory
from fulmen.tools.profile import Profile, profile
from fulmen.tools.verify import VerifyReport, verify
from fulmen.tracer.shape_policy import mark_dynamic, mark_static

set_default_executors([_codegen_ex, torch_ex])


def last_kernels(jfn) -> dict[str, str]:
    """The generated source of each kernel of `jfn`'s last compilation (forward, then backward
    trace), by fusion name: `print(fulmen.last_kernels(jfn)["fusion0"])`."""
    return _kernel_sources(*last_traces(jfn)[-1:], *last_backward_traces(jfn)[-1:])


__version__ = "0.1.0"

__all__ = [
    "FulmenError",
    "NotYetSupportedError",
    "Trace",
    "cache_hits",
    "cache_misses",
    "ExamineReport",
    "examine",
    "compile_stats",
    "get_default_executors",
    "get_executor",
    "grad",
    "jit",
    "last_backward_traces",
    "last_kernels",
    "last_traces",
    "mark_dynamic",
    "mark_static",
    "memory_estimate",
    "MemoryEstimate",
    "plot_memory",
    "Profile",
    "profile",
    "python_ex",
    "register_executor",
    "set_default_executors",
    "torch_ex",
    "value_and_grad",
    "verify",
    "VerifyReport",
    "vjp",
]
