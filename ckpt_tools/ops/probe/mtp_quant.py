"""`ckpt probe --mtp-quant SCHEMES`: the verifier's own MTP, encoded into each scheme and decoded back.

Per scheme, the MTP tensors are planned as ``ckpt graft --mtp-quant`` plans them (the caller's ``encode``:
``ops.stitch.graft.mtp_in_scheme``, the encoders the scheme tables name), their bytes produced in memory,
and the weights decoded by the decoders ``ckpt dequant`` runs (``dequant.dequant_parts``): each row is the
model an engine loading those bytes would draft with, measured on the same prompts and greedy path as the
unquantized MTP. A scheme without an encoder, or one a serving engine does not load for the verifier's
family (a scheme table's ``unserved``), is listed with the reason and not measured. A GGUF sidecar type
(``gguf-f16``, ``gguf-q8_0`` ...) is the sidecar's bytes (``extract --format gguf``), decoded by gguf's
``dequantize``: the caller's ``encode`` routes it (``ops.draft.gguf_sidecar.mtp_in_gguf``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...errors import PlanError, UsageError
from ...io.checkpoint import Checkpoint

AS_STORED = "as stored"  # the row of the verifier's own MTP
# (verifier, scheme) -> {weight's logical key: (its tensors as graft writes them, weight first; its Stored)}
Encoder = Callable[[Checkpoint, str], dict]


@dataclass
class QuantRow:
    scheme: str
    status: str  # measured | no-encoder | unserved | unencodable (graft refuses these weights in it)
    reason: str | None = None
    bytes: int | None = None  # of the MTP layers' tensors in this scheme
    draft: int | None = None  # the index of its measurement among the MTPs probe measured (0: the verifier's)

    def to_json(self, drafts: list, base: list[float] | None) -> dict:
        out: dict = {"scheme": self.scheme, "status": self.status, "bytes": self.bytes}
        if self.reason is not None:
            out["reason"] = self.reason
        if self.draft is not None:
            d = drafts[self.draft]
            out.update({"agreement": d.agreement, "kl": d.kl, "expected_accepted": d.expected_accepted(),
                        "positions": d.positions})
            if base is not None:
                out["agreement_change"] = [a - b for a, b in zip(d.agreement, base, strict=True)]
        return out


def parse_schemes(text: str | Sequence[str]) -> list[str]:
    """``all`` (every scheme table and GGUF sidecar type), or a comma list of those names (a table's name, or
    gguf-TYPE)."""
    from ...model.gguf_names import GGUF_ROW, GGUF_TYPES
    from ...model.quant import all_schemes

    names = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    known = sorted(all_schemes()) + [GGUF_ROW + t for t in GGUF_TYPES]
    if names == ["all"]:
        return known
    bad = [n for n in names if n not in known]
    if not names or bad:
        what = f"unknown scheme {bad[0]!r}" if bad else "no scheme named"
        raise UsageError(f"--mtp-quant {','.join(names) or repr(text)}: {what}; use all or a comma list of "
                         f"{', '.join(known)}", rule="mtp-quant-scheme")
    return list(dict.fromkeys(names))


def unserved_reason(scheme: str, family: str, experts: bool, llama_cpp: bool = True) -> str | None:
    """Why a serving engine does not serve an MTP in ``scheme`` for ``family`` (the table's ``unserved``; a GGUF
    sidecar type: the family table's ``llama_cpp`` section)."""
    from ...model.gguf_names import GGUF_ROW
    from ...model.quant import get_scheme

    if scheme.startswith(GGUF_ROW):
        return None if llama_cpp else f"llama.cpp: the {family} table names no llama.cpp architecture"
    for u in get_scheme(scheme).unserved:
        applies = (family in u.families if u.families is not None else
                   u.only is None or family not in u.only)
        if applies and (experts or not u.experts):
            return f"{u.engine}: {u.reason}"
    return None


def plan_rows(verifier: Checkpoint, schemes: list[str], encoders: tuple[str, ...]) -> list[QuantRow]:
    """Every requested scheme's row, before measuring: those to measure, and those listed with a reason."""
    from ...model.mtp import open_mtp

    view = open_mtp(verifier)
    family = view.table.family
    experts = any(s.role == "expert" for s in view.present)
    rows = [QuantRow(AS_STORED, "measured", bytes=sum(verifier.tensors[k].nbytes for _, k in view.stored()))]
    for name in schemes:
        if name not in encoders:
            rows.append(QuantRow(name, "no-encoder", "its table names no encoder: nothing can write it"))
            continue
        why = unserved_reason(name, family, experts, view.table.llama_cpp is not None)
        rows.append(QuantRow(name, "unserved", why) if why else QuantRow(name, "measured"))
    return rows


def decoded_state(verifier: Checkpoint, scheme: str, encode: Encoder, dtype: str,
                  stack: contextlib.ExitStack) -> tuple[dict, int, int]:
    """The MTP's tensors as an engine loading ``scheme``'s bytes sees them: (key -> OutputTensor, decoded
    where encoded; the bytes written; how many weights were encoded). The bytes live in an in-memory
    checkpoint ``stack`` closes."""
    import torch

    from ...arrays import bytes_to_torch
    from ...model.quant.dequant import dequant_parts
    from ...numeric.transforms import recipe_bytes
    from .load import stored_tensors
    from .state import TORCH_DTYPES

    pieces = encode(verifier, scheme)
    written = {t.key: t for tensors, _ in pieces.values() for t in tensors}
    raw: dict = {}
    for key, t in written.items():  # the bytes graft would write, produced by the plan's own recipes
        buf = bytearray(b"".join(recipe_bytes(t.recipe, max(t.nbytes, 1))))
        raw[key] = bytes_to_torch(buf, t.dtype, tuple(t.shape)).clone() if t.nbytes else torch.empty(tuple(t.shape))
    refs = stored_tensors(stack.enter_context(Checkpoint.open(raw)))
    state: dict = {}
    encoded = 0
    for key, (tensors, stored) in pieces.items():
        st = stored.storage if stored is not None else None
        if st is not None and stored.state == "quantized" and st.scheme == scheme:
            encoded += 1
            state[key] = dequant_parts(key, {sfx: refs[k] for sfx, k in st.tensors.items()}, st, TORCH_DTYPES[dtype])
        else:  # as stored, or decoded already (a GGUF sidecar type: meta ``encoded``)
            state.update({t.key: refs[t.key] for t in tensors})
            encoded += sum(bool(t.meta.get("encoded")) for t in tensors)
    return state, sum(t.meta.get("stored_bytes", t.nbytes) for t in written.values()), encoded


def encoders() -> tuple[str, ...]:
    """The schemes a storage format of which names an encoder (what ``graft --mtp-quant`` writes), and the GGUF
    sidecar types (what ``extract --format gguf`` writes)."""
    from ...model.gguf_names import GGUF_ROW, GGUF_TYPES
    from ...model.quant import all_schemes

    return (*sorted(n for n, t in all_schemes().items() if any(f.encoder for f in t.storage)),
            *(GGUF_ROW + t for t in GGUF_TYPES))


def drafters(main, loaded, verifier: Checkpoint, req, device: str, first: int) -> tuple[list[QuantRow], list]:
    """The rows of ``req.mtp_quant`` and, for each measured one, its MTP in the table engine (drafter.Drafter),
    numbered in probe's list of MTPs from ``first`` (the verifier's own MTP is number 0)."""
    from ...model.gguf_names import GGUF_ROW
    from . import mtp_engine
    from .drafter import Drafter

    if req.encode_mtp is None:
        raise TypeError("ProbeRequest.encode_mtp is needed for --mtp-quant (api.mtp_choice.encode_mtp)")
    rows = plan_rows(verifier, parse_schemes(req.mtp_quant), encoders())
    rows[0].draft = 0
    out = []
    for row in rows[1:]:
        if row.status != "measured":
            continue
        # one scheme's bytes at a time: dropped once its engine holds the decoded weights
        with contextlib.ExitStack() as stack:
            try:
                state, row.bytes, encoded = decoded_state(verifier, row.scheme, req.encode_mtp, req.dtype, stack)
            except (PlanError, UsageError) as e:  # graft would refuse these weights in this scheme too
                writer = (f"extract --format gguf --gguf-type {row.scheme.removeprefix(GGUF_ROW)}"
                          if row.scheme.startswith(GGUF_ROW) else f"graft --mtp-quant {row.scheme}")
                row.status, row.reason = "unencodable", f"{writer} refuses: {e.message}"
                continue
            if not encoded and not row.scheme.startswith(GGUF_ROW):  # said: a row equal to the MTP as stored is
                # not to be read as "lossless"
                row.reason = ("the family table marks no MTP weight quantizable (quant: true): graft writes every "
                              "tensor as stored")
            engine, _ = mtp_engine.build(main, verifier, state, loaded.scheme, req.dtype, device, verifier.root)
        row.draft = first + len(out)
        out.append(Drafter(f"mtp-quant {row.scheme}", engine))
    return rows, out
