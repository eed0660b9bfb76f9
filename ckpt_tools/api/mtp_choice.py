"""``graft --mtp-quant auto`` and ``extract --format gguf --gguf-type auto``: the MTP's storage chosen by measuring.

``ckpt probe --mtp-quant`` measures the source's own MTP as stored and in each storage the writer can write (the
bytes it would write, decoded back); the smallest candidate whose acceptance at every depth is within
``max_drop`` of the MTP as stored is chosen. graft's candidates are the schemes the target's quantization config
declares (every scheme with an encoder is measured, for the table); without one that qualifies graft writes the
MTP as the source stores it. extract's are the GGUF sidecar types; without one, F32 (lossless for any float
source). The table, the choice and why go into the writer's report and manifest, and so into the card.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .options import DEPTH_AUTO, MAX_DROP, MAX_NEW_TOKENS_AUTO

AS_STORED = "as stored"  # ops.probe.mtp_quant's first row: the MTP as the source stores it
RULE = "mtp-quant-auto"


@dataclass(frozen=True)
class Measure:
    """How ``auto`` measures: probe's prompts, generated tokens and depth; the acceptance drop it accepts."""

    option: str  # the CLI option that asked for it (--mtp-quant / --gguf-type)
    prompts: str | os.PathLike[str] | None
    max_drop: float = MAX_DROP.default
    depth: int = DEPTH_AUTO.default
    max_new_tokens: int = MAX_NEW_TOKENS_AUTO.default

    def check(self) -> None:
        from ..errors import UsageError

        if self.prompts is None:
            raise UsageError(f"{self.option} auto chooses by measuring acceptance on your prompts, and a choice "
                             "made on prompts unlike your traffic is a guess: give --prompts FILE (one prompt a "
                             f"line, or JSONL), or name the storage ({self.option} NAME)", rule=RULE)
        if not 0 <= self.max_drop <= 1:  # nan fails both
            raise UsageError(f"--max-drop {self.max_drop!r}: an acceptance drop from 0 to 1", rule=RULE)


def graft_choice(source: Any, target: Any, how: Measure) -> dict[str, Any]:
    """``graft --mtp-quant auto``: the record (``chosen`` a scheme, or ``as stored``)."""
    from ..io.checkpoint import Checkpoint
    from ..model.quant import detect_scheme
    from ..ops.stitch.graft import mtp_quants

    how.check()
    with Checkpoint.open(target) as tgt:
        declared = detect_scheme(tgt)
        names = set() if declared is None else {t.scheme for t in declared.tables}
        candidates = [s for s in mtp_quants() if s in names]
        return _choose(_measured(source, list(mtp_quants()), how, _declared_by(tgt, candidates)), candidates,
                       how, None)


def gguf_choice(source: Any, how: Measure) -> dict[str, Any]:
    """``extract --format gguf --gguf-type auto``: the record (``chosen`` a gguf-TYPE row)."""
    from ..model.gguf_names import GGUF_ROW, GGUF_TYPES
    how.check()
    rows = [GGUF_ROW + t for t in GGUF_TYPES]
    return _choose(_measured(source, rows, how, encode_mtp), rows, how, GGUF_ROW + "f32")


def encode_mtp(ckpt: Any, scheme: str, target: Any = None) -> dict[str, Any]:
    """``ckpt``'s own MTP in ``scheme`` as the writer would write it (``--mtp-quant``'s rows): a scheme table's as
    ``graft`` encodes it (with ``target``'s declared parameters when given), a GGUF sidecar type (gguf-TYPE) as
    ``extract --format gguf`` converts it, decoded back."""
    from ..model.gguf_names import GGUF_ROW

    if scheme.startswith(GGUF_ROW):
        from ..ops.draft.gguf_sidecar import mtp_in_gguf

        return mtp_in_gguf(ckpt, scheme.removeprefix(GGUF_ROW))
    from ..ops.stitch.graft import mtp_in_scheme

    return mtp_in_scheme(ckpt, scheme, target)


def _declared_by(target: Any, candidates: list[str]) -> Callable[[Any, str], dict[str, Any]]:
    """The encoder of the rows: a candidate with the parameters ``target`` declares (what graft writes)."""
    from ..errors import InputError, UsageError

    def encode(ckpt: Any, scheme: str) -> dict[str, Any]:
        try:
            return encode_mtp(ckpt, scheme, target if scheme in candidates else None)
        except InputError as e:  # graft refuses the target for it (calibrated activation scales): a row's reason
            raise UsageError(e.message, rule=e.rule) from None

    return encode


def _measured(source: Any, schemes: list[str], how: Measure,
              encode: Callable[[Any, str], dict[str, Any]]) -> dict[str, Any]:
    """``ckpt probe SOURCE --mtp-quant SCHEMES --json``, the rows encoded by ``encode``."""
    from ..ops.probe import probe as _probe
    from ..ops.probe.numbers import check_finite
    from ..ops.stitch.plan import mapped_draft

    _probe.transformers_module()  # a missing extra is one line, before anything else
    req = _probe.ProbeRequest(os.fspath(source), [], os.fspath(how.prompts or ""), how.max_new_tokens, how.depth,
                              map_draft=mapped_draft, mtp_quant=schemes, encode_mtp=encode)
    result = _probe.probe(req)
    check_finite(result, os.fspath(source))
    return result.to_json()


def _choose(report: dict[str, Any], candidates: list[str], how: Measure, fallback: str | None) -> dict[str, Any]:
    """The smallest candidate row within ``max_drop`` at every depth; else ``fallback`` (None: the MTP as stored,
    itself a choice whenever no qualifying candidate is smaller)."""
    rows = report["mtp_quant"]
    base = rows[0]["agreement"]
    drops = {r["scheme"]: max(b - a for a, b in zip(r["agreement"], base, strict=True))
             for r in rows[1:] if r["scheme"] in candidates and r["status"] == "measured"}
    fit = [r for r in rows[1:] if r["scheme"] in drops and drops[r["scheme"]] <= how.max_drop + 1e-12]
    if fallback is None:
        fit.append(rows[0])
    tried = ", ".join(f"{n} {0.0 - d:+.4f}" for n, d in drops.items()) or "none measured"
    if fit:
        best = min(fit, key=lambda r: (r["bytes"], r["scheme"] != AS_STORED))
        chosen = best["scheme"]
        if chosen == AS_STORED:
            why = (f"no candidate ({', '.join(candidates) or 'none: the target declares no scheme graft writes'}) "
                   f"is smaller than the MTP as stored and within {how.max_drop} of its acceptance at every depth "
                   f"(worst change per candidate: {tried}): written as the source stores it")
        else:
            why = (f"the smallest candidate ({best['bytes']} bytes, the MTP as stored {rows[0]['bytes']}) whose "
                   f"acceptance at every depth is within {how.max_drop} of the MTP as stored (worst change per "
                   f"candidate: {tried})")
    else:
        chosen = fallback or AS_STORED
        why = (f"no candidate kept its acceptance within {how.max_drop} at every depth (worst change per candidate: "
               f"{tried}): {chosen}, lossless for a float source")
    keep = ("prompts", "prompts_sha256", "max_new_tokens", "dtype", "device", "chain", "engine")
    return {"option": f"{how.option} auto", "max_drop": how.max_drop, "depth": how.depth,
            "candidates": candidates, "chosen": chosen, "why": why,
            "measured": {k: report.get(k) for k in keep}, "rows": rows}
