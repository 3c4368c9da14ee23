"""Which dimensions get symbolic sizes, and the cache of entries compiled with them.

Policy, as torch.compile's (`fulmen.jit(dynamic=...)`):
- `dynamic=None` (default): the first call is compiled for its exact shapes; when a later call
  misses the cache and an argument (by name, with the same rank) has other sizes than at an
  earlier miss, the dimensions that changed become dynamic and the call is traced once with
  symbolic sizes there.
- `dynamic=True`: every dimension of every tensor argument is symbolic from the first call.
- `dynamic=False`: never symbolic, except where marked.
`fulmen.mark_dynamic(t, dim)` / `mark_static(t, dim)` (or `torch._dynamo.mark_dynamic`) on an
argument override the policy for that dimension.

Sizes 0 and 1 are specialised (`fulmen.tracer.symbolic`), with one exception under
`dynamic=None`: when a size of a tensor argument starts to vary, its sizes that are 1 and did
not change (the batch of 1 of `(1, seq)` token ids whose length varies) are traced with
symbols too, not specialised to 1. Every decision the trace makes about such a size is a guard
evaluated at 1, so the entry serves a batch of 4 only when no branch depended on the 1; then a
sweep over lengths and batches compiles twice (torch.compile's automatic dynamic, which
specialises the 1, compiles three times). A size seen to vary that drops back to 1 (a decoder's
cache at the first step of another `generate`) is generalised the same way (NOTE [a varying
size back at 1]). An entry with symbolic sizes is
found by a key that leaves those sizes out, then checked with its shape guard.

Integer arguments (litgpt's `input_pos_maxp1`, HF's `logits_to_keep`) and integers held by an
object argument (an HF cache layer's `cumulative_length`) follow the same policy: one that
changed between two calls (named by its argument path, whatever the call's structure) is
traced as a symbol
(`SymbolicSizes.symbolize_int`), its value left out of the key and checked by the shape guard
(NOTE [what a symbolic int cannot answer]).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fulmen.tracer.call_values import (
    int_values,
    is_learning_rate,
    number_in_tuple,
    root_floats,
    tensor_shapes,
)
from fulmen.tracer.objects import path_text
from fulmen.tracer.symbolic import FLOAT, INT, STRIDES, is_symbolic, tensor_at

_RECOMPILES = logging.getLogger("fulmen.recompiles")  # the topic of `fulmen.logs`


def mark_dynamic(tensor: torch.Tensor, dim: int | tuple[int, ...], *, min: int | None = None,
                 max: int | None = None) -> None:
    """Give dimension(s) `dim` of `tensor` a symbolic size when a jitted function is traced
    with it as an argument, whatever the `dynamic=` policy.

    `min`/`max` bound the sizes the compiled entry accepts (inclusive); a call outside them is
    compiled again. Sizes 0 and 1 are specialised regardless (as in torch.compile).

    Raises:
        IndexError: when a dimension is out of range for `tensor`.
    """
    for d in (dim,) if isinstance(dim, int) else tuple(dim):
        d = _dim(tensor, d)
        tensor._fulmen_dynamic_dims = {**getattr(tensor, "_fulmen_dynamic_dims", {}),
                                       d: (min, max)}


def mark_static(tensor: torch.Tensor, dim: int | tuple[int, ...]) -> None:
    """Keep dimension(s) `dim` of `tensor` specialised to their exact size.

    Raises:
        IndexError: when a dimension is out of range for `tensor`.
    """
    for d in (dim,) if isinstance(dim, int) else tuple(dim):
        tensor._fulmen_static_dims = getattr(tensor, "_fulmen_static_dims", set()) | {
            _dim(tensor, d)}


def _dim(tensor: torch.Tensor, dim: int) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise IndexError(f"dimension {dim} out of range for a tensor of {tensor.dim()} dims")
    return dim % tensor.dim()


# NOTE [what a symbolic int cannot answer]
# A SymInt answers arithmetic, comparisons (each a guard), `int()`/`range()` and, from user code,
# `str(n)`/`f"{n}"` (a guard on its value: `fulmen.tracer.formatting`) and `isinstance(n, int)`
# (True, as for the number: `fulmen.tracer.int_answers`, HF's `slice_logits_to_keep` asks it).
# What it cannot answer is `type(n) is int`: False, where eager's number says True. Such a
# check in user code on an integer argument that varies would take the other path; `type` is
# not replaceable as `isinstance` is, and the check is rare next to `isinstance` (HF, litgpt
# and torch's own Python use `isinstance`).


# NOTE [a varying size back at 1]
# A decoder's self-attention cache grows 1, 2, 3... at each `generate`; at the second prompt
# length the encoder's (cross-attention) length varies too, so the first decoding step misses
# the cache with a self-attention length of 1. Specialised to 1, that entry serves no later
# step, each of which misses again (T5: past `cache_size_limit`, eagerly). A dim seen to vary
# that was seen to grow from 1 between two misses of the same structure (consecutive decoding
# steps) and whose size dropped back to 1 since the last miss is traced with a symbol instead,
# as the batch of 1 beside a varying length is: every decision about it is a guard evaluated
# at 1, so the entry serves the lengths >= 2 that follow only where no branch depended on the
# 1. Token ids keep their 1: their length goes prompt -> 1 -> another prompt across calls of
# other structures (prefill without a cache, decoding with one), never 1 -> 2 within one, and a
# query length generalised at 1 would gain nothing where HF passes SDPA `is_causal=q_len > 1`
# (decided with a guard `q_len <= 1`: `fulmen.tracer.bool_args`). A trace that fails with such
# a 1 turns this off (`drop_ones`), before the batch-of-1 generalisation.


# NOTE [strides that vary under fixed sizes]
# A decoding loop that feeds `generated[:, -1:]` (HF classifier-free guidance's unconditional
# step, hand-written loops) passes a (1, 1) view whose row stride is the length of `generated`:
# the sizes never change, the strides change at every call. Keyed by its exact strides (eager's
# `clone`/`empty_like` copy them, size-1 dims included), such a view compiled once per step. An
# argument whose strides changed between two misses while its sizes did not is traced with free
# strides (`STRIDES` alone in its dims): each stride that is no product of the others gets a
# symbol of its own (NOTE [strides of a view input]), which the shape guard checks, and the key
# leaves the strides out (`leaf_keys._masked_key`).

# NOTE [a deferred first call]
# Under the automatic policy a sweep of shapes compiles twice: the first call for its exact
# shapes, the second (another length) with symbolic sizes, after which the first entry is
# dropped (`_drop_subsumed`): it served one call. With `FULMEN_DYNAMIC=defer` the first call
# runs eagerly and only records its shapes (`record_first_call`), as a miss would; the second
# compiles for its exact shapes if they are the first's, else with symbols where they changed
# (and the 1s beside them generalised): one compilation for the sweep. Only where an eager run
# is allowed (not under `fullgraph=True`, not for `fulmen.grad`), and not by default: the
# first call of a jitted function then has no traces to show (`fulmen.last_traces`).
# Deferring the second distinct shape instead keeps both compilations (and adds an eager call).
# Session 50, tiny HF Llama training sweep, CPU ms (`benchmarks/dynamic.py --breakdown`): eager
# 147; static compile 186, symbolic 266, the other 34 calls 187 (116 again: 71 are new shapes'
# kernel call plans).

class DynamicDims:
    """The dimensions a jitted callable treats as dynamic, and its entries with symbolic sizes.

    `dims_for(leaves)` decides the dimensions for a call that missed the cache; `lookup`
    finds a symbolic entry valid for a call; `add` stores one.
    """

    def __init__(self, dynamic: bool | None, defer_first: bool = False) -> None:
        self.dynamic = dynamic
        # NOTE [a deferred first call]: whether the first miss runs eagerly, and whether it has
        self.defer_first = defer_first and dynamic is None
        self.first_recorded = False
        # argument name (`label` of `dims_for`) -> dims seen to change
        self.varying: dict[str, set[int]] = {}
        # names of tensor arguments seen as views (not contiguous) at some calls and contiguous
        # at others (a cache cropped at some decoding steps only): traced with free strides
        # once their sizes vary (NOTE [strides of a view input]); one always a view keeps
        # strides written with its sizes, which layout rules can order (SDPA's output follows
        # a transposed query's layout)
        self.views: set[str] = set()
        self.contiguous: set[str] = set()
        # argument name -> dims of size 1 generalised (not specialised to 1) when traced
        self.ones: dict[str, set[int]] = {}
        self.generalise_ones = True  # off once a trace with them failed (`drop_ones`)
        # a size that was seen to vary and has just dropped back to 1 (a decoder's cache at the
        # first step of another `generate`) is generalised too, until a trace with such a 1
        # fails (`drop_ones`); whether the last `dims_for` generalised one
        self.generalise_restarts = True
        self.generalised_restart = False
        # argument name -> dims seen to grow from 1 between two misses of the same structure
        # (a cache at consecutive decoding steps), and the names of the last miss
        self.grown: dict[str, set[int]] = {}
        self.last_names: list[str] | None = None
        # argument name -> its shape at the last call that missed the cache, and its strides
        self.seen: dict[str, tuple[int, ...]] = {}
        self.seen_strides: dict[str, tuple[int, ...]] = {}
        # names of tensor arguments whose strides changed while their sizes did not (NOTE
        # [strides that vary under fixed sizes]): traced with free strides
        self.strides_vary: set[str] = set()
        self.entries: list = []
        self.by_key: dict[tuple, list] = {}
        self.broken = False  # a symbolic trace failed: automatic dynamic is off
        # integers, by argument path: the value at the last call that missed the cache, the
        # names of those seen to change (`dims_for`), and whether a trace with symbolic
        # integers failed (then they stay constants)
        self.last_ints: dict[str, int] = {}
        self.varying_ints: set[str] = set()
        self.ints_broken = False
        # floats, as integers: those seen to change are read at run time (NOTE [floats read
        # at run time] in `fulmen.ops.host_float`); `float_positions`, every position traced
        # so, is what the cache key leaves their values out of (`guards.CallGuard`)
        self.last_floats: dict[str, float] = {}
        self.varying_floats: set[str] = set()
        self.float_positions: set = set()
        self.floats_broken = False
        # `t.item()` of floating tensors read at run time in every trace (not a graph break),
        # once such a break gave a new float answer (Adam's step count); off for good once a
        # trace so failed
        self.items_at_run_time = False
        self.items_broken = False

    def dims_for(self, leaves: list, label=str, roots: list = ()) -> dict[Any, tuple[int, ...]]:
        """The dimensions of the call's tensor arguments to trace with symbolic sizes;
        `label(position)` names an argument (and the `recompiles` log).

        A size varies when it differs from the size the same argument (by name, with the same
        rank) had at an earlier call that missed the cache, whatever the other arguments were:
        a generate over another prompt length starts with calls of another structure (the
        prefill without a cache), so comparing only calls of one structure would never see the
        encoder's length change, and would compile each decode step again for each length."""
        shapes = tensor_shapes(leaves)
        names = [label(i) for i, _ in shapes]
        # argument name -> its dims seen to grow from 1 that are 1 again now, having been
        # larger at the last miss: generalised (NOTE [a varying size back at 1])
        restarts: dict[str, set[int]] = {}
        self.generalised_restart = False
        same_structure, self.last_names = names == self.last_names, names
        if self.dynamic is None and not self.broken:
            for name, (i, new) in zip(names, shapes):
                old = self.seen.get(name)
                if old is None or len(old) != len(new):
                    continue
                strides = tensor_at(leaves, i).stride()
                if old == new and self.seen_strides.get(name, strides) != strides \
                        and name not in self.strides_vary:
                    _RECOMPILES.info("%s: strides vary (%s -> %s) at fixed sizes; tracing them "
                                     "symbolically", name, self.seen_strides[name], strides)
                    self.strides_vary.add(name)
                changed = {d for d, (a, b) in enumerate(zip(new, old)) if a != b}
                if same_structure:
                    self.grown.setdefault(name, set()).update(
                        d for d in changed if old[d] == 1 and new[d] > 1)
                if self.generalise_ones and self.generalise_restarts:
                    restarts[name] = {d for d in changed & self.grown.get(name, set())
                                      if new[d] == 1}
                if changed - self.varying.get(name, set()):
                    _RECOMPILES.info("%s: size %s varies; tracing it symbolically", name,
                                     ", ".join(f"{d} ({old[d]} -> {new[d]})" for d in sorted(changed)))
                    self.varying.setdefault(name, set()).update(changed)
                    # a size 1 beside a size that varies (the batch of 1 of a length sweep)
                    # is generalised too, unless it is what changed (1 token when decoding)
                    if self.generalise_ones:
                        ones = {d for d, size in enumerate(new) if size == 1 and d not in changed}
                        self.ones.setdefault(name, set()).update(ones)
                        self.varying[name] |= ones
        self.seen.update(zip(names, (shape for _, shape in shapes)))
        self.seen_strides.update((name, tensor_at(leaves, i).stride())
                                 for name, (i, _) in zip(names, shapes))
        dims: dict[int, set[int]] = {}
        for name, (i, shape) in zip(names, shapes):
            leaf = tensor_at(leaves, i)
            chosen = set(range(len(shape))) if self.dynamic is True else set(
                d for d in self.varying.get(name, ()) if d < len(shape))
            chosen |= set(getattr(leaf, "_fulmen_dynamic_dims", {}))
            chosen |= set(getattr(leaf, "_dynamo_dynamic_indices", ()))
            chosen -= getattr(leaf, "_fulmen_static_dims", set())
            ones = self.ones.get(name, set())
            restarted = restarts.get(name, set()) & chosen
            self.generalised_restart |= bool(restarted)
            chosen = {d for d in chosen if shape[d] > 1 or (shape[d] == 1 and d in ones)} \
                | restarted
            if chosen or name in self.strides_vary:
                dims[i] = chosen
            (self.contiguous if leaf.is_contiguous() else self.views).add(name)
        views = {i for name, (i, _) in zip(names, shapes)
                 if name in self.views and name in self.contiguous}
        views |= {i for name, (i, _) in zip(names, shapes) if name in self.strides_vary}
        found = {i: (*sorted(d), STRIDES) if i in views else tuple(sorted(d))
                 for i, d in dims.items()}
        found.update({position: INT for position in self._ints_for(leaves, label, roots)})
        found.update({position: FLOAT for position in self._floats_for(leaves, label, roots)})
        return found

    def _floats_for(self, leaves: list, label, roots: list) -> list:
        """The positions of the call's floats (arguments, inside object arguments and inside
        the function's own objects `roots`) to read at run time: those seen to change between
        two calls that missed the cache, and those read so by an earlier entry (the key
        leaves their values out)."""
        if self.dynamic is False or self.floats_broken:
            return []
        # (a float inside a tuple that `ObjectInputs.swap_in` cannot rebuild stays a
        # constant, keyed by its value)
        floats = [(position, value) for position, value in
                  int_values(leaves, float) + root_floats(list(roots))
                  if not number_in_tuple(leaves, roots, position)]
        names = [_number_name(label, position) for position, _ in floats]
        _note_changes(names, [value for _, value in floats], self.last_floats,
                      self.varying_floats, "float", "reading it at run time")
        chosen = [position for name, (position, _) in zip(names, floats)
                  if name in self.varying_floats or position in self.float_positions
                  or is_learning_rate(leaves, roots, position)]
        self.float_positions.update(chosen)
        return chosen

    def items_instead(self, reason: str, answer: Any) -> bool:
        """A graph break (named `reason`) gave the new answer `answer`: whether calls should
        now be traced with `t.item()` read at run time instead (a float answer of `item`, the
        first time; the caller drops the entry and compiles the call again)."""
        if self.items_at_run_time or self.items_broken or self.dynamic is False \
                or not reason.startswith("item(") or type(answer) is not float:
            return False
        _RECOMPILES.info("%s: a new float answer (%s); reading such items at run time",
                         reason, answer)
        self.items_at_run_time = True
        return True

    def drop_items(self) -> None:
        """A trace reading `t.item()` at run time failed: graph breaks again, for good."""
        self.items_at_run_time = False
        self.items_broken = True

    def remove(self, entry) -> None:
        """Forget the symbolic entry `entry` (if it is one)."""
        if entry in self.entries:
            self.entries.remove(entry)
            for found in self.by_key.values():
                if entry in found:
                    found.remove(entry)

    def drop_floats(self, dynamic: dict) -> bool:
        """A trace with the floats of `dynamic` read at run time failed: keep floats constant
        (keyed by value) from now on; whether there were any."""
        if FLOAT not in dynamic.values():
            return False
        self.varying_floats.clear()
        self.float_positions.clear()
        self.floats_broken = True
        return True

    def _ints_for(self, leaves: list, label, roots: list = ()) -> list:
        """The positions of the call's integers to trace as symbols: those seen to change
        between two calls that missed the cache (values of at least 2 only).

        An integer is named by its argument path (`label`), as a tensor's sizes are, so one
        that changes between calls of different structures is seen to vary: HF's
        classifier-free guidance alternates the model's decoding step (with `position_ids`)
        and the unconditional one (without), and the cache's `cumulative_length` sits at
        another argument position in each; compared only within one structure it never varied
        and every step compiled. Integers inside the function's own objects `roots` count too
        (a custom optimizer's `self.state[p]["step"]`, with `fulmen.jit(opt.step)`)."""
        ints = int_values(leaves) + root_floats(list(roots), int)
        names = [_number_name(label, position) for position, _ in ints]
        watched = self.dynamic is not False and not self.ints_broken
        _note_changes(names, [value for _, value in ints], self.last_ints,
                      self.varying_ints if watched else None, "integer",
                      "tracing it symbolically")
        return [position for name, (position, value) in zip(names, ints)
                if name in self.varying_ints and value >= 2]

    def drop_ints(self, dynamic: dict) -> bool:
        """A symbolic trace with the integers of `dynamic` failed: keep integers constant
        from now on; whether there were any."""
        if INT not in dynamic.values():
            return False
        self.varying_ints.clear()
        self.ints_broken = True
        return True

    def drop_ones(self) -> bool:
        """A symbolic trace with generalised sizes of 1 failed: specialise them from now on
        (they stay out of `varying` until they change); whether there were any."""
        if self.generalised_restart:  # those first: the newest generalisation
            self.generalise_restarts = False
            return True
        if not self.ones:
            return False
        for i, dims in self.ones.items():
            self.varying[i] -= dims
        self.ones.clear()
        self.generalise_ones = False
        return True

    def failed(self) -> None:
        """A symbolic trace failed: later calls are compiled for their shapes."""
        self.broken = True
        self.varying.clear()
        self.ones.clear()
        self.views.clear()
        self.contiguous.clear()
        self.strides_vary.clear()
        self.varying_ints.clear()
        self.ints_broken = True

    @staticmethod
    def entry_fields(program) -> dict[str, Any]:
        """`shape_guard` and `symbolic_dims` of a compiled program's cache entry (none when
        no size stayed symbolic)."""
        symbolic = program.symbolic
        if symbolic is None:
            return {}
        dims = {}
        for proxy, position in zip(symbolic.proxies, symbolic.positions):
            if isinstance(proxy, torch.SymInt):  # an integer (`symbolize_int`)
                if is_symbolic(proxy):
                    dims[position] = INT
                continue
            found = tuple(d for d, size in enumerate(proxy.shape) if is_symbolic(size))
            if found or proxy.name in symbolic.free_strides:
                dims[position] = (*found, STRIDES) if proxy.name in symbolic.free_strides \
                    else found
        if not dims:
            return {}
        return {"shape_guard": symbolic.guard(program.offset_reads),
                "symbolic_dims": tuple(sorted(dims.items(), key=repr))}

    def graft(self, entry, program) -> None:
        """A new path of `entry`'s trace tree was traced with symbolic sizes (in a ShapeEnv of
        its own): the entry is valid only where the guards of every path hold."""
        if entry.shape_guard is None:
            return
        fields = self.entry_fields(program)
        other = fields.get("shape_guard")
        if other is None or fields["symbolic_dims"] != entry.symbolic_dims:
            # the new path specialised the sizes the entry leaves out of its key
            exact = program.symbolic.guard(program.offset_reads) \
                if program.symbolic is not None else None
            other = exact or (lambda leaves: False)
        first = entry.shape_guard
        entry.shape_guard = lambda leaves: first(leaves) and other(leaves)

    def record_first_call(self, leaves: list, label=str, roots: list = ()) -> bool:
        """Whether this miss is the first call, to run eagerly with its shapes only recorded
        (NOTE [a deferred first call]); False (compile it) when not deferring or after it."""
        if not self.defer_first or self.first_recorded:
            return False
        self.first_recorded = True
        self.dims_for(leaves, label, roots)
        return True

    def clear(self) -> None:
        """Drop every symbolic entry (hooks changed: each must be traced anew)."""
        self.entries.clear()
        self.by_key.clear()

    def add(self, entry, guard, args: tuple, kwargs: dict, state) -> None:
        """Store a symbolic entry under its key (sizes in its symbolic dims left out)."""
        key, _ = guard.key(args, kwargs, state, dict(entry.symbolic_dims))
        self.entries.append(entry)
        self.by_key.setdefault((entry.symbolic_dims, key), []).append(entry)

    def lookup(self, guard, args: tuple, kwargs: dict, state, leaves: list):
        """The symbolic entry whose key and shape guard match the call (whose static key
        `guard` has just computed), or None."""
        for dims in dict.fromkeys(entry.symbolic_dims for entry in self.entries):
            key, _ = guard.key(args, kwargs, state, dict(dims), same_call=True, leaves=leaves)
            for entry in self.by_key.get((dims, key), ()):
                if entry.shape_guard(leaves):
                    return entry
        return None


def _number_name(label, position) -> str:
    """The name of a number of the call: `label(position)`, or `self...` inside the function's
    own objects (a negative root)."""
    if not isinstance(position, tuple) or position[0] >= 0:
        return label(position)
    return f"self{-1 - position[0] or ''}{path_text(position[1])}"


def _note_changes(names: list[str], values: list, last: dict, varying: set | None, kind: str,
                  remedy: str) -> None:
    """Add to `varying` the names whose value differs from the one in `last` (the previous
    call that missed the cache), logging each once; then remember `values` in `last`.
    `varying` None: remember only."""
    if varying is not None:
        for name, new in zip(names, values):
            old = last.get(name)
            if old is not None and new != old and name not in varying:
                _RECOMPILES.info("%s: %s varies (%s -> %s); %s", name, kind, old, new, remedy)
                varying.add(name)
    last.update(zip(names, values))
