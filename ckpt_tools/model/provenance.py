"""Does a draft belong to this verifier? The evidence a draft carries about the model it came from.

Same-shaped tensors of another model stitch without a complaint and give drafts that are never
accepted, so a draft must prove its family. Evidence, first found wins: its ``ckpt_manifest.json``
``family``; else the config fields its format names as evidence (``evidence:`` in
mappings/formats/*.yaml: ``model_type`` / ``architectures``, speculators'
``transformer_layer_config.model_type`` and ``speculators_config.verifier.architectures``).

A name is the verifier's when its table detects it or its own config carries it. Any other name is
a draft of another model (``wrong-family``); no evidence at all is ``draft-unproven``.
``--arch FAMILY`` asserts the family and skips this check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InputError
from ..io.checkpoint import Checkpoint
from .tables.loader import all_tables

if TYPE_CHECKING:
    from .formats import Format
    from .tables.schema import Table

OVERRIDE = "--arch FAMILY asserts the draft's family and overrides this check"


def prove_family(draft: Checkpoint, fmt: Format, table: Table, verifier: Checkpoint) -> str:
    """The evidence that ``draft`` belongs to ``table``'s family; InputError when it does not or cannot."""
    manifest = draft.manifest or {}
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
        raise InputError(f"the draft {draft.root} does not say which model it belongs to: no ckpt_manifest.json "
                         f"family, and {config}. {OVERRIDE}", rule="draft-unproven")
    ours = verifier_names(table, verifier)
    foreign = [(f, v) for f, v in claims if v not in ours]
    if foreign:
        named = "; ".join(f"{f} = {v!r}{_matching(v)}" for f, v in foreign[:4])
        raise InputError(f"the draft {draft.root} belongs to another model: its config.json names {named}, not "
                         f"{table.family} (the verifier's family). {OVERRIDE}", rule="wrong-family")
    return "config.json " + ", ".join(f"{f} = {v}" for f, v in claims)


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
