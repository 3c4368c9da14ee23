"""Libraries that ask "is this tensor being traced?" get yes for fulmen's proxies.

HF transformers decides some things by reading a tensor's values unless the tensor is being
traced (`transformers.utils.import_utils.is_tracing(tensor)`: torch.compile, torch.export,
torch.fx, FakeTensor). The causal-mask helpers of `transformers.masking_utils` ask whether the
attention mask pads nothing (`padding_mask.sum() == padding_mask.numel()`) to pass SDPA no mask
and `is_causal=True` instead of an explicit mask; with a proxy that question is a graph break
(a guard and a trace tree of three segments for every HF causal LM). Asked while tracing, a
fulmen proxy *is* a traced tensor, so the module-level `is_tracing` of the modules listed in
`_ASKERS` answers True for a proxy and asks the library's own function for anything else,
from entering `answered_for_proxies()` (the tracer, while it runs the user's code) to leaving
it. Nothing else changes: other threads and real tensors get the library's answer.

Only modules whose every such question picks, for a traced tensor, a path with the same values
are listed (NOTE [traced-tensor answers]); a module whose answer would skip a check that raises
in eager is not, since a result where eager raises is a wrong answer.

NOTE [traced-tensor answers]: `transformers.masking_utils` asks `is_tracing(mask)` before
(1) skipping the causal mask for SDPA (`_ignore_causal_mask_sdpa`: traced -> the explicit
boolean mask, the same attention as `is_causal=True` when nothing is padded), (2) skipping a
bidirectional mask (traced -> the explicit all-True mask), (3) dropping an all-zero packed
sequence mask (traced -> the zeros, one sequence, the same mask), (4) dropping an all-ones
linear-attention padding mask (traced -> the ones, a multiply by 1). Each traced path computes
what eager's computes; attention with an explicit mask instead of `is_causal` may round
differently in the last bits (another kernel), as under torch.compile, where HF takes the same
paths. The module is looked up in `sys.modules` (never imported here): a process that has not
imported it has nothing to answer.

An answer can still lead where eager does not go when the library's inputs disagree with each
other: HF's classifier-free guidance calls an encoder-decoder with one token and an attention
mask one longer each step; eager drops the all-ones mask, the traced path builds it as wide as
the mask and SDPA refuses the widths. So `answers_given()` counts the answers, and a trace that
raises after giving some is traced again inside `library_answers_off()` (`jitted.py`), where
the library reads the mask's values (a graph break), as eager does.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Iterator

from fulmen.proxies import TensorProxy

# module -> the name of its "is this tensor traced?" function (NOTE [traced-tensor answers])
_ASKERS = {"transformers.masking_utils": "is_tracing"}


_WRAPPERS: dict = {}  # library function -> its wrapper (one per function, made once)
_OFF = contextvars.ContextVar("fulmen_library_answers_off", default=False)
_GIVEN = [0]  # answers given to proxies, ever (a trace compares it before and after)


def answers_given() -> int:
    """How many times a library was answered True for a proxy (a running count)."""
    return _GIVEN[0]


def answers_are_off() -> bool:
    """Whether `library_answers_off()` is active."""
    return _OFF.get()


@contextlib.contextmanager
def library_answers_off() -> Iterator[None]:
    """While active, `answered_for_proxies()` answers nothing: the libraries ask their own
    `is_tracing`, which is False for a fulmen proxy."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def _answering(library_fn):
    """`library_fn` answering True for a fulmen proxy."""
    wrapper = _WRAPPERS.get(library_fn)
    if wrapper is not None:
        return wrapper

    @functools.wraps(library_fn)
    def is_tracing(tensor=None, *args, **kwargs):
        if isinstance(tensor, TensorProxy):
            _GIVEN[0] += 1
            return True
        return library_fn(tensor, *args, **kwargs)

    is_tracing.fulmen_answers = True
    _WRAPPERS[library_fn] = is_tracing
    return is_tracing


@contextlib.contextmanager
def answered_for_proxies() -> Iterator[None]:
    """While active, the listed libraries' `is_tracing(tensor)` is True for fulmen proxies (the
    module globals are put back on leaving, also on an error)."""
    swapped = []
    for module_name, name in () if _OFF.get() else _ASKERS.items():
        module = sys.modules.get(module_name)
        original = getattr(module, name, None) if module is not None else None
        if callable(original) and not getattr(original, "fulmen_answers", False):
            setattr(module, name, _answering(original))
            swapped.append((module, name, original))
    try:
        yield
    finally:
        for module, name, original in swapped:
            setattr(module, name, original)
