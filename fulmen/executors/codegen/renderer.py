"""What the row renderers of every target share (`cpu/rows.py`, `cuda/rows.py`).

A `RowRenderer` builds the source of one `RowKernel` for one layout (each pointer's inner
class: 1 contiguous, 0 constant along the row, 2 any strides) as a list of lines, `emit`ted at
an indentation depth (two spaces a level). It knows the kernel's pointers (accesses, then
outputs), which of them are row-level, the stage of each value and the column sums, and it
spells one value (`value_line`) through its target, asking the subclass only where the
element a load reads lives (`element`) and how the row's element count is spelled (`count`).
A subclass writes its schedule in `main()`; `render()` returns the source.
"""

from __future__ import annotations

from fulmen.executors.codegen import ir
from fulmen.executors.codegen.target import Target

__all__ = ["RowRenderer"]


class RowRenderer:
    """Builds the source of one row kernel for one layout (see the module docstring)."""

    target: Target

    def __init__(self, kernel: ir.RowKernel, classes: tuple[int, ...]) -> None:
        self.kernel = kernel
        self.classes = classes
        self.nacc = len(kernel.accesses)
        self.dtypes = list(kernel.access_dtypes) + list(kernel.output_dtypes)
        self.nptr = len(self.dtypes)
        assert len(classes) == self.nptr
        self.ptr_rows = list(kernel.access_rows) + list(kernel.output_rows)
        self.stages = ir.row_stages(kernel)
        self.columns = [(self.nacc + k, v) for k, v in enumerate(kernel.outputs)
                        if isinstance(kernel.values[v], ir.ColumnReduce)]
        self.names = [f"v{v}" for v in range(len(kernel.values))]
        self.lines: list[str] = []

    def emit(self, depth: int, *lines: str) -> None:
        """Append `lines`, indented by `depth` levels."""
        self.lines.extend("  " * depth + line for line in lines)

    def element(self, p: int, element: bool) -> str:
        """The element of pointer p a load reads (element level: at inner index j)."""
        raise NotImplementedError

    def count(self, ctype: str) -> str:
        """The number of elements of a row, as a value of C type `ctype`."""
        raise NotImplementedError

    def op_value(self, v: int) -> str:
        """The right-hand side of the op value v (a target may special-case some)."""
        return self.target.value(self.kernel, self.kernel.values[v], self.names)

    def value_line(self, v: int, element: bool = True) -> str:
        """The statement defining value v (a load, constant, count or op)."""
        value = self.kernel.values[v]
        target = self.target
        ctype = target.compute[value.dtype]
        if isinstance(value, ir.Load):
            expr = target.load(self.element(value.access, element), value.dtype)
        elif isinstance(value, ir.Const):
            expr = target.literal(value.value, value.dtype)
        elif isinstance(value, ir.Count):
            expr = self.count(ctype)
        else:
            expr = self.op_value(v)
        return f"const {ctype} v{v} = {expr};"

    def rendered(self, v: int) -> bool:
        """Whether value v is rendered at all (a target may leave out dead values)."""
        return True

    def row_values(self, stage: int, depth: int = 2) -> None:
        """The row-level values of `stage` other than its reductions."""
        kernel = self.kernel
        for v, value in enumerate(kernel.values):
            if (kernel.rows[v] and self.rendered(v) and self.stages[v] == stage
                    and not isinstance(value, ir.Reduce)):
                self.emit(depth, self.value_line(v, element=False))

    def main(self) -> None:
        raise NotImplementedError

    def render(self) -> str:
        """The kernel's source (without the target's prelude)."""
        self.main()
        return "\n".join(self.lines)
