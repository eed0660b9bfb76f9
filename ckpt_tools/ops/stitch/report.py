"""What writing MTP tensors into a verifier did (stitch, graft): one decision per key, the shards
rewritten, added and linked, the provenance and the config repair (``StitchReport``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..shared.tensor_diff import TensorDiff
from .compare import DIVERGENCE, Decision


@dataclass
class StitchReport:
    mode: str
    format: str
    family: str
    diffs: list[TensorDiff] = field(default_factory=list)  # one entry per key, sorted (the decisions' stats)
    decisions: list[Decision] = field(default_factory=list)  # stitch: what is written for each key, and why
    kept_from_verifier: list[str] = field(default_factory=list)  # --allow-partial
    kept_copies: list[str] = field(default_factory=list)  # per-layer embed/head copies left as they were
    absent_copies: list[str] = field(default_factory=list)  # optional copies the output leaves out, as the verifier did
    ignored_draft_keys: dict[str, str] = field(default_factory=dict)  # key -> reason
    copied_tensors: int = 0  # verifier tensors outside MTP, byte copies
    rewritten_shards: list[str] = field(default_factory=list)
    new_shards: list[str] = field(default_factory=list)
    linked_files: list[str] = field(default_factory=list)
    provenance: str = ""  # the evidence that the draft belongs to the verifier
    exempt: str | None = None  # why the divergence check does not apply to this draft
    manifest: str | None = None  # why the draft's manifest is not evidence (manifest-mismatch), when it is not
    draft: dict = field(default_factory=dict)  # how the draft was read: reader, its notes, the prefix stripped
    quant_config: dict | None = None  # the quantization config repair (quant.repair), when the config changed
    validation: dict | None = None
    link_digests: dict | None = None  # execute.link_digests: how each linked shard's digest was had

    def totals(self) -> dict:
        counts = dict(Counter(d.status for d in self.diffs))
        counts["copied (outside MTP)"] = self.copied_tensors
        return counts

    def divergent(self) -> list[TensorDiff]:
        return [d for d in self.diffs if d.divergent]

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "format": self.format,
            "family": self.family,
            "provenance": self.provenance,
            **({"manifest_mismatch": self.manifest} if self.manifest else {}),
            "draft": self.draft,
            "totals": self.totals(),
            "divergence": {**DIVERGENCE.to_json(), "divergent": [d.key for d in self.divergent()],
                           **({"exempt": self.exempt} if self.exempt else {})},
            "tensors": [d.to_json() for d in self.diffs],
            "kept_from_verifier": self.kept_from_verifier,
            "kept_copies": self.kept_copies,
            "absent_copies": self.absent_copies,
            "ignored_draft_keys": self.ignored_draft_keys,
            "rewritten_shards": self.rewritten_shards,
            "new_shards": self.new_shards,
            "linked_files": self.linked_files,
            **({"quant_config": self.quant_config} if self.quant_config is not None else {}),
            **({"validation": self.validation} if self.validation is not None else {}),
            **({"link_digests": self.link_digests} if self.link_digests is not None else {}),
        }
