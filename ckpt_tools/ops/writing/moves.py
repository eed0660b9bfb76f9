"""One engine that moves MTP tensors for stitch, graft, extract and init-draft, on the model of transformers'
conversion mapping: each verb states its steps (``Rename``, ``Join``, ``Split``, ``Restack``) and gives its policy
(``take(tensor, scale, spec, step)``; ``stored(step, storage)`` for a module a scheme table stores). The engine
copies the bytes under their new names, restacks expert groups, then pairs each weight in the source's block
format with its scale, named as the output names its scales: the same way for every verb.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ...errors import PlanError, UsageError
from ...model.quant.codec import storage_codec
from ...model.quant.storage import module_storage
from ...numeric import transforms
from ...stream.plan import OutputTensor, copy_of

if TYPE_CHECKING:
    from ...model.expert_layouts import ExpertGroup
    from ...model.quant.codec import Codec
    from ...model.quant.storage import Storage
    from ...model.tables.resolve import Spec


@dataclass
class Rename:  # one source tensor under another name (``swap``: its input halves trade places)
    src: str
    dst: str
    spec: Spec | None
    meta: dict
    swap: bool = False
    shape: tuple[int, ...] | None = None  # the shape the source must have (None: any)


@dataclass
class Join:  # source tensors side by side on the last axis (fusion halves), block-format ones decoded first
    srcs: list[str]
    dst: str
    spec: Spec
    decode: str | None = None


@dataclass
class Split:  # a Join run backwards: one source tensor cut on its last axis into ``pieces``
    src: str
    pieces: list[Spec]
    spec: Spec
    shape: tuple[int, ...] | None = None


@dataclass
class Restack:  # an expert group into another's names and layout (``dequant``: experts.BlockDequant first)
    src: ExpertGroup
    dst: ExpertGroup
    dequant: Any = None


Step = Rename | Join | Split | Restack


@dataclass
class Mover:
    """Runs steps over one source's tensors (``refs``), stored in ``fmt``; written scales are named by ``out``.
    What the source lacks or holds in another shape is collected (``missing``, ``misshaped``) and what it
    supplied recorded (``used``), for the verb to judge."""

    refs: Mapping[str, Any]
    fmt: Codec
    out: Codec
    quantized: Mapping[str, Storage] = field(default_factory=dict)  # source weights a scheme table stores
    scale_role: bool = True  # a paired scale's meta names its role
    used: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)
    misshaped: list[str] = field(default_factory=list)

    def run(self, steps: Iterable[Step], policy: Any) -> None:
        for step in steps:
            if isinstance(step, Restack):
                self._restack(step, policy)
            elif isinstance(step, Join):
                self._join(step, policy)
            elif isinstance(step, Rename) and step.src in self.quantized:
                policy.stored(step, self.quantized[step.src])
            elif self._present(step):
                (self._rename if isinstance(step, Rename) else self._split)(step, policy)

    def _present(self, step: Rename | Split) -> bool:
        ref, dst = self.refs.get(step.src), step.dst if isinstance(step, Rename) else step.pieces[0].key
        if ref is None:
            if step.spec is None or not step.spec.optional:
                self.missing.append(f"{step.src} (for {dst})")
            return False
        if step.shape is not None and tuple(ref.shape) != tuple(step.shape):
            self.misshaped.append(f"{step.src}: draft {list(ref.shape)}, verifier {dst} {list(step.shape)}")
            return False
        self.used.add(step.src)
        return True

    def scale(self, src: str, dst: str) -> OutputTensor | None:
        """The block scale of ``src`` when the source stores it in its block format, named for ``dst``."""
        if not self.fmt.stores(self.refs[src].dtype):
            return None
        skey = self.fmt.scale_key(src)
        sref = self.refs.get(skey)
        if sref is None:
            self.missing.append(f"{skey} (block scale of FP8 {src})")
            return None
        self.used.add(skey)
        return copy_of(sref, self.out.scale_key(dst), {"source": [skey], "role": "scale"} if self.scale_role else None)

    def _rename(self, step: Rename, policy: Any) -> None:
        t = copy_of(self.refs[step.src], step.dst, step.meta)
        scale = self.scale(step.src, step.dst)
        if step.swap:  # the scale grid would have to trade its columns too
            if scale is not None:
                raise UsageError(f"{step.src}: swapping the concat order of an FP8 fusion weight needs --dequant")
            t = transforms.swap_halves(t)
        policy.take(t, scale, step.spec, step)

    def _split(self, step: Split, policy: Any) -> None:
        st = module_storage(SimpleNamespace(tensors=self.refs), None, step.src.removesuffix(".weight"))
        if st.quantized:  # a scale grid (or packed codes) does not split where the values do
            why = storage_codec(st).refusal(st, f"split its columns into {[s.key for s in step.pieces]}")
            raise PlanError(f"{why} (or take a float draft)", rule="quant-capability", key=step.src)
        whole = copy_of(self.refs[step.src], None, {"source": [step.src], "role": step.spec.role})
        pieces = transforms.split_columns(whole, [(s.key, s.shape[-1]) for s in step.pieces])
        for piece, spec in zip(pieces, step.pieces, strict=True):
            piece.meta["role"] = spec.role
            policy.take(piece, None, spec, step)

    def _join(self, step: Join, policy: Any) -> None:
        parts = []
        for src in step.srcs:
            t, scale = copy_of(self.refs[src]), self.scale(src, src)
            if scale is not None:
                if step.decode is None:
                    raise UsageError(f"{src} is FP8: joining it into {step.dst} needs --dequant")
                t = self.fmt.decode(t, scale, step.decode)
            parts.append(t)
        t = transforms.concat_columns(parts, step.dst)
        t.meta.update(role=step.spec.role, source_dtype=parts[0].dtype)
        if step.spec.depth is not None:
            t.meta["depth"] = step.spec.depth
        policy.take(t, None, step.spec, step)

    def _restack(self, step: Restack, policy: Any) -> None:
        """Restack the group, then pair each weight with its scale; a group a scheme table stores is renamed
        expert by expert, in the layout it has."""
        src, dst = step.src, step.dst
        keys = [t.key for t in src.tensors()]
        stored = next((self.quantized[k] for k in keys if k in self.quantized), None)
        if stored is not None:
            if src.layout != dst.layout:
                raise UsageError(f"{src.prefix}: the experts are stored {src.layout.label()} as {stored.label}; "
                                 f"the output stores them {dst.layout.label()}, and restacking is supported for "
                                 "float and block-FP8 experts only (dequantize them first: extract --dequant bf16)")
            self.run([Rename(s.key, d.key, None, {"source": [s.key], "role": "expert", "source_dtype": getattr(
                self.refs.get(s.key), "dtype", None)}) for s, d in zip(src.tensors(), dst.tensors(), strict=True)],
                policy)
            return
        absent = [k for k in keys if k not in self.refs]
        if absent:
            self.missing += [f"{k} (expert tensor)" for k in absent]
            return
        self.used.update(keys)
        self.used.update(s for k in keys if (s := self.fmt.scale_key(k)) in self.refs)
        from ...model.experts import convert_group

        outs = convert_group(src, self.refs, dst, fmt=self.fmt, dequant=step.dequant)
        by_key = {t.key: t for t in outs}
        scales = {self.fmt.scale_key(t.key) for t in outs if self.fmt.stores(t.dtype)}
        for t in outs:
            if t.key in scales:
                continue  # travels with its weight
            scale = by_key.get(self.fmt.scale_key(t.key)) if self.fmt.stores(t.dtype) else None
            if scale is not None:
                scale.key = self.out.scale_key(t.key)  # named as the output names its scales
            policy.take(t, scale, None, step)
