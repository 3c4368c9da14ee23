"""A trace interpreter: run a trace statement by statement, keeping every value by name.

`python_callable()` is how traces normally run; the interpreter is for tools that need the
intermediate values (`fulmen.verify` narrows a divergence to one statement with it).
"""

from __future__ import annotations

from typing import Any

from fulmen.core.errors import FulmenError
from fulmen.core.proxy import Proxy, iter_proxies, map_proxies


def bind_outputs(target: Any, value: Any, env: dict[str, Any]) -> None:
    """`env[proxy.name] = value` for each proxy of `target` and the matching part of `value`."""
    if isinstance(target, Proxy):
        env[target.name] = value
    elif isinstance(target, (tuple, list)):
        for item, item_value in zip(target, value):
            bind_outputs(item, item_value, env)


def interpret(trace, *args) -> tuple[Any, dict[str, Any]]:
    """Run `trace` on `args`; return `(output, env)` where `env` maps every name to its value
    (names deleted by `del` statements are kept, so all intermediates can be inspected).

    Raises:
        FulmenError: naming the statement whose implementation failed.
    """
    env: dict[str, Any] = dict(zip(trace.arg_names, args))
    for bsym in trace.bsyms:
        if bsym.is_del:
            continue
        call_args, call_kwargs = map_proxies(lambda p: env[p.name], (bsym.args, bsym.kwargs))
        try:
            value = bsym.sym.impl(*call_args, **call_kwargs)
        except Exception as error:
            names = ", ".join(p.name for p in iter_proxies(bsym.output))
            raise FulmenError(f"failed while computing {names}: {error}", op=bsym.sym.python_name,
                              where=bsym.source) from error
        bind_outputs(bsym.output, value, env)
    return map_proxies(lambda p: env[p.name], trace.output), env
