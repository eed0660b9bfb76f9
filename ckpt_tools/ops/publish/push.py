"""``ckpt push``: publish a checkpoint directory to the Hub, uploading only what the Hub lacks.

Plan first, like every command: list the local files, compare them with the target revision
(files already there with the same content are skipped) and, with ``--base REPO@REV``, with the
base repository (a file whose sha256 equals a base file's LFS oid is copied server-side with
``CommitOperationCopy`` instead of uploaded). Stale weight files of the target revision are
deleted in the same commit so the repository never mixes two shardings. ``--dry-run`` prints
that plan. Execution then uses ``upload_folder`` (multi-commit and resumable with hf_xet) when
there is nothing to copy, and one ``create_commit`` with adds, copies and deletes otherwise.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import CkptError, InputError, UsageError
from ...io.artefacts import LOCK_NAME, MANIFEST_NAME
from ...io.digest import file_sha256
from ...io.hub import HubPushError, HubRef, call, get_api
from ...model.model_card import gather, read_json, render
from . import probe_evidence
from .gguf_publish import gguf_facts

CARD_NAME = "README.md"
STITCH_REPORT = "stitch-report.json"
# Remote files that belong to the checkpoint itself: when the pushed folder no longer has them
# they are deleted, so no stale shard or index is left next to the new ones.
_STALE_PATTERNS = (r".*\.safetensors", r".*\.safetensors\.index\.json", r".*\.bin", r".*\.bin\.index\.json",
                   r".*\.pt", r".*\.pth", r".*\.gguf", re.escape(MANIFEST_NAME), re.escape(STITCH_REPORT))
_STALE_RE = re.compile("|".join(f"(?:{p})" for p in _STALE_PATTERNS))


@dataclass
class PushRequest:
    folder: Path
    repo_id: str
    revision: str | None = None
    private: bool = False
    create_pr: bool = False
    message: str | None = None
    base: HubRef | None = None
    dry_run: bool = False
    force: bool = False
    card: str = "keep"  # keep | overwrite
    command: str = "ckpt push"
    allow_invalid: frozenset[str] = frozenset()  # validate rules pushed anyway (--allow-invalid); the card lists them
    probe_report: Path | None = None  # --probe-report (default: probe-report.json in the folder, when there)
    probe_plot: Path | None = None  # --probe-plot (default: the plot the report names, beside it)
    # vLLM's speculative method for the card's command: the API passes probe_vllm's, so the card shows the command
    # `ckpt probe --engine vllm` runs (None: no vLLM command)
    vllm_method: str | None = None


@dataclass
class Op:
    kind: str  # add | copy | delete | unchanged
    path: str
    size: int = 0
    local: Path | None = None  # add: the local file (None for the generated card)
    src: str | None = None  # copy: path in the base repository

    def to_json(self, base: HubRef | None = None) -> dict:
        out: dict = {"op": self.kind, "path": self.path, "size": self.size}
        if self.kind == "add":
            out["from"] = str(self.local) if self.local else "generated model card"
        if self.kind == "copy" and base is not None:
            out["from"] = f"{base.repo_id}@{base.rev}:{self.src}"
        return out


@dataclass
class PushPlan:
    request: PushRequest
    ops: list[Op]
    card: bytes | None  # generated README.md, or None when the folder's own is kept
    card_action: str  # generated | kept | overwritten
    repo_exists: bool
    repo_private: bool | None
    branch_exists: bool
    target_commit: str | None  # head of the target revision when the plan was made
    base_commit: str | None
    validation: object | None
    card_facts: object | None = None
    notes: list[str] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(1 for o in self.ops if o.kind == kind)

    @property
    def upload_bytes(self) -> int:
        return sum(o.size for o in self.ops if o.kind == "add")

    @property
    def copy_bytes(self) -> int:
        return sum(o.size for o in self.ops if o.kind == "copy")

    def to_json(self) -> dict:
        req = self.request
        v = self.validation
        return {
            "repo_id": req.repo_id,
            "revision": req.revision or "main",
            "create_pr": req.create_pr,
            "dry_run": req.dry_run,
            "repo_exists": self.repo_exists,
            "base": None if req.base is None else {"repo_id": req.base.repo_id, "revision": req.base.rev,
                                                   "commit": self.base_commit},
            "card": self.card_action,
            "probe": _probe_json(self.card_facts),
            "validation": None if v is None else {"ok": bool(v.ok), "problems": [str(p) for p in v.problems]},
            "operations": [o.to_json(req.base) for o in self.ops],
            "counts": {k: self.count(k) for k in ("add", "copy", "delete", "unchanged")},
            "bytes_to_upload": self.upload_bytes,
            "bytes_copied_server_side": self.copy_bytes,
            "notes": self.notes,
        }


def _probe_json(facts: object | None) -> dict | None:
    """The probe report the card carries: where it goes in the repository and which of its MTPs are these files."""
    ev = getattr(facts, "probe", None)
    if ev is None:
        return None
    return {"report": ev.report_path, "plot": ev.plot_path, "tensors_sha256": ev.digest if ev.basis == "tensors"
            else None, **({} if ev.basis == "tensors" else {ev.digest_key: ev.digest}),
            "measured": [ev.report["drafts"][i].get("name") for i in ev.matched]}


# ---------------------------------------------------------------------------
# Local side


def local_files(folder: Path) -> dict[str, Path]:
    """Files to publish: everything but hidden paths (lock, partial files, caches, .git)."""
    out: dict[str, Path] = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        out[rel.as_posix()] = p
    return out


def _refuse_if_being_written(folder: Path) -> None:
    lock = folder / LOCK_NAME
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise InputError("a ckpt command is still writing this directory (lock held); push it when it is done",
                             rule="being-written", path=str(folder)) from None
        finally:
            os.close(fd)
    partial = sorted(p.name for p in folder.glob(".*.partial"))
    if partial:
        raise InputError(f"unfinished output ({partial[0]} is still there): finish it with --resume first",
                         rule="incomplete-output", path=str(folder))


def git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run_validation(folder: Path):
    from ..check.validate import validate
    from .gguf_publish import gguf_files, validate_folder

    ggufs = gguf_files(folder)
    if ggufs:  # llama.cpp's files (extract --format gguf): the GGUF checks, with the manifest's trunk when here
        return validate_folder(ggufs, read_json(folder / MANIFEST_NAME))
    return validate(folder)


# ---------------------------------------------------------------------------
# Planning


def _tree(api, ref: HubRef, commit: str, what: str, push: bool) -> dict:
    from huggingface_hub.hf_api import RepoFile

    entries = call(lambda: list(api.list_repo_tree(ref.repo_id, revision=commit, recursive=True)),
                   ref=ref, what=what, push=push)
    return {e.path: e for e in entries if isinstance(e, RepoFile)}


def _target_state(api, req: PushRequest) -> tuple[bool, bool | None, bool, str | None, dict]:
    """(repo exists, private, branch exists, head commit, files at that commit) of the target."""
    ref = HubRef(req.repo_id, req.revision)
    try:
        info = call(lambda: api.model_info(req.repo_id, revision=req.revision), ref=ref,
                    what=f"looking up {req.repo_id}", push=True)
    except HubPushError as e:
        if e.rule == "hub-repo-not-found":
            return False, None, False, None, {}
        if e.rule != "hub-revision-not-found":
            raise
        # The branch does not exist yet: it will start from main.
        info = call(lambda: api.model_info(req.repo_id), ref=HubRef(req.repo_id), what=f"looking up {req.repo_id}",
                    push=True)
        return True, info.private, False, info.sha, _tree(api, HubRef(req.repo_id), info.sha,
                                                           f"listing {req.repo_id}", True)
    return True, info.private, True, info.sha, _tree(api, ref, info.sha, f"listing {ref}", True)


def _same_content(local: Path, remote, hashes: dict[Path, str]) -> bool:
    if remote.size != local.stat().st_size:
        return False
    if remote.lfs is not None:
        if local not in hashes:
            hashes[local] = file_sha256(local)
        return hashes[local] == remote.lfs.sha256
    return git_blob_sha1(local) == remote.blob_id


@dataclass
class _Unvalidated:
    problems: list[str]
    ok: bool = False


@dataclass
class _Card:
    """The model card the push writes (``data`` None: the folder's own is kept) and what it was built from."""

    data: bytes | None
    action: str  # generated | kept | overwritten
    facts: object
    evidence: object | None  # the probe report the card cites


def _check_request(req: PushRequest) -> None:
    if not req.folder.is_dir():
        raise InputError("no such directory", path=str(req.folder))
    if req.card not in ("keep", "overwrite"):
        raise UsageError(f"--card {req.card!r}: expected keep or overwrite")
    _refuse_if_being_written(req.folder)


def _validation(req: PushRequest) -> object:
    """``ckpt validate`` on the folder; its problems refuse the push unless allowed (--allow-invalid, --force)."""
    try:
        validation = run_validation(req.folder)
    except CkptError as e:  # not a checkpoint at all: still pushable with --force, and said so on the card
        if not req.force:
            raise
        validation = _Unvalidated([str(e)])
    blocking = [p for p in validation.problems if getattr(p, "rule", None) not in req.allow_invalid]
    if blocking and not req.force:
        shown = "\n  ".join(str(p) for p in blocking[:10])
        more = f"\n  ... and {len(blocking) - 10} more" if len(blocking) > 10 else ""
        raise InputError(f"ckpt validate found {len(blocking)} problem(s); refusing to push (--allow-invalid "
                         f"RULE or --force pushes anyway, and the card lists the problems):\n  {shown}{more}",
                         rule="invalid-checkpoint", path=str(req.folder))
    return validation


def _card(req: PushRequest, files: dict[str, Path], manifest: dict | None, validation: object) -> _Card:
    """The card to write; ``files`` gains the probe report and plot from elsewhere and loses a replaced card."""
    folder = req.folder
    stitch_report = read_json(folder / STITCH_REPORT)
    evidence, outside = probe_evidence.find(folder, req.probe_report, req.probe_plot)
    files.update(outside)  # a report and plot from elsewhere travel with the checkpoint
    facts = gather(req.repo_id, folder, manifest=manifest, stitch_report=stitch_report, validation=validation,
                   base=req.base.repo_id if req.base else None, probe=evidence)
    facts.vllm_method = req.vllm_method
    facts.gguf = gguf_facts(folder, manifest, validation)
    if CARD_NAME in files and req.card == "keep":
        return _Card(None, "kept", facts, evidence)
    action = "overwritten" if CARD_NAME in files else "generated"
    files.pop(CARD_NAME, None)
    return _Card(render(facts).encode(), action, facts, evidence)


def _base_files(api, req: PushRequest) -> tuple[str | None, dict[int, list]]:
    """(commit, LFS files by size) of --base: the files a server-side copy can publish."""
    base = req.base
    if base is None:
        return None, {}
    same_repo = base.repo_id == req.repo_id
    # The base is an input: its failures are input errors (exit 3), like any hf:// source.
    binfo = call(lambda: api.model_info(base.repo_id, revision=base.revision), ref=base,
                 what=f"looking up the base {base}")
    by_size: dict[int, list] = {}
    for e in _tree(api, base, binfo.sha, f"listing the base {base}", False).values():
        if e.lfs is not None and (same_repo or e.xet_hash):
            by_size.setdefault(e.size, []).append(e)
    return binfo.sha, by_size


def _file_ops(files: dict[str, Path], remote: dict, base_by_size: dict[int, list]) -> list[Op]:
    """Per local file: unchanged on the target, a server-side copy of a base file, or an upload."""
    # Identity is proven by sha256; hash (in parallel) only files whose size matches a remote or base file.
    need = [p for n, p in files.items() if (n in remote and remote[n].lfs is not None and
                                            remote[n].size == p.stat().st_size) or p.stat().st_size in base_by_size]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        hashes: dict[Path, str] = dict(zip(need, pool.map(file_sha256, need), strict=True))
    ops: list[Op] = []
    for path, local in files.items():
        size = local.stat().st_size
        r = remote.get(path)
        if r is not None and _same_content(local, r, hashes):
            ops.append(Op("unchanged", path, size, local))
            continue
        src = _base_copy(local, path, base_by_size.get(size, []), hashes)
        ops.append(Op("copy", path, size, local, src=src) if src else Op("add", path, size, local))
    return ops


def _base_copy(local: Path, path: str, candidates: list, hashes: dict[Path, str]) -> str | None:
    """The base file (same path preferred) whose LFS sha256 is ``local``'s, or None."""
    if not candidates:
        return None
    if local not in hashes:
        hashes[local] = file_sha256(local)
    match = [e for e in candidates if e.lfs.sha256 == hashes[local]]
    return next((e for e in match if e.path == path), match[0]).path if match else None


def _remote_file_ops(req: PushRequest, remote_files: dict[str, tuple[HubRef, str]], remote: dict,
                     base_by_size: dict[int, list]) -> list[Op]:
    """Shards a stitch left on the Hub: only a server-side copy from the base can publish them."""
    ops: list[Op] = []
    for path, (ref, src) in sorted(remote_files.items()):
        entry = next((e for es in base_by_size.values() for e in es if e.path == src), None)
        if entry is None:
            raise InputError(f"{path} was left on the Hub in {ref} but the base has no LFS file {src}",
                             rule="remote-file", path=str(req.folder))
        r = remote.get(path)
        same = r is not None and r.lfs is not None and r.lfs.sha256 == entry.lfs.sha256
        ops.append(Op("unchanged" if same else "copy", path, entry.size, None, src=src))
    return ops


def _card_op(card: bytes, remote: dict) -> Op:
    r = remote.get(CARD_NAME)
    blob = hashlib.sha1(b"blob %d\0" % len(card) + card, usedforsecurity=False).hexdigest()  # its git blob id
    same = r is not None and r.lfs is None and r.blob_id == blob
    return Op("unchanged" if same else "add", CARD_NAME, len(card))


def _stale_deletes(files: dict[str, Path], remote: dict) -> list[Op]:
    """The target's checkpoint files the folder no longer has: deleted so two shardings never mix."""
    return [Op("delete", path, remote[path].size) for path in sorted(remote)
            if path not in files and path != CARD_NAME and _STALE_RE.fullmatch(path)]


def _notes(req: PushRequest, card: _Card, exists: bool, private: bool | None) -> list[str]:
    notes: list[str] = []
    if card.evidence is not None and card.action == "kept":
        notes.append(f"the folder's {CARD_NAME} is kept, so the probe report's numbers are not in the card "
                     "(--card overwrite writes them)")
    if exists and req.private and private is False:
        notes.append(f"{req.repo_id} exists and is public: --private only applies when the repository is created")
    return notes


def plan_push(req: PushRequest) -> PushPlan:
    _check_request(req)
    validation = _validation(req)
    files = local_files(req.folder)
    manifest = read_json(req.folder / MANIFEST_NAME)
    remote_files = _remote_files(manifest)
    if remote_files:
        req = _base_for_remote_files(req, remote_files)
    card = _card(req, files, manifest, validation)

    api = get_api()
    exists, private, branch_exists, head, remote = _target_state(api, req)
    base_commit, base_by_size = _base_files(api, req)
    ops = _file_ops(files, remote, base_by_size) + _remote_file_ops(req, remote_files, remote, base_by_size)
    if card.data is not None:
        ops.append(_card_op(card.data, remote))
    ops += _stale_deletes(files, remote)
    return PushPlan(req, ops, card.data, card.action, exists, private, branch_exists, head, base_commit, validation,
                    card.facts, _notes(req, card, exists, private))


# ---------------------------------------------------------------------------
# Execution


@dataclass
class PushResult:
    commit_url: str | None
    commit_oid: str | None
    pr_url: str | None
    method: str  # upload_folder | create_commit | nothing

    def to_json(self) -> dict:
        return {"commit_url": self.commit_url, "commit": self.commit_oid, "pr_url": self.pr_url,
                "method": self.method}


def _remote_files(manifest: dict | None) -> dict[str, tuple[HubRef, str]]:
    """Shards a stitch left on the Hub (manifest ``remote_files``): path -> (repo@rev, path there)."""
    out: dict[str, tuple[HubRef, str]] = {}
    for name, url in ((manifest or {}).get("remote_files") or {}).items():
        body, _, src = str(url).removeprefix("hf://").partition("@")
        rev, _, path = src.partition("/")
        out[name] = (HubRef(body, rev or None), path or name)
    return out


def _base_for_remote_files(req: PushRequest, remote_files: dict[str, tuple[HubRef, str]]) -> PushRequest:
    """The base repository the remote shards come from; --base must agree when given."""
    refs = {ref for ref, _ in remote_files.values()}
    if len(refs) != 1:
        raise InputError(f"remote shards come from several repositories ({', '.join(map(str, refs))})",
                         rule="remote-file", path=str(req.folder))
    ref = refs.pop()
    if req.base is not None and (req.base.repo_id != ref.repo_id or (req.base.revision or ref.revision)
                                 not in (ref.revision, None)):
        raise UsageError(f"--base {req.base} differs from {ref}, where the untouched shards were left")
    from dataclasses import replace

    return replace(req, base=req.base or ref)


def execute_push(plan: PushPlan) -> PushResult:
    from huggingface_hub import CommitOperationAdd, CommitOperationCopy, CommitOperationDelete

    req = plan.request
    api = get_api()
    ref = HubRef(req.repo_id, req.revision)
    if not plan.repo_exists:
        call(lambda: api.create_repo(req.repo_id, private=req.private, exist_ok=True), ref=ref,
             what=f"creating {req.repo_id}", push=True)
    if req.revision and not req.create_pr and not plan.branch_exists:
        call(lambda: api.create_branch(req.repo_id, branch=req.revision, exist_ok=True), ref=ref,
             what=f"creating branch {req.revision}", push=True)
    adds = [o for o in plan.ops if o.kind == "add"]
    copies = [o for o in plan.ops if o.kind == "copy"]
    deletes = [o for o in plan.ops if o.kind == "delete"]
    if not (adds or copies or deletes):
        return PushResult(None, plan.target_commit, None, "nothing")
    message = req.message or _default_message(plan)
    description = f"Pushed with `{req.command}`"
    # parent_commit guards the plan (skips and deletes) against a concurrent change of the branch.
    parent = plan.target_commit if plan.repo_exists and plan.branch_exists and not req.create_pr else None

    if copies or (req.create_pr and req.revision):
        base = req.base
        same_repo = base is not None and base.repo_id == req.repo_id
        operations = [CommitOperationAdd(path_in_repo=o.path, path_or_fileobj=str(o.local) if o.local else plan.card)
                      for o in adds]
        operations += [CommitOperationCopy(src_path_in_repo=o.src, path_in_repo=o.path, src_revision=plan.base_commit,
                                           src_repo_id=None if same_repo else base.repo_id,
                                           src_repo_type=None if same_repo else "model") for o in copies]
        operations += [CommitOperationDelete(path_in_repo=o.path) for o in deletes]
        info = call(lambda: api.create_commit(req.repo_id, operations, commit_message=message,
                                              commit_description=description, revision=req.revision,
                                              create_pr=req.create_pr, parent_commit=parent),
                    ref=ref, what=f"committing to {ref}", push=True, retry=False)
        return PushResult(info.commit_url, info.oid, info.pr_url, "create_commit")

    staging = Path(tempfile.mkdtemp(prefix="ckpt-push-"))
    try:
        for o in adds:
            dst = staging / o.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            if o.local is None:
                dst.write_bytes(plan.card or b"")
            else:
                os.symlink(o.local.resolve(), dst)
        info = call(lambda: api.upload_folder(repo_id=req.repo_id, folder_path=staging, commit_message=message,
                                              commit_description=description, revision=req.revision,
                                              create_pr=req.create_pr, parent_commit=parent,
                                              delete_patterns=[re.sub(r"([*?\[])", r"[\1]", o.path)  # escaped
                                                               for o in deletes] or None),
                    ref=ref, what=f"uploading to {ref}", push=True, retry=False)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return PushResult(info.commit_url, info.oid, info.pr_url, "upload_folder")


def _default_message(plan: PushPlan) -> str:
    kind = getattr(plan.card_facts, "kind", "checkpoint")
    what = {"mtp-draft": "MTP draft", "stitched": "stitched checkpoint", "trunk": "trunk",
            "mtp-gguf-sidecar": "MTP GGUF sidecar"}.get(kind, "checkpoint")
    return f"Upload {what} with ckpt-tools"


def push(req: PushRequest) -> tuple[PushPlan, PushResult | None]:
    plan = plan_push(req)
    if req.dry_run:
        return plan, None
    try:
        return plan, execute_push(plan)
    except CkptError:
        raise
    except ValueError as e:  # huggingface_hub's own argument checks (e.g. invalid card metadata)
        raise HubPushError(str(e), rule="hub-push", path=req.repo_id) from e
