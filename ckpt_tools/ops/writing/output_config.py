"""The config files a writing verb writes: config.json with another MTP count (``set_count``), the
quantization config repaired for what is written (``repair_config``), and both as output files
(``config_files``: a byte copy when unchanged).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ...errors import InputError, UsageError
from ...io.checkpoint import Checkpoint
from ...model.mtp import MtpView
from ...model.quant.repair import Repair
from ...stream.plan import OutputFile

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ...model.quant.audit import Stored


def set_count(view: MtpView, config: dict, n: int) -> dict:
    from ...io.config import ConfigView

    table = view.table
    field_var = table.mtp.count_field
    if field_var is None:
        raise UsageError(f"table {table.family} has no mtp.count_field; cannot change the MTP count")
    keys = table.config[field_var].keys
    cv = ConfigView(config)
    present = [k for k in keys if cv.has(k)] or keys[:1]
    return cv.with_values({present[0]: n}).raw


def repair_config(ckpt: Checkpoint, view: MtpView, config: dict, dtypes: dict[str, str],
                  changed_only: bool = False, stored: Mapping[str, Stored] | None = None) -> Repair:
    """The quantization config of ``ckpt`` (``config`` as its config.json) repaired for the MTP modules
    ``view`` describes, with the float tensors ``dtypes`` (key -> dtype) written unquantized, and the
    weights ``stored`` (key -> how it is written; graft) as said there (see
    ``quant.repair.repair_written``). Refused (rule mtp-quant-config) when no change of the config can
    make it declare what is written."""
    from ...model.quant import quant_files
    from ...model.quant.audit import Stored
    from ...model.quant.repair import linear_modules, repair_written

    files = {**quant_files(ckpt), "config.json": config}
    stored = stored or {}

    def stored_of(key: str) -> Stored | None:
        dt = dtypes.get(key)
        return Stored("unquantized", dt, dtype=dt) if dt is not None else stored.get(key)

    modules = linear_modules(ckpt.tensors) | {k.rpartition(".")[0] for k in (*dtypes, *stored)}
    try:
        rep = repair_written(view, files, ckpt.tensors, modules, stored_of, changed_only)
    except InputError as e:
        if e.rule == "quant-unknown":  # a scheme no table describes: its config is left as it is
            return Repair()
        raise
    if rep.unfixable:
        shown = "; ".join(f"{f.key}: {f.message}" for f in rep.unfixable[:5])
        raise InputError(f"the MTP would be written in a storage the quantization config cannot be made to declare "
                         f"({len(rep.unfixable)} module(s)): {shown}", rule="mtp-quant-config", path=ckpt.root)
    return rep


def config_files(ckpt: Checkpoint, config: dict, repaired: Repair) -> list[OutputFile]:
    """config.json (byte copy when unchanged) and every repaired quantization side file."""
    config = repaired.files.get("config.json", config)
    out = _config_file(ckpt, config)
    for name, obj in sorted(repaired.files.items()):
        if name != "config.json":
            out.append(OutputFile(name, content=(json.dumps(obj, indent=2) + "\n").encode()))
    return out


def _config_file(verifier: Checkpoint, config: dict) -> list[OutputFile]:
    path = verifier.file_path("config.json") if verifier.local_dir is not None else None
    if config is verifier.config.raw and path is not None and path.is_file():
        return [OutputFile("config.json", source=path)]  # unchanged: byte-identical copy
    return [OutputFile("config.json", content=(json.dumps(config, indent=2) + "\n").encode())]
