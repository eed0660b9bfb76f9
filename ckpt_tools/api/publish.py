"""``push``: publish a checkpoint directory to the Hugging Face Hub, uploading only what the Hub lacks.

The same run as ``ckpt push``: validate, generate the model card, plan (skip what the target already
holds, copy server-side what ``base`` holds), then commit; ``dry_run`` stops after the plan. Module
level stays light: huggingface_hub loads when the verb runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .options import Push, keywords
from .report import Report

if TYPE_CHECKING:
    from ..io.hub import HubRef
    from ..ops.publish.push import PushPlan, PushResult

PathArg = str | os.PathLike[str]


@dataclass
class PushReport(Report):
    """``ckpt push``'s result: the plan (every add, copy, delete and unchanged file, the validation, the card)
    and, unless it was a dry run, the commit (``result``; its ``method`` is "nothing" when all was there)."""

    plan: PushPlan
    result: PushResult | None

    @property
    def dry_run(self) -> bool:
        return self.plan.request.dry_run

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = self.plan.to_json()
        out["result"] = None if self.result is None else self.result.to_json()
        return out


def _repo(text: str, what: str) -> HubRef:
    """ORG/NAME[@REV] with a name the Hub accepts: a malformed one is a usage error here, not a Hub error later."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils._validators import validate_repo_id  # where mypy sees it (utils exports lazily)

    from ..errors import UsageError
    from ..io.hub import parse_repo_rev

    ref = parse_repo_rev(text, what)
    try:
        validate_repo_id(ref.repo_id)
    except HFValidationError as e:
        raise UsageError(f"{what} {text!r}: {e}") from None
    return ref


@contextlib.contextmanager
def _hub_bars(progress: bool) -> Iterator[None]:
    """huggingface_hub's upload bars only with ``progress`` (they are on by default there: off in the library)."""
    from huggingface_hub.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if progress or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


@keywords(Push)
def push(source: PathArg, repo_id: str, *, revision: str | None = None, private: bool = False, create_pr: bool = False,
         message: str | None = None, base: str | None = None, dry_run: bool = False, force: bool = False,
         card: str = Push.card, allow_invalid: Sequence[str] = (), progress: bool = False,
         probe_report: PathArg | None = None, probe_plot: PathArg | None = None) -> PushReport:
    """Validate ``source`` (refused on problems unless ``force`` or their rules are in ``allow_invalid``), generate its
    model card and publish it to ``repo_id`` (ORG/NAME). ``probe_report`` must name ``source``'s tensors' digest (a GGUF
    sidecar directory, whose llama.cpp report names no tensor digest: a file with the pushed file's bytes), else
    ``InputError`` rule probe-report-stale. The token comes from HF_TOKEN or ``hf auth login``. Hub failures are
    ``OutputError`` (exit 4), a missing base ``InputError``."""
    from pathlib import Path

    from ..errors import UsageError
    from ..ops.probe.vllm import SPEC_METHOD
    from ..ops.publish import push as _push
    from .writing import _allow, _command

    command = _command(push, (source, repo_id), locals())
    allow = _allow(allow_invalid)
    target = _repo(repo_id, "REPO_ID")
    if target.revision is not None:
        raise UsageError(f"REPO_ID {repo_id!r}: give the branch with --revision, not '@'")
    base_ref = _repo(base, "--base") if base else None
    req = _push.PushRequest(Path(source), target.repo_id, revision=revision, private=private, create_pr=create_pr,
                            message=message, base=base_ref, dry_run=dry_run, force=force, card=card,
                            command=command, allow_invalid=allow,
                            probe_report=None if probe_report is None else Path(probe_report),
                            probe_plot=None if probe_plot is None else Path(probe_plot), vllm_method=SPEC_METHOD)
    with _hub_bars(progress):
        plan, result = _push.push(req)
    return PushReport(plan, result)
