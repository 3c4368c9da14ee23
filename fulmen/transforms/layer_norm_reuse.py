"""A backward's layer norm output taken from the statistics call it makes anyway (issue 21:
GPT-2's training step).

On the CPU the layer norm VJP calls eager's kernels (NOTE [layer norm backward]):
`native_layer_norm` for the mean and 1/std, then `native_layer_norm_backward`. When the
backward also needs the layer norm's output (rematerialization recomputes it for the weight
gradient of the linear that reads it), it ran `F.layer_norm` on the same input as well: the
same kernel twice. `reuse_layer_norm` drops that `F.layer_norm` and reads the first output of
the `native_layer_norm` call, moved up to where the `F.layer_norm` was. Both are eager's
`native_layer_norm` on the same arguments (`F.layer_norm` on the CPU is that kernel's first
output), so the values are the same bits. Tiny GPT-2's backward runs 5 layer norms fewer.

Only pairs reading the same input, normalized shape, weight, bias and eps, whose outputs agree
in shape, dtype, device and strides, and whose `F.layer_norm` output the trace does not return.
"""

from __future__ import annotations

from fulmen.core import BoundSymbol, Trace
from fulmen.core.proxy import Proxy
from fulmen.ops import ltorch
from fulmen.transforms.autodiff.rules_composite import NATIVE_LAYER_NORM
from fulmen.transforms.base import transform

__all__ = ["reuse_layer_norm"]

_PARAMETERS = ("input", "normalized_shape", "weight", "bias", "eps")
_DEFAULTS = {"weight": None, "bias": None, "eps": 1e-05}


def _arguments(bsym: BoundSymbol) -> tuple | None:
    """`(input, normalized_shape, weight, bias, eps)` of a layer norm call, comparable across
    the two spellings (proxies by name), or None when it is neither."""
    if bsym.sym is not ltorch.layer_norm and bsym.sym is not NATIVE_LAYER_NORM:
        return None
    if len(bsym.args) > len(_PARAMETERS) or set(bsym.kwargs) - set(_PARAMETERS):
        return None
    bound = dict(_DEFAULTS, **dict(zip(_PARAMETERS, bsym.args)), **bsym.kwargs)
    if set(bound) != set(_PARAMETERS):
        return None
    key = []
    for name in _PARAMETERS:
        value = bound[name]
        if isinstance(value, Proxy):
            key.append(("proxy", value.name))
        elif name == "normalized_shape":
            key.append(("shape", tuple(value)))
        elif name == "eps":
            key.append(("eps", float(value)))
        else:
            key.append(value)
    return tuple(key)


def _same_layout(a, b) -> bool:
    return (tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and a.device == b.device
            and tuple(a.stride()) == tuple(b.stride()))


@transform("layer norm reuse")
def reuse_layer_norm(trace: Trace) -> Trace:
    """Drop each `F.layer_norm` whose output a `native_layer_norm` call of the same arguments
    gives too, moving that call to its place (module docstring); a trace without such a pair
    is returned as is."""
    natives: dict[tuple, int] = {}
    for index, bsym in enumerate(trace.bsyms):
        if bsym.sym is NATIVE_LAYER_NORM:
            key = _arguments(bsym)
            if key is not None:
                natives.setdefault(key, index)
    if not natives:
        return trace
    returned = trace.output_names
    placed: dict[int, int] = {}  # position -> the native call emitted there
    dropped: set[int] = set()  # the F.layer_norm statements and the moved native calls
    renames: dict[str, Proxy] = {}
    for index, bsym in enumerate(trace.bsyms):
        if bsym.sym is not ltorch.layer_norm or bsym.output.name in returned:
            continue
        native = natives.get(_arguments(bsym))
        if native is None or native in dropped or native in placed.values():
            continue
        first = trace.bsyms[native].output[0]
        if not _same_layout(first, bsym.output):
            continue
        placed[min(index, native)] = native
        dropped.add(max(index, native))
        renames[bsym.output.name] = first
    if not renames:
        return trace

    def rename(proxy: Proxy) -> Proxy:
        return renames.get(proxy.name, proxy)

    bsyms = []
    for index, bsym in enumerate(trace.bsyms):
        if index in placed:
            bsym = trace.bsyms[placed[index]]
        elif index in dropped:
            continue
        bsyms.append(bsym.renamed(rename) if bsym.input_names & renames.keys() else bsym)
    return trace.replace(bsyms=tuple(bsyms))
