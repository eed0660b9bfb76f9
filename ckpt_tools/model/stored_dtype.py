"""Rule ``stored-dtype``: a tensor whose stored dtype the family's release fixes is stored in that dtype.

A table marks such a tensor ``dtype_fixed: true`` next to its ``dtype`` (schema ``TensorDef``), only
where a public release listing shows the dtype (e.g. a BF16 attention sink bias). Other
``dtype`` entries only say what fixtures and initialisers write; a checkpoint may store those otherwise
(a community BF16 conversion of an F32 router bias is still usable), so they are not checked.

Checked: every such tensor present in the checkpoint, MTP layers and trunk alike; a quantized weight's
stored tensors are never ``dtype_fixed`` (the tables fix only small float tensors). Absent tensors are
the business of the mtp-* / trunk-* rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .problem import Problem
from .tables.resolve import Spec, trunk_specs

if TYPE_CHECKING:
    from .mtp import MtpView

RULE = "stored-dtype"
DESCRIPTION = "a tensor is stored in another dtype than the family's release fixes for it"


def fixed_specs(view: MtpView) -> list[Spec]:
    """Every expected tensor (shared, trunk, MTP) whose dtype the table fixes."""
    res = view.resolved
    if not _table_fixes_any(view):
        return []  # no trunk walk for the many tables that fix nothing
    specs = list(res.shared.values()) + trunk_specs(res)[0] + list(view.present)
    seen: set[str] = set()
    return [s for s in specs if s.dtype_fixed and not (s.key in seen or seen.add(s.key))]


def stored_dtype_problems(view: MtpView, unknown: set[str] = frozenset()) -> list[Problem]:
    """One problem per present tensor stored in another dtype than its ``dtype_fixed`` spec."""
    tensors = view.ckpt.tensors
    out: list[Problem] = []
    for s in fixed_specs(view):
        ref = tensors.get(s.key)
        if ref is None or s.key in unknown or ref.dtype == s.dtype:
            continue
        out.append(Problem(RULE, ref.file, s.key,
                           f"stored {ref.dtype}, but the {view.table.family} release stores it {s.dtype} (table: "
                           f"dtype_fixed); cast it back to {s.dtype} from the original values"))
    return out


def _table_fixes_any(view: MtpView) -> bool:
    table = view.table
    items = [i for part in table.parts.values() for i in part]
    tensors = [i.tensor for i in items if i.tensor is not None] + list(table.shared.values())
    tensors += list(table.mtp.glue.values())
    return any(t.dtype_fixed for t in tensors)
