"""typer options from their declarations (api/options.py): ``@takes(Verb)`` on a command taking ``**options`` gives
typer a signature with one option per declaration of ``Verb``, in their order, after the command's own arguments."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import typer

from ..api.options import F, Opt, declared


def takes(options: type) -> Callable[[F], F]:
    def decorate(fn: F) -> F:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
        hints = typing.get_type_hints(options)
        own += [_param(o, hints[o.name]) for o in declared(options)]
        fn.__signature__ = inspect.Signature(own)  # type: ignore[attr-defined]
        return fn

    return decorate


def _param(o: Opt, kind: Any) -> inspect.Parameter:
    callback = globals()[o.callback] if o.callback else None
    info = typer.Option(o.default, *o.flags.split(), help=o.help, metavar=o.metavar, min=o.min, callback=callback)
    return inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind)


def cap_threads(value: int | None) -> int | None:
    """--threads above the CPUs available is capped, and said so on stderr."""
    from ..parallel import capped_threads
    from .common import err_console

    used, message = capped_threads(value)
    if message:
        err_console().print(message, markup=False, soft_wrap=True)
    return used
