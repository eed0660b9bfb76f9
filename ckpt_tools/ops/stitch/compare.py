"""Stitch's comparison: every candidate tensor against the verifier's, one ``Decision`` per key.

``decide`` compares each candidate (what the draft would write for a verifier MTP key) with the
verifier's tensor before anything is written, and says what to do: ``identical`` (same bytes, or a
quantized verifier weight whose decoded values are the draft's: the verifier's bytes are written, so an
untouched round trip reproduces its files), ``replace``, ``requantize`` (encoded from the draft's values
by the verifier's scheme table's encoder), ``add`` or ``remove``. Values are compared, not storage: a
quantized verifier weight is decoded in the draft's precision. NaN / Inf in what would be written is an
error; ``judge`` refuses a replaced tensor that diverges beyond what finetuning does (``DIVERGENCE``)
unless ``--accept-divergent``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...arrays import torch_threads
from ...errors import InputError
from ...model.quant.codec import Codec
from ...numeric import transforms
from ...stream.plan import Compute, CopyBytes, OutputTensor, copy_of
from ..shared.tensor_diff import TensorDiff

if TYPE_CHECKING:
    from ...io.checkpoint import Checkpoint
    from ...io.safetensors_io import TensorRef
    from ...model.mtp import MtpView
    from ...model.quant.storage import Storage

ACTIONS = ("identical", "replace", "requantize", "add", "remove")
GATE_THREADS = 2  # the gate's comparisons: reads and numpy release the GIL


@dataclass(frozen=True)
class Divergence:
    """When a replaced tensor is not a finetune of the verifier's but another tensor.

    Measured with ``python -m benchmarks.divergence`` (AdamW on the MTP layer of a tiny
    DeepSeek-V3, weights ~0.02-0.06 RMS): finetunes at lr 1e-5..1e-3 for 500-2000 steps keep
    cosine >= 0.38 and a norm ratio within 0.40-2.54; broken drafts (another model's
    weights, gate / up halves swapped) give cosines from -0.44 to 0.12 with ordinary norm
    ratios (0.87-1.09), so the ratio catches scale mistakes rather than these. Norms are not
    judged: a norm left at its initial ones still has cosine 0.999 with a trained one.
    """

    measured: str = "measured finetunes keep cosine >= 0.38 and a norm ratio within 0.40-2.54"
    min_cosine: float = 0.2
    max_norm_ratio: float = 4.0  # ||draft|| / ||verifier|| beyond 4x either way
    tiny_rms: float = 1e-3  # a verifier tensor this close to zero has no direction to compare with

    def to_json(self) -> dict:
        return {"min_cosine": self.min_cosine, "max_norm_ratio": self.max_norm_ratio, "tiny_rms": self.tiny_rms}


DIVERGENCE = Divergence()


@dataclass
class Decision:
    """What stitch writes for one verifier key (``action``, one of ACTIONS), why, and the comparison
    behind it (``stats``: the report's entry for the key)."""

    key: str
    action: str
    reason: str
    stats: TensorDiff


@dataclass
class Candidates:
    """What the planner would write for the verifier's MTP keys, before comparison."""

    tensors: Mapping[str, OutputTensor]  # verifier key -> the tensor built from the draft
    values: Mapping[str, OutputTensor]  # encoded weight -> the draft's values it is encoded from
    removed: list[str]  # verifier keys the output leaves out
    fmt: Codec  # the verifier's block format: a stacked experts tensor's scale companion and decoder
    encoded: Mapping[str, Storage] = field(default_factory=dict)  # weight encoded in the verifier's storage
    companions: Mapping[str, list[str]] = field(default_factory=dict)  # encoded weight -> tensors following it
    as_stored: set[str] = field(default_factory=set)  # of those, weights the draft stores in that very format (kept)
    # filled by decide: draft byte range -> the digest of its bytes, taken by the comparison that read them all
    # (the draft's fingerprint then reads nothing again: fingerprint.TakenTensors)
    digests: dict = field(default_factory=dict)


def decide(view: MtpView, cand: Candidates) -> list[Decision]:
    """One decision per key (sorted): every candidate compared with the verifier's tensor on GATE_THREADS
    threads owned here, block scales following their weights, then the keys the output removes.
    NaN / Inf in anything that would be written is refused (rule nonfinite)."""
    companions = {k for ks in cand.companions.values() for k in ks}
    jobs = [(k, t) for k, t in cand.tensors.items() if k not in companions]
    with torch_threads(load=any(_uses_torch(t) for _, t in jobs)):  # before the gate's threads start
        diffs = _in_parallel(lambda item, stop: _probe(cand, view, *item, stop), jobs)
    decisions = {d.key: _decision(d, cand, view) for d in diffs}
    follow = [(w, k) for w, ks in cand.companions.items() for k in ks]
    for wkey, skey in follow:
        decisions[skey] = _follow(decisions[wkey], skey, view.ckpt.tensors.get(skey), cand.tensors[skey])
    bad = [f"{k} ({d.stats.nonfinite} NaN/Inf)" for k, d in decisions.items() if d.stats.nonfinite]
    for key in cand.removed:
        vref = view.ckpt.tensors[key]
        decisions[key] = Decision(key, "remove", "left out: its weight is written unquantized",
                                  TensorDiff(key, "removed", vref.dtype, None, list(vref.shape), None))
    if bad:
        raise InputError(f"non-finite values in the draft: {', '.join(sorted(bad)[:10])}", rule="nonfinite")
    return sorted(decisions.values(), key=lambda d: d.key)


def _probe(cand: Candidates, view: MtpView, key: str, t: OutputTensor, stop) -> TensorDiff:
    """One candidate against the verifier: values compared, status and dtypes as written."""
    from ..shared.compare import (  # numpy: a report that compares nothing (graft) needs none
        Tap,
        compare,
        count_nonfinite,
    )

    vref = view.ckpt.tensors.get(key)
    encoded = cand.encoded.get(key)
    stored = encoded or view.quantized.get(key)
    if stored is not None:  # a module stored by a scheme table: its dequantized values
        from ...model.quant.dequant import dequant_module

        b = cand.values.get(key, t)  # an encoded weight is compared through the values it is encoded from
        a_dtype = b.dtype if b.dtype in ("BF16", "F16", "F32") else "F32"  # in the draft's precision
        a = dequant_module(view.ckpt, stored, key, a_dtype)
        d = compare(key, a_dtype, a.shape, a.recipe, b.dtype, b.shape, b.recipe, stop=stop)
        if encoded is not None:  # written in the verifier's own storage: unchanged keeps its tensors
            d.dtype_a = d.dtype_b = stored.label
            if d.status not in ("unchanged", "shape-changed"):
                d.status = "replaced"
            return d
        if d.status == "unchanged":  # the draft holds exactly the verifier's values, now unquantized
            d.max_abs, d.rel_l2, d.cosine = 0.0, 0.0, 1.0
            d.unjudged = "the verifier's values, unquantized"
        if d.status != "shape-changed":
            d.status = "dtype-changed"
        d.dtype_a, d.dtype_b = stored.label, t.dtype
        return d
    if vref is None:
        return TensorDiff(key, "added", None, t.dtype, None, list(t.shape),
                          nonfinite=count_nonfinite(t.recipe, t.dtype, t.shape))
    b = cand.values.get(key, t)
    a_dtype, a = vref.dtype, CopyBytes([vref.segment()])
    if cand.fmt.stores(vref.dtype):  # the verifier's value, in the precision of the draft's
        a_dtype = b.dtype if b.dtype in ("BF16", "F16", "F32") else "F32"
        sref = view.ckpt.tensors[cand.fmt.scale_key(key)]
        a = cand.fmt.decode(_as_tensor(vref), _as_tensor(sref), a_dtype).recipe
    one = b.recipe.segments if isinstance(b.recipe, CopyBytes) and len(b.recipe.segments) == 1 else None
    tap = Tap() if one else None  # a draft tensor read whole: its digest comes with the comparison
    d = compare(key, a_dtype, vref.shape, a, b.dtype, b.shape, b.recipe, stop=stop, tap=tap)
    if tap is not None and tap.digest is not None:
        cand.digests[one[0]] = tap.digest
    d.dtype_a, d.dtype_b = vref.dtype, t.dtype
    if d.status != "shape-changed":
        same = d.status == "unchanged"
        d.status = ("unchanged" if same else "replaced") if vref.dtype == t.dtype else "dtype-changed"
        if same and d.status == "dtype-changed":  # same values, stored in another dtype
            d.max_abs, d.rel_l2, d.cosine = 0.0, 0.0, 1.0
            d.unjudged = "the verifier's values, in another dtype"
    return d


def _decision(d: TensorDiff, cand: Candidates, view: MtpView) -> Decision:
    """The action a compared candidate gets, and why."""
    key = d.key
    if d.status == "added":
        return Decision(key, "add", "the verifier has no such tensor", d)
    encoded = cand.encoded.get(key)
    if d.status == "unchanged":
        why = (f"the draft's values are the verifier's {encoded.label} decoded" if encoded is not None
               else "the same bytes as the verifier's")
        return Decision(key, "identical", why + ": its bytes are kept", d)
    if encoded is not None and key in cand.as_stored:
        return Decision(key, "replace", f"the values differ: the draft's {encoded.label} bytes and scale as they are "
                                        "(the verifier's own format)", d)
    if encoded is not None:
        return Decision(key, "requantize", f"the values differ: encoded as the verifier stores it ({encoded.label}) "
                                           "from the draft's", d)
    stored = view.quantized.get(key)
    if stored is not None:
        from ...model.quant.encode_plan import encodable

        # as the builder decided (stitch/plan.py _encodes): the encoder must write the verifier's stored dtypes
        why = ("as the request asks (--keep-bf16 or --dtype draft)"
               if encodable(stored, view.resolved.dtype, view.ckpt.tensors) is not None
               else "a format or storage stitch does not write: the draft's values go in unquantized")
        return Decision(key, "replace", f"written as {d.dtype_b} where the verifier stores {stored.label}, {why}", d)
    if d.status == "dtype-changed":
        return Decision(key, "replace", f"written as {d.dtype_b} where the verifier has {d.dtype_a}", d)
    return Decision(key, "replace", "the values differ" if d.status == "replaced" else f"{d.status}", d)


def _follow(weight: Decision, key: str, vref: TensorRef | None, t: OutputTensor) -> Decision:
    """A block scale's decision: it is written (or kept) with its weight and judged through it."""
    d = TensorDiff(key, weight.stats.status if vref is not None else "added", vref.dtype if vref else None, t.dtype,
                   list(vref.shape) if vref else None, list(t.shape), unjudged="block scale (judged with its weight)")
    action = weight.action if vref is not None else "add"
    what = "activation scale" if t.meta.get("kept") else "scale"
    return Decision(key, action, f"{what} of {weight.key}, follows it ({weight.action})", d)


def _as_tensor(ref: TensorRef) -> OutputTensor:
    return copy_of(ref, None, {})


def _uses_torch(t: OutputTensor) -> bool:
    return isinstance(t.recipe, Compute) and t.recipe.op in transforms.TORCH_OPS


def _in_parallel(fn, items: list, workers: int = GATE_THREADS) -> list:
    """``fn(item, stop)`` for every item on ``workers`` threads, results in order.

    The pool belongs to this call: on any error (or Ctrl-C) ``stop`` is set, so running
    comparisons end at their next chunk, queued ones are cancelled, and every thread has
    ended when the error propagates.
    """
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-gate")
    try:
        futures = [pool.submit(fn, item, stop) for item in items]
        return [f.result() for f in futures]
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------
# The divergence gate


def judge(decisions: list[Decision], kinds: Mapping[str, str | None], draft: Checkpoint,
          accept_divergent: bool, no_manifest: str | None = None) -> str | None:
    """Refuse, before anything is written, a draft whose replaced tensors are not finetunes of the
    verifier's: each replaced tensor's ``stats`` gets its verdict (``divergent`` or ``unjudged``);
    ``kinds`` is each key's table kind (norms are not judged). Returns why the check does not apply to
    this draft (an initialised one), or None. ``no_manifest``: why the draft's manifest is not evidence
    (provenance.manifest_mismatch): its ``init`` then exempts nothing."""
    exempt = _exempt(draft) if no_manifest is None else None
    for dec in decisions:
        d = dec.stats
        if d.status in ("replaced", "dtype-changed") and d.unjudged is None:
            _judge(d, kinds.get(d.key), exempt)
    bad = [dec.stats for dec in decisions if dec.stats.divergent]
    if bad and not accept_divergent:
        listed = "; ".join(f"{d.key} ({d.divergent})" for d in bad[:10]) + (" ..." if len(bad) > 10 else "")
        raise InputError(
            f"{len(bad)} tensor(s) of the draft {draft.root} diverge from the verifier's beyond what finetuning does "
            f"({DIVERGENCE.measured}): {listed}. Another model's "
            "weights, swapped halves or a wrong layer? Nothing was written; --accept-divergent stitches it anyway"
            + (f". Not exempt as an initialised draft: {no_manifest}" if no_manifest and _exempt(draft) else ""),
            rule="divergent", path=str(draft.root))
    return exempt


def _exempt(draft: Checkpoint) -> str | None:
    """Drafts init-draft made are not finetunes of the verifier's MTP: nothing to diverge from."""
    init = (draft.manifest or {}).get("init")
    if not isinstance(init, dict):
        return None
    layer = init.get("from_layer")
    how = "from scratch" if layer is None else f"from target layer {layer}"
    return f"the draft was initialised {how} (ckpt_manifest.json init): not a finetune of the verifier's MTP"


def _judge(d: TensorDiff, kind: str | None, exempt: str | None) -> None:
    """Set ``d.divergent`` (why it is another tensor) or ``d.unjudged`` (why it cannot be told)."""
    lim = DIVERGENCE
    numel = math.prod(d.shape_a or [])
    if exempt:
        d.unjudged = "exempt: initialised draft"
    elif kind == "norm":
        d.unjudged = "norm (cosine and norm ratio cannot tell a norm left at its init from a trained one)"
    elif d.cosine is None or d.norm_a is None or d.norm_b is None:
        d.unjudged = "no statistics (not a float tensor, or no finite values)"
    elif d.norm_a <= lim.tiny_rms * math.sqrt(max(numel, 1)):
        d.unjudged = f"the verifier's tensor is (nearly) zero (RMS <= {lim.tiny_rms:g}): no direction to compare"
    else:
        ratio = d.norm_b / d.norm_a
        why = []
        if d.cosine < lim.min_cosine:
            why.append(f"cosine {d.cosine:.3f} < {lim.min_cosine}")
        if not 1 / lim.max_norm_ratio <= ratio <= lim.max_norm_ratio:
            why.append(f"norm ratio {ratio:.3g} beyond {lim.max_norm_ratio:g}x")
        d.divergent = ", ".join(why) or None
