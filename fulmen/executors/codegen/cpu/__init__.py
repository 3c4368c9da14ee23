"""The CPU target of the codegen executor: C++ kernels for CPU tensors.

`target.py` spells kernel IR values in C++ (prelude `include/cpu.h`); `render.py` renders a
pointwise kernel and `rows.py` the row schedule, one OpenMP loop nest per kernel; `compiler.py`
builds them with the system compiler into the disk cache; `pool.py` serves large outputs from
reused memory; `runtime.py` (`FusedRegion`) plans and calls them.
"""

from fulmen.executors.codegen.cpu.runtime import FusedRegion, render_any
from fulmen.executors.codegen.cpu.target import CPU, CppTarget

__all__ = ["CPU", "CppTarget", "FusedRegion", "render_any"]
