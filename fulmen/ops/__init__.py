"""The op library: `prims` (the primitive set, each with a meta function), `ltorch` (the torch
API users call, each op decomposed into prims) and the opaque fallback for every other torch op.
"""

from fulmen.ops import prims
from fulmen.ops import torch as ltorch
from fulmen.ops.opaque import opaque_symbol

__all__ = ["ltorch", "opaque_symbol", "prims"]
