"""Memory estimates of traces: live tensor bytes after each statement, and the peak.

A value is live from the statement that produces it until a `del` statement frees it (traces
after `delete_last_used` free each tensor right after its last use; earlier stages keep
everything until they return). Inputs count from the start. Outputs of view operations
(`BoundSymbol.is_view`, `Tag.VIEW`: `view`, `permute`, slicing, `expand`, ...) share their
input's storage and count 0 bytes; every other output counts its own bytes (`reshape`, which
may copy, and `functionalized.view_scatter`, which writes into a copy of its base, included).
This is an estimate for the torch executor, where such ops return views.
"""

from __future__ import annotations

from dataclasses import dataclass

from fulmen.core import Trace
from fulmen.core.proxy import iter_proxies
from fulmen.proxies import TensorProxy


def _bytes(proxy) -> int:
    return proxy.numel() * proxy.element_size() if isinstance(proxy, TensorProxy) else 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Live bytes after each statement (`timeline[i]` after `statements[i]`), and the peak.

    `timeline[0]` / `statements[0]` describe the inputs alone.
    """

    statements: tuple[str, ...]
    timeline: tuple[int, ...]
    peak: int

    @property
    def peak_mib(self) -> float:
        return self.peak / 2**20


def memory_estimate(trace: Trace) -> MemoryEstimate:
    """Estimate live tensor bytes through `trace` (see the module docstring).

    Example:
        >>> est = fulmen.memory_estimate(fulmen.last_traces(jfn)[-1])
        >>> est.peak, len(est.timeline)
    """
    live: dict[str, int] = {p.name: _bytes(p) for p in trace.args}
    statements, timeline = ["(inputs)"], [sum(live.values())]
    for bsym in trace.bsyms:
        if bsym.is_del:
            for proxy in iter_proxies(bsym.args):
                live.pop(proxy.name, None)
        else:
            for proxy in bsym.proxy_outputs:
                live[proxy.name] = 0 if bsym.is_view else _bytes(proxy)
        statements.append(bsym.sym.python_name)
        timeline.append(sum(live.values()))
    return MemoryEstimate(tuple(statements), tuple(timeline), max(timeline))


def plot_memory(*traces: Trace, labels: list[str] | None = None, ax=None):
    """Draw the memory timeline of each trace (MiB per statement) with matplotlib.

    Returns the matplotlib Axes. Raises ImportError if matplotlib is not installed.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    labels = labels or [trace.provenance for trace in traces]
    for trace, label in zip(traces, labels):
        estimate = memory_estimate(trace)
        ax.plot([b / 2**20 for b in estimate.timeline],
                label=f"{label} (peak {estimate.peak_mib:.1f} MiB)")
    ax.set_xlabel("statement")
    ax.set_ylabel("live MiB")
    ax.legend()
    return ax
