"""The primitive set: a small, closed list of operations every executor can understand.

Each prim is declared once, in the file of its family, with its meta function as the body: the
meta function checks the inputs and returns output proxies; it never computes. Executors
implement prims (the torch executor implements all of them); torch-level ops decompose into
them. `prims.add` etc. are `Symbol`s; calling one outside tracing runs the torch executor's
implementation.
"""

from fulmen.ops.prims.base import PRIMS_NAMESPACE, all_prims, prim
from fulmen.ops.prims.elementwise import *  # noqa: F403
from fulmen.ops.prims.linalg import *  # noqa: F403
from fulmen.ops.prims.reductions import *  # noqa: F403
from fulmen.ops.prims.shape import *  # noqa: F403

__all__ = ["PRIMS_NAMESPACE", "all_prims", "prim"]
