"""The nvFuser executor: fusion regions of prims on CUDA tensors -> nvFuser fusions.

    import fulmen
    jfn = fulmen.jit(fn, executors=["nvfuser", "torch"])   # registered only if nvFuser imports

nvFuser is optional: it is imported only inside this package, and only when a fusion first
runs (`nvfuser_direct` preferred, else the older `nvfuser` frontend). `translate.py` turns a
region into `FusionDefinition` calls; identical regions (equal canonical form) share one
definition, built once. The executor is a `FusionExecutor` registered like any user executor.
NOTE: real nvFuser execution is unverified here: no nvFuser build matches this repo's torch.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from fulmen.core import BoundSymbol
from fulmen.executors.base import FusionExecutor
from fulmen.executors.nvfuser.translate import (
    CLAIMED,
    DTYPES,
    canonical_form,
    claimable,
    translate,
)  # fmt: skip
from fulmen.transforms.fusion import region_inputs

__all__ = ["CLAIMED", "NvFuserExecutor", "frontend", "nvfuser_available"]

VIEWS = frozenset({"reshape", "permute", "squeeze", "slice", "broadcast_in_dim"})
_definitions: dict[tuple, object] = {}  # canonical form -> built FusionDefinition


def nvfuser_available() -> bool:
    """Whether an nvFuser frontend is installed (checked without importing it)."""
    for name in ("nvfuser_direct", "nvfuser"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def frontend():
    """The nvFuser Python module: `nvfuser_direct` when present, else `nvfuser`."""
    try:
        return importlib.import_module("nvfuser_direct")
    except ImportError:
        return importlib.import_module("nvfuser")


class NvFuserRegion:
    """The callable behind one nvFuser fusion symbol: builds (once per canonical form) and
    executes the definition; inputs are made contiguous, as the definition declares them."""

    def __init__(self, name: str, region: list, inputs: list, outputs: list, key: tuple) -> None:
        self.name, self.region, self.inputs, self.outputs, self.key = (
            name, region, inputs, outputs, key)

    def definition(self):
        fd = _definitions.get(self.key)
        if fd is None:
            nvf = frontend()
            dtypes = {dtype: getattr(nvf.DataType, member) for dtype, member in DTYPES.items()}
            with nvf.FusionDefinition() as fd:
                translate(fd, self.region, self.inputs, self.outputs, dtypes)
            _definitions[self.key] = fd
        return fd

    def __call__(self, *inputs):
        tensors = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in inputs]
        outs = self.definition().execute(tensors)
        return outs[0] if len(outs) == 1 else tuple(outs)


class NvFuserExecutor(FusionExecutor):
    """Fuses the prims of `translate.CLAIMED` on CUDA tensors into nvFuser fusions."""

    def __init__(self, name: str = "nvfuser") -> None:
        super().__init__(name)

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        return claimable(bsym)

    def can_fuse_region(self, region: list[BoundSymbol]) -> bool:
        """No view whose result nothing in the region reads: it would be a region output, and
        nvFuser outputs are new tensors where eager's views alias their base."""
        read = {name for bsym in region for name in bsym.input_names}
        return all(bsym.sym.name not in VIEWS or bsym.output.name in read for bsym in region)

    def fuse(self, region: list[BoundSymbol], outputs: list) -> BoundSymbol | None:
        """One `nvfuser.fusionN(inputs...)` statement, or None when the region only computes
        views (or returns one: nvFuser outputs are new tensors, eager's views alias)."""
        producers = {bsym.output.name: bsym.sym.name for bsym in region}
        if all(name in VIEWS for name in producers.values()) or any(
                producers.get(proxy.name) in VIEWS for proxy in outputs):
            return None
        inputs = region_inputs(region)
        key = canonical_form(region, inputs, outputs)
        name = self.next_fusion_name()
        impl = NvFuserRegion(name, region, inputs, outputs, key)
        return self.fusion_statement(name, impl, region, inputs, outputs)


nvfuser_ex = NvFuserExecutor()
