"""The CUDA target of the codegen executor: CUDA C++ kernels for CUDA tensors, built by NVRTC.

`target.py` spells kernel IR values in CUDA C++ (preludes `include/cuda*.h`); `render.py`
renders a pointwise kernel (grid-stride loops, vector loads) and `rows.py` the row schedule
(one block per row, warp-shuffle and shared-memory reductions, split rows, column sums);
`nvrtc.py` compiles, caches and launches them (`cuda-python` imported only inside its
functions); `runtime.py` (`CudaFusedRegion`) plans the layout class of each call.
"""

from fulmen.executors.codegen.cuda.render import Spec, vector_width
from fulmen.executors.codegen.cuda.rows import RowSpec
from fulmen.executors.codegen.cuda.runtime import CudaFusedRegion, render_any
from fulmen.executors.codegen.cuda.target import CUDA, CudaTarget

__all__ = ["CUDA", "CudaFusedRegion", "CudaTarget", "RowSpec", "Spec", "render_any",
           "vector_width"]
