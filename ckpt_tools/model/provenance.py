"""Does a draft belong to this verifier? The evidence a draft carries about the model it came from.

Same-shaped tensors of another model stitch without a complaint and give drafts that are never
accepted, so a draft must prove its family. Evidence, first found wins: its ``ckpt_manifest.json``
``family``; else the config fields its format names as evidence (``evidence:`` in
mappings/formats/*.yaml: ``model_type`` / ``architectures``, speculators'
``transformer_layer_config.model_type`` and ``speculators_config.verifier.architectures``).

A name is the verifier's when its table detects it or its own config carries it. Any other name is
a draft of another model (``wrong-family``); no evidence at all is ``draft-unproven``.
``--arch FAMILY`` asserts the family and skips this check.

A manifest is evidence only of what it describes (``manifest-mismatch``): its ``family`` while it lists the draft's
names, dtypes and shapes (``manifest_unlike``), its ``init`` while its digests are the bytes (``manifest_mismatch``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, MutableMapping
from typing import TYPE_CHECKING

from ..errors import InputError
from ..io import digest
from ..io.artefacts import MANIFEST_NAME
from ..io.checkpoint import Checkpoint
from .tables.loader import all_tables

if TYPE_CHECKING:
    from ..io.safetensors_io import Segment, TensorRef
    from .formats import Format
    from .tables.schema import Table

OVERRIDE = "--arch FAMILY asserts the draft's family and overrides this check"


def prove_family(draft: Checkpoint, fmt: Format, table: Table, verifier: Checkpoint, *,
                 no_manifest: str | None = None) -> str:
    """The evidence that ``draft`` belongs to ``table``'s family; InputError when it does not or cannot.
    ``no_manifest``: why its manifest is not evidence (``manifest_mismatch``): its family is then not read."""
    manifest = (draft.manifest or {}) if no_manifest is None else {}
    family = manifest.get("family")
    if isinstance(family, str) and family:
        if family != table.family:
            raise InputError(f"the draft {draft.root} was extracted from a {family} checkpoint (its "
                             f"ckpt_manifest.json); the verifier is {table.family}. {OVERRIDE}", rule="wrong-family")
        return f"ckpt_manifest.json family {family}"
    claims = config_claims(draft.config.raw, fmt.evidence)
    if not claims:
        fields = ", ".join(fmt.evidence) or "none for this format"
        config = (f"its config.json has no {fmt.name} evidence field ({fields})" if draft.config_present
                  else "it has no config.json")
        why = f" ({no_manifest})" if no_manifest else ""
        raise InputError(f"the draft {draft.root} does not say which model it belongs to: no ckpt_manifest.json "
                         f"family{why}, and {config}. {OVERRIDE}", rule="draft-unproven")
    ours = verifier_names(table, verifier)
    foreign = [(f, v) for f, v in claims if v not in ours]
    if foreign:
        named = "; ".join(f"{f} = {v!r}{_matching(v)}" for f, v in foreign[:4])
        raise InputError(f"the draft {draft.root} belongs to another model: its config.json names {named}, not "
                         f"{table.family} (the verifier's family). {OVERRIDE}", rule="wrong-family")
    return "config.json " + ", ".join(f"{f} = {v}" for f, v in claims)


def manifest_claims(draft: Checkpoint) -> bool:
    """The draft's manifest says something a verb would take as evidence (its family, that init-draft made it)."""
    manifest = draft.manifest or {}
    return bool(manifest.get("family")) or isinstance(manifest.get("init"), dict)


