"""`fulmen.examine`: what fulmen makes of a function or module, without raising.

    report = fulmen.examine(model, ids)      # prints the report and returns it
    report.opaque                            # {"torch.nn.functional.interpolate": ["model.py:41"]}
    report.errors                            # what stops tracing (or autodiff), with file:line

It traces the call once (inputs and module state are not modified: traced code never runs) and
sorts every recorded statement into

- decomposed: torch-level ops fulmen decomposes into prims (fusable, differentiable by rule);
- opaque: ops with no decomposition, run whole by torch (traced through PyTorch's meta kernel);
  those whose decomposition declined these arguments are listed as fallbacks;
- functionalized: in-place updates rewritten functionally, and write-backs to inputs/buffers;
- errors: what cannot be traced: the first construct that stops tracing (value-dependent
  control flow, an op without a meta kernel...) and, when an input requires grad, ops that
  cannot be differentiated.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fulmen.core import FulmenError
from fulmen.ops.functionalized import is_functionalized
from fulmen.ops.torch import symbol_for, torch_qualname
from fulmen.tracer.dispatch import TracerCtx
from fulmen.tracer.tracer import trace_program
from fulmen.transforms.autodiff import split_forward_backward
from fulmen.transforms.segments import split_at_breaks


@dataclass
class ExamineReport:
    """The result of `fulmen.examine`: op names mapped to the `file:line`s that call them.

    Attributes:
        decomposed: torch-level ops fulmen decomposes.
        opaque: ops run whole by torch (no decomposition).
        fallbacks: the subset of `opaque` whose decomposition exists but declined the arguments.
        functionalized: in-place updates and write-backs.
        errors: `(op, where, message)` for what cannot be traced or differentiated.
        traced: whether the whole call traced.
    """

    decomposed: dict[str, list[str]] = field(default_factory=dict)
    opaque: dict[str, list[str]] = field(default_factory=dict)
    fallbacks: dict[str, list[str]] = field(default_factory=dict)
    functionalized: dict[str, list[str]] = field(default_factory=dict)
    errors: list[tuple[str, str, str]] = field(default_factory=list)
    breaks: list[str] = field(default_factory=list)
    traced: bool = False

    @property
    def ok(self) -> bool:
        """Whether fulmen can compile the call (it may still run some ops opaquely)."""
        return self.traced and not self.errors

    def __str__(self) -> str:
        lines = [f"fulmen.examine: {'traced' if self.traced else 'NOT traced'}; "
                 f"{len(self.decomposed)} decomposed op(s), {len(self.opaque)} opaque op(s), "
                 f"{len(self.functionalized)} in-place kind(s), {len(self.errors)} error(s)"]
        sections = [("decomposed into prims", self.decomposed),
                    ("opaque (run whole by torch)", self.opaque),
                    ("  of which the decomposition declined these arguments", self.fallbacks),
                    ("functionalized in-place updates", self.functionalized)]
        for title, ops in sections:
            if ops:
                lines.append(f"{title}:")
                for op, places in sorted(ops.items()):
                    shown = ", ".join(sorted(set(places))[:4])
                    more = len(set(places)) - 4
                    lines.append(f"  {op} x{len(places)}  ({shown}{f', +{more}' if more > 0 else ''})")
        if self.breaks:
            lines.append("graph breaks (value-dependent Python; the program is split there):")
            lines.extend(f"  {info}" for info in self.breaks)
        if self.errors:
            lines.append("cannot be traced:")
            for op, where, message in self.errors:
                lines.append(f"  {op} at {where}: {message}")
        return "\n".join(lines)


def _where(bsym) -> str:
    return bsym.source.short if bsym.source is not None else "?"


def _classify(bsyms, report: ExamineReport) -> None:
    for bsym in bsyms:
        sym = bsym.sym
        if is_functionalized(sym):
            name = "write-back to input/buffer" if "write_back" in sym.tags else sym.name
            report.functionalized.setdefault(name, []).append(_where(bsym))
        elif "opaque" in sym.tags and sym.torch_fn is not None:
            name = torch_qualname(sym.torch_fn) or sym.python_name
            report.opaque.setdefault(name, []).append(_where(bsym))
            if symbol_for(sym.torch_fn) is not None:
                report.fallbacks.setdefault(name, []).append(_where(bsym))
        else:
            report.decomposed.setdefault(sym.python_name, []).append(_where(bsym))


def examine(fn: Callable | torch.nn.Module, *args, **kwargs) -> ExamineReport:
    """Trace `fn(*args, **kwargs)` and print which ops are decomposed, which run opaquely
    and what cannot be traced (with `file:line`); never raises for the user's code.

    Works for functions and `nn.Module`s. Returns the `ExamineReport` it printed
    (`examine_quietly` returns it without printing).

    Example:
        >>> report = fulmen.examine(lambda x: torch.special.i0(x).sum(), torch.randn(3))
        >>> report.opaque
        {'torch.special.i0': ['<stdin>:1']}
    """
    report = ExamineReport()
    module = fn if isinstance(fn, torch.nn.Module) else None
    ctx = TracerCtx()
    program = None
    try:
        program = trace_program(fn, args, kwargs, module=module, ctx=ctx, allow_breaks=True)
        report.traced = True
        report.breaks = [str(info) for info in program.breaks]
    except FulmenError as error:
        report.errors.append((error.op or "?", str(error.where or "?"), _message(error)))
    except Exception as error:  # an error of the user's code itself, seen on proxies
        report.errors.append((type(error).__name__, "?", str(error).splitlines()[0]))
    _classify(program.trace.bsyms if program is not None else ctx.bsyms, report)
    if program is not None and torch.is_grad_enabled() and any(
            p.requires_grad for p in program.trace.args):
        try:
            for segment in split_at_breaks(program.trace, program.requires_grad_names):
                if any(p.requires_grad for p in segment.trace.args) and segment.trace.output:
                    split_forward_backward(segment.trace)
        except FulmenError as error:
            report.errors.append((error.op or "?", str(error.where or "?"),
                                  "(autodiff) " + _message(error)))
    print(report)
    return report


def examine_quietly(fn: Callable | torch.nn.Module, *args, **kwargs) -> ExamineReport:
    """`examine` without printing."""
    with contextlib.redirect_stdout(io.StringIO()):
        return examine(fn, *args, **kwargs)


def _message(error: FulmenError) -> str:
    text = str(error).splitlines()[0]
    prefix = f"{error.op}: "
    return text.removeprefix(prefix)


__all__ = ["ExamineReport", "examine"]
