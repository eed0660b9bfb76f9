"""What probe's loaders share: transformers' loading info read as problems, the refusal that names them, one
tensor materialised at a time, and a config without its quantization config (a float model)."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Mapping

from ...errors import InputError
from .state import RULE


@contextlib.contextmanager
def sequential_load() -> Iterator[None]:
    """transformers materialises every tensor in a thread pool ahead of the loader; without it each (dequantized)
    tensor is made when its parameter is filled: one at a time, never a second copy of the weights."""
    was = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        if was is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = was


def unquantized_config(config):
    """A copy of the config without its quantization config (the model transformers builds then holds floats)."""
    config = copy.deepcopy(config)
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        if "quantization_config" in c.__dict__:
            del c.quantization_config
    return config


def load_problems(info, ignore_unexpected=None) -> list[str]:
    """What a loading info says was not loaded as stored: one phrase per kind, naming the first keys."""
    def first(keys) -> str:
        keys = sorted(keys)
        return ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")

    d = info if isinstance(info, Mapping) else vars(info)
    unexpected = {k for k in d.get("unexpected_keys", ()) if ignore_unexpected is None
                  or not ignore_unexpected.search(k)}
    out = []
    if unexpected:
        out.append(f"{len(unexpected)} stored tensor(s) no parameter takes (unexpected: {first(unexpected)})")
    if d.get("missing_keys"):
        out.append(f"{len(d['missing_keys'])} parameter(s) no tensor fills (missing: {first(d['missing_keys'])})")
    if d.get("mismatched_keys"):
        out.append(f"shape mismatch: {first(str(m[0]) for m in d['mismatched_keys'])}")
    if d.get("conversion_errors"):
        out.append(f"conversion errors: {first(d['conversion_errors'])}")
    if d.get("error_msgs"):
        out.append(f"errors: {'; '.join(d['error_msgs'][:2])}")
    return out


def refuse(path: str, what: str, problems: list[str], notes: list[str] = ()) -> InputError:
    said = [n.splitlines()[0][:200] for n in notes if "quantiz" in n.lower()]
    tail = f" (transformers said: {said[0]})" if said else ""
    return InputError(f"{what} would not load as stored: {'; '.join(problems)}{tail}. probe reports no number "
                      "from a model that is not the checkpoint", rule=RULE, path=path)