def manifest_mismatch(draft: Checkpoint, keys: Collection[str], known: MutableMapping[Segment, str],
                      hash_tensor: Callable[[TensorRef], str], prefix: str = "") -> str | None:
    """Why the draft's manifest is not evidence of its tensors ``keys`` (None: it is).

    Each tensor's recorded digest (``digest.MANIFEST_ALGO``; the entry under ``prefix + key`` when a wrapper
    prefix was stripped) must be the digest of its bytes, with its dtype and shape. Digests already taken
    (``known``: byte range -> digest, stitch's comparison) are used first; the rest are hashed with
    ``hash_tensor`` and added to ``known`` (the fingerprint then reads nothing again), but only while none
    differs: one wrong digest settles it.
    """
    algo = digest.MANIFEST_ALGO
    where = f"{draft.root}/{MANIFEST_NAME}"
    refs = [draft.tensors[k] for k in sorted(keys) if k in draft.tensors]

    def recorded(ref: TensorRef) -> str | None:
        entry = _entry(draft, ref, prefix)
        value = entry.get(algo) if entry is not None else None
        return value if digest.well_formed(value) else None

    wrong = [ref.key for ref in refs if ref.segment() in known and known[ref.segment()] != recorded(ref)]
    if not wrong:
        for ref in refs:
            if ref.segment() not in known:
                known[ref.segment()] = hash_tensor(ref)
                if known[ref.segment()] != recorded(ref):
                    wrong.append(ref.key)
                    break
    if not wrong:
        return None
    checked = sum(1 for ref in refs if ref.segment() in known)
    what = (f"the manifest's {algo} digest is not that of the draft's bytes" if recorded(draft.tensors[wrong[0]])
            else "the manifest lists no digest for it with this dtype and shape")
    return (f"{where}: [manifest-mismatch]: {prefix + wrong[0]}: {what} ({len(wrong)} of {checked} tensor(s) checked "
            "differ): the manifest describes other bytes (the draft was trained or edited since, or the manifest "
            "was copied beside another draft), so its init claim exempts nothing from the divergence check")


def manifest_unlike(draft: Checkpoint, keys: Collection[str], prefix: str = "") -> str | None:
    """Why the draft's manifest does not describe its tensors ``keys`` at all (None: it lists each under its name,
    ``prefix + key``, with its dtype and shape): its family claim is then not evidence. Reads headers only."""
    for key in sorted(keys):
        ref = draft.tensors.get(key)
        if ref is not None and _entry(draft, ref, prefix) is None:
            return (f"{draft.root}/{MANIFEST_NAME}: [manifest-mismatch]: {prefix + key}: the manifest lists no tensor "
                    f"of this name with dtype {ref.dtype} and shape {list(ref.shape)}: it describes another draft, so "
                    "its family and init claims are not evidence and the draft is judged without it")
    return None


def _entry(draft: Checkpoint, ref: TensorRef, prefix: str) -> dict | None:
    """The manifest's entry for ``ref`` when it records the tensor's dtype and shape (None otherwise)."""
    entries = (draft.manifest or {}).get("tensors")
    entry = entries.get(prefix + ref.key) if isinstance(entries, dict) else None
    if not isinstance(entry, dict) or entry.get("dtype") != ref.dtype or entry.get("shape") != list(ref.shape):
        return None
    return entry


def config_claims(config: dict, fields: list[str]) -> list[tuple[str, str]]:
    """(field, name) for every string a dotted ``field`` holds (a list field gives each of its strings)."""
    out: list[tuple[str, str]] = []
    for path in fields:
        value: object = config
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        names = value if isinstance(value, list) else [value]
        out += [(path, v) for v in names if isinstance(v, str) and v]
    return out


def verifier_names(table: Table, verifier: Checkpoint) -> set[str]:
    """Every model type and architecture that names the verifier's family."""
    names = set(table.detect.architectures) | set(table.detect.model_types) | set(table.engines.values())
    return names | set(verifier.config.architectures()) | set(verifier.config.model_types())


def _matching(name: str) -> str:
    tables = sorted(t.family for t in all_tables().values()
                    if name in t.detect.architectures or name in t.detect.model_types or name in t.engines.values())
    return f" (table {', '.join(tables)})" if tables else ""
