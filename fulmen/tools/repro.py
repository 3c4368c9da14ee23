"""Statements and traces as Python that runs in a fresh process, for the repro scripts of
`verify` and `minimize`: opaque ops and executors' operators print as the torch callables they
run (`portable_trace`), and a fusion is rebuilt by its executor from its region
(`rebuild_fusion`: its symbol exists only in the process that fused it).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, FulmenError, Symbol, Trace
from fulmen.core.printer import print_trace
from fulmen.core.proxy import iter_proxies
from fulmen.core.symbol import Namespace
from fulmen.core.trace import TraceCtx, tracing
from fulmen.executors import Executor
from fulmen.executors.registry import get_executor
from fulmen.ops.torch import torch_qualname
from fulmen.proxies import TensorProxy


def rebuild_fusion(executor: str, body, inputs: list[tuple]):
    """Fuse a region again, in this process, with the executor called `executor`; return a
    callable taking the region's inputs in order. How repro scripts run a fusion: its symbol
    exists only in the process that fused it.

    `body` is the region as a Python function of prims (a printed trace); `inputs` gives each
    input's `(name, shape, dtype, device, strides)`.

    Raises:
        FulmenError: when the executor no longer fuses the region.
    """
    fuser = get_executor(executor)
    ctx = TraceCtx("region")
    proxies = [TensorProxy(name, shape, dtype, device, strides=strides)
               for name, shape, dtype, device, strides in inputs]
    with tracing(ctx):
        outputs = list(iter_proxies(body(*proxies)))
    fused = fuser.fuse(list(ctx.bsyms), outputs)
    if fused is None:
        raise FulmenError("the executor does not fuse the region again", op=f"{executor}.fuse")
    names = [p.name for p in proxies]

    def run(*values):
        by_name = dict(zip(names, values))
        return fused.sym.impl(*[by_name[p.name] for p in fused.args])

    return run


def fusion_preamble(bsym: BoundSymbol) -> tuple[str, BoundSymbol]:
    """Source that rebuilds fusion `bsym` in a fresh process (its region as a function, fused
    again by its executor), and `bsym` calling the rebuilt fusion by a plain name."""
    name = bsym.sym.name
    body = Trace(f"{name}_region", tuple(bsym.proxy_inputs), bsym.subsymbols, bsym.output)
    specs = ", ".join(f"({p.name!r}, {tuple(p.shape)}, {p.dtype}, {str(p.device)!r}, "
                      f"{tuple(p.stride())})" for p in bsym.proxy_inputs)
    executor = bsym.sym.executor.name
    lines = [print_trace(body)[0]]
    if executor == "codegen":  # compile the kernel now, not after the region gets hot
        lines.append("from fulmen.executors.codegen import set_compile_policy\n"
                     "set_compile_policy('eager')")
    lines.append(f"from fulmen.tools.repro import rebuild_fusion\n"
                 f"{name} = rebuild_fusion({executor!r}, {name}_region, [{specs}])")
    local = Symbol(name, None, namespace=Namespace(name, None, ""), python_name=name,
                   impl=bsym.sym.impl, tags=bsym.sym.tags)
    return "\n".join(lines), bsym.replace(sym=local, args=tuple(bsym.proxy_inputs), kwargs={})


_TORCH = Namespace("torch", "torch", "import torch")


def _portable_symbol(sym):
    """`sym`, or a stand-in printed as the torch callable it runs, when its own name resolves
    only in this process (opaque ops, operators of executors: `torchex.op_gelu_default`)."""
    if not isinstance(sym, Symbol) or not (sym.namespace.alias == "opaque"
                                           or isinstance(sym.namespace.value, Executor)):
        return sym
    fn = sym.impl
    path = f"torch.ops.{fn}" if isinstance(fn, torch._ops.OpOverload) else torch_qualname(fn)
    if path is None:
        return sym
    return Symbol(sym.name, None, namespace=_TORCH, python_name=path, impl=fn, tags=sym.tags)


def portable_statement(bsym: BoundSymbol) -> BoundSymbol:
    """`bsym` with its symbol, and symbols among its arguments, made portable."""
    args, kwargs = pytree.tree_map(_portable_symbol, (bsym.args, bsym.kwargs))
    return bsym.replace(sym=_portable_symbol(bsym.sym), args=args, kwargs=kwargs)


def portable_trace(trace: Trace) -> Trace:
    """`trace` with every statement `portable_statement`: it prints as Python that runs in a fresh
    process (opaque ops and executors' operators as the torch callables they run)."""
    return trace.replace(bsyms=tuple(portable_statement(bsym) for bsym in trace.bsyms))


__all__ = ["fusion_preamble", "portable_statement", "portable_trace", "rebuild_fusion"]
