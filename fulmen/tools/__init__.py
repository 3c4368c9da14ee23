"""Tools for looking at what fulmen does (top layer; nothing below imports them except `jit`'s
error messages, which append an `examine` report):

- `examine.py`: `fulmen.examine`, what traces, what runs opaquely, what cannot be traced;
- `verify.py`: `fulmen.verify`, the first stage and statement that diverge from eager, repros;
- `minimize.py`: shrinks a failing trace to a standalone script (`verify(..., minimize=True)`);
- `accuracy.py`: the float64 accuracy rule used by `verify`, the fuzzers and the model tests;
- `profile.py`: `fulmen.profile`, time per statement of the execution traces;
- `memory.py`: `fulmen.memory_estimate` / `plot_memory`, live bytes per statement.

The public entry points are re-exported by `fulmen/__init__.py`; this package imports none of
its modules itself (`jit` imports `examine`, and `verify` imports `jit`).
"""
