"""The configuration files a quantization scheme is declared in, read and located.

``config.json`` sections are looked up the way ConfigView does (``text_config`` first, then the
top level); ``hf_quant_config.json`` (ModelOpt) is read beside it when present.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from ...errors import InputError
from ...io.config import ConfigView

CONFIG = "config.json"
HF_QUANT = "hf_quant_config.json"
SIDE_FILES = (HF_QUANT,)

QuantFiles = Mapping[str, dict]  # file name -> parsed JSON object


def quant_files(ckpt: Any) -> dict[str, dict]:
    """config.json (as opened) and the side files a scheme may be declared in, parsed."""
    out: dict[str, dict] = {CONFIG: ckpt.config.raw}
    for name in SIDE_FILES:
        data = _side_bytes(ckpt, name)
        if data is None:
            continue
        where = f"{ckpt.root}/{name}"
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise InputError(f"not valid JSON: {e}", rule="quant-config", path=where) from None
        if not isinstance(obj, dict):
            raise InputError("must be a JSON object", rule="quant-config", path=where)
        out[name] = obj
    return out


def _side_bytes(ckpt: Any, name: str) -> bytes | None:
    from ...io.checkpoint import read_small

    if ckpt.local_dir is not None:
        path = ckpt.local_dir / name
        return read_small(path, "quant-config") if path.is_file() else None
    sizes = getattr(ckpt, "file_sizes", None) or {}
    return ckpt.read_file(name) if name in sizes else None


def dig(obj: Any, dotted: str) -> Any:
    """``obj[a][b]`` for ``a.b`` (None when a step is missing); an empty key is ``obj`` itself."""
    if not dotted:
        return obj
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def section(files: QuantFiles, file: str, dotted: str) -> dict | None:
    """The section ``dotted`` of ``file`` (config.json: text_config first), when it is an object."""
    obj = files.get(file)
    if obj is None:
        return None
    value = ConfigView(obj).get(dotted) if file == CONFIG and dotted else dig(obj, dotted)
    return value if isinstance(value, dict) else None


def copy_files(files: QuantFiles) -> dict[str, dict]:
    return {name: copy.deepcopy(obj) for name, obj in files.items()}
