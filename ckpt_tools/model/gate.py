"""The consistency gate: every verb's refusal before a byte is written, on the rules of ``rules.RULE_SET``.

``check`` runs the refusing checks of the one rule set (validate runs all of them); ``require_consistent``
refuses (exit 3) what neither ``--allow-invalid`` nor the verb's own repairs let through. It sits above
``consistency`` (the checks) and ``rules`` (their list), so neither imports the other's user.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ..errors import InputError
from . import rules
from .consistency import REPORT_ONLY, Gate, Holders, Problem, config_path
from .mtp import choose_table, open_mtp

if TYPE_CHECKING:
    from ..io.checkpoint import Checkpoint
    from .mtp import MtpView
    from .tables.schema import Table


def check(ckpt: Checkpoint, table: Table | None = None, *, arch: str | None = None, scope: str = "auto",
          view: MtpView | None = None) -> tuple[list[Problem], MtpView | None]:
    """Every problem of an opened checkpoint under the gate's rules, and the MTP view it was judged with.

    ``scope``: ``files`` (index and files only, no table needed), ``auto`` (all rules; the trunk
    unless the checkpoint is a draft) or ``model`` (all rules; a whole model is required). A
    config-only checkpoint (no index, no shard) has no tensors to check, only its config. Raises
    InputError when the table cannot be chosen or resolved (``unknown-family``, ``config-field``, ...).
    """
    if scope not in ("files", "auto", "model"):
        raise ValueError(f"scope {scope!r}")
    weightless = not ckpt.headers and ckpt.index is None
    ctx = rules.Context(ckpt, Holders(ckpt), whole_model=scope == "model",
                        config=config_path(ckpt) if ckpt.config_present else None)
    problems = [] if weightless else rules.run(ctx, "files", refusing_only=True)
    if scope == "files":
        return problems, view
    if view is None:
        view = open_mtp(ckpt, table or choose_table(ckpt, arch))
    if weightless:
        return problems, view
    ctx.view, ctx.table = view, view.table
    problems += rules.run(ctx, "model", refusing_only=True)
    return problems, view


def require_consistent(ckpt: Checkpoint, table: Table | None = None, *, arch: str | None = None,
                       allow: Iterable[str] = (), waive: Mapping[str, str] | None = None, scope: str = "auto",
                       view: MtpView | None = None, role: str | None = None,
                       hints: Mapping[str, str] | None = None) -> Gate:
    """Refuse (InputError, exit 3) a checkpoint that breaks a rule neither allowed nor waived.

    ``allow``: rules the user let through (``--allow-invalid``). ``waive``: rules the verb repairs by
    construction, each with the reason (e.g. ``--drop-mtp`` drops every MTP tensor). ``role``
    names the input in the message (``verifier``, ``draft``, ...); ``hints``: rule -> the verb's own
    way out, added to the message when that rule is the one shown.
    """
    problems, view = check(ckpt, table, arch=arch, scope=scope, view=view)
    waive = waive or {}
    allow = frozenset(allow)
    gate = Gate(view.table if view is not None else table, view)
    refused: list[Problem] = []
    for p in problems:
        if p.rule in REPORT_ONLY:
            continue
        if p.rule in waive:
            gate.waived.append(p)
        elif p.rule in allow:
            gate.allowed.append(p)
        else:
            refused.append(p)
    if refused:
        raise refusal(ckpt, refused, role, (hints or {}).get(refused[0].rule))
    return gate


def refusal(ckpt: Checkpoint, refused: list[Problem], role: str | None = None, hint: str | None = None
            ) -> InputError:
    """One message: the first problem in full, how many others (by rule), and the two ways on."""
    first = refused[0]
    counts = Counter(p.rule for p in refused[1:])
    others = ""
    if counts:
        listed = ", ".join(f"{r} x{n}" if n > 1 else r for r, n in counts.items())
        others = f" (and {len(refused) - 1} more problem(s): {listed})"
    rules = list(dict.fromkeys(p.rule for p in refused))
    what = f"the {role} " if role else ""
    flags = " ".join(f"--allow-invalid {r}" for r in rules[:4]) + (" ..." if len(rules) > 4 else "")
    key = f"{first.key}: " if first.key else ""
    msg = (f"{key}{first.message}{others}. {what.capitalize() or 'The '}checkpoint {ckpt.root} is inconsistent; "
           + (f"{hint}; " if hint else "")
           + f"`ckpt validate {ckpt.root}` lists every problem, `{flags}` proceeds anyway")
    return InputError(msg, rule=first.rule, path=first.path or ckpt.root)
