"""Passes: pure functions from trace to trace (dce, deletion, decomposition, ...)."""

from fulmen.transforms.base import transform
from fulmen.transforms.dce import dce
from fulmen.transforms.decompose import decompose_to_prims
from fulmen.transforms.deletion import delete_last_used

__all__ = ["dce", "decompose_to_prims", "delete_last_used", "transform"]
