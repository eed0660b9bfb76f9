"""Issue 14, the output side: no output looks complete unless it is the job asked for, proven.

* ``--resume`` continues only the same job: another draft (same paths, changed bytes), a verifier
  shard touched or with a new header, another plan - each refused naming what changed; a real
  interruption still resumes to the bytes of an uninterrupted run.
* The output lock never writes through a link or into another file; an -o inside, equal to, or
  containing an input is refused before anything is written.
* The output is validated before its completion marker: a failure is exit 4 with the rule, no
  index / lone file, no manifest.
* The manifest accounts for every tensor (copied shards by their whole-file digest);
  ``verify-manifest`` fails on an unlisted tensor or a tampered copied shard.
* An input that cannot be read is exit 3 naming it; a copy that ends early is an error.
* ``Checkpoint`` closes its files.

Every input is built here: tiny fixtures, copied and mutated.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ckpt_tools.errors import InputError, OutputError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.ops.check.validate import validate_output
from ckpt_tools.stream.execute import execute

from conftest import run_ckpt as ckpt
from conftest import tree_hash

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MANIFEST = "ckpt_manifest.json"
RECORD = ".ckpt-resume.json"


def complete(out: Path) -> bool:
    return (out / INDEX).exists() or (out / SINGLE).exists()


def visible(out: Path) -> dict[str, bytes]:
    """Every non-hidden file's bytes; the manifest without its command line (it names -o and --resume) and its
    file_stats (inodes and mtimes of this run's files)."""
    files = {}
    for p in sorted(out.iterdir()):
        if p.name.startswith(".") or not p.is_file():
            continue
        data = p.read_bytes()
        if p.name == MANIFEST:
            m = json.loads(data)
            m.pop("command")
            m.pop("file_stats", None)
            data = json.dumps(m, sort_keys=True).encode()
        files[p.name] = data
    return files


@pytest.fixture(scope="module")
def verifier(make_fixture):
    return make_fixture("deepseek_v3")


@pytest.fixture
def local_verifier(verifier, tmp_path):
    """A copy of the verifier this test may touch."""
    d = tmp_path / "verifier"
    shutil.copytree(verifier, d)
    return d


def finetuned_draft(verifier: Path, out: Path, factor: float = 1.01) -> Path:
    """A native draft of ``verifier`` with one MTP tensor changed."""
    ckpt("extract", verifier, "-o", out)
    perturb(out / SINGLE, factor)
    return out


def perturb(shard: Path, factor: float, keep_mtime: bool = False) -> None:
    """Scale one eh_proj weight: same keys, dtypes and shapes (the same header), other bytes."""
    st = shard.stat()
    tensors = load_file(shard)
    key = next(k for k in sorted(tensors) if k.endswith("eh_proj.weight"))
    tensors[key] = (tensors[key].float() * factor).to(tensors[key].dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    if keep_mtime:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def interrupt_after(monkeypatch, copies: int, what: str = "copy_range") -> None:
    """Ctrl-C in the writer after ``copies`` calls of ``what`` (what SIGINT does: cleanup, exit 130)."""
    import ckpt_tools.stream.targets.local as w

    orig, left = getattr(w, what), [copies]

    def interrupted(*a, **k):
        orig(*a, **k)
        left[0] -= 1
        if left[0] == 0:
            raise KeyboardInterrupt

    monkeypatch.setattr(w, what, interrupted)


# -- --resume proves it finishes the same job ---------------------------------------------------


def test_stitch_resume_with_another_draft_is_refused_and_the_same_draft_resumes(verifier, tmp_path, monkeypatch):
    draft = finetuned_draft(verifier, tmp_path / "draft")
    ref = tmp_path / "ref"
    ckpt("stitch", draft, verifier, "-o", ref)
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_after(m, 2, "copy_whole_file")  # one verifier shard copied into place, the next one not
        ckpt("stitch", draft, verifier, "-o", out, code=130)
    assert not complete(out) and (out / RECORD).is_file()
    finished = {p.name: p.read_bytes() for p in out.glob("*.safetensors")}
    assert finished, "the interruption came before any shard was finished"

    original = (draft / SINGLE).read_bytes()
    perturb(draft / SINGLE, 1.5, keep_mtime=True)  # same path, size, header and mtime: other tensor bytes
    r = ckpt("stitch", draft, verifier, "-o", out, "--resume", code=4)
    assert "[resume-mismatch]" in r.output and str(draft) in r.output and "draft's tensors changed" in r.output
    assert not complete(out) and {p.name: p.read_bytes() for p in out.glob("*.safetensors")} == finished

    st = (draft / SINGLE).stat()
    (draft / SINGLE).write_bytes(original)
    os.utime(draft / SINGLE, ns=(st.st_atime_ns, st.st_mtime_ns))
    ckpt("stitch", draft, verifier, "-o", out, "--resume")
    assert visible(out) == visible(ref)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # record, lock, temporaries gone


@pytest.mark.parametrize("change", ["mtime", "header", "carried-file"])
def test_resume_with_a_changed_verifier_shard_is_refused(change, local_verifier, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_after(m, 5)
        ckpt("extract", local_verifier, "-o", out, "--max-shard-size", "40KB", code=130)
    shard = sorted(local_verifier.glob("model-*.safetensors"))[1]
    st = shard.stat()
    if change == "mtime":
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    elif change == "carried-file":  # a file the output carries as it is
        shard = local_verifier / "generation_config.json"
        shard.write_text('{"bos_token_id": 7}')
    else:  # the same tensors under a rewritten header, the modification time put back
        save_file(load_file(shard), shard, metadata={"format": "pt", "note": "rewritten"})
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = ckpt("extract", local_verifier, "-o", out, "--max-shard-size", "40KB", "--resume", code=4)
    assert "[resume-mismatch]" in r.output and shard.name in r.output
    assert {"mtime": "modification time", "header": "header bytes", "carried-file": "changed"}[change] in r.output
    assert not complete(out)


def test_resume_of_another_plan_is_refused(verifier, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_after(m, 2)
        ckpt("extract", verifier, "-o", out, code=130)
    r = ckpt("extract", verifier, "-o", out, "--dtype", "fp32", "--resume", code=4)
    assert "[resume-mismatch]" in r.output and "plan differs" in r.output
    ckpt("extract", verifier, "-o", out, "--resume")  # the interrupted job itself still finishes


def test_resume_without_a_record_of_finished_files_is_refused(verifier, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"left by someone else")
    r = ckpt("extract", verifier, "-o", out, "--resume", code=4)
    assert "[resume-mismatch]" in r.output and "no resume record" in r.output


def test_plan_digest_covers_init_options(verifier):
    from ckpt_tools.ops.draft.init_draft import InitRequest, plan_init

    with Checkpoint.open(verifier) as target:
        digests = {(seed, std): plan_init(target, InitRequest(seed=seed, std=std))[0].digest()["plan"]
                   for seed, std in ((0, None), (1, None), (0, 0.5))}
        assert plan_init(target, InitRequest())[0].digest()["plan"] == digests[(0, None)]
    assert len(set(digests.values())) == 3


# -- the output directory ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "hardlink", "fifo", "directory"])
def test_lock_is_never_written_through_a_link(kind, verifier, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".ckpt.lock"
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling-symlink":
        lock.symlink_to(tmp_path / "nowhere")
    elif kind == "hardlink":
        os.link(victim, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    r = ckpt("extract", verifier, "-o", out, code=4)  # not an exempt lock file: the directory is not empty
    assert "not empty" in r.output
    r = ckpt("extract", verifier, "-o", out, "--overwrite", code=4)
    assert "[lock-file]" in r.output and ".ckpt.lock" in r.output
    assert victim.read_text() == "precious\n" and not (tmp_path / "nowhere").exists()
    assert not complete(out) and sorted(p.name for p in out.iterdir()) == [".ckpt.lock"]


@pytest.mark.parametrize("where", ["inside", "equal", "equal-by-link", "contains"])
def test_output_overlapping_an_input_is_refused(where, local_verifier, tmp_path):
    before = tree_hash(local_verifier)
    out = {"inside": local_verifier / "sub", "equal": local_verifier, "contains": tmp_path,
           "equal-by-link": tmp_path / "link"}[where]
    if where == "equal-by-link":
        out.symlink_to(local_verifier)
    r = ckpt("extract", local_verifier, "-o", out, "--overwrite", code=2)
    assert "[output-overlaps-input]" in r.output
    assert tree_hash(local_verifier) == before and not (local_verifier / "sub").exists()


def test_stitch_output_inside_the_draft_is_refused(verifier, tmp_path):
    draft = finetuned_draft(verifier, tmp_path / "draft")
    before = tree_hash(draft)
    r = ckpt("stitch", draft, verifier, "-o", draft / "stitched", code=2)
    assert "[output-overlaps-input]" in r.output and str(draft) in r.output
    assert tree_hash(draft) == before


# -- validated before the completion marker -----------------------------------------------------------


@pytest.mark.parametrize("max_shard_size", [5 * 10**9, 40_000])
def test_an_invalid_output_gets_no_marker(max_shard_size, verifier, tmp_path):
    from ckpt_tools.ops.draft.extract import ExtractRequest, plan_extract

    with Checkpoint.open(verifier) as c:
        plan = plan_extract(c, ExtractRequest(max_shard_size=max_shard_size))
        dropped = plan.tensors.pop(3).key  # the draft's config still declares it
        out = tmp_path / "out"
        with pytest.raises(OutputError) as e:
            execute(plan, out, check=lambda path, pending: validate_output(path, pending=pending))
    assert e.value.exit_code == 4 and e.value.rule == "mtp-missing"
    assert dropped in str(e.value) and "left incomplete" in str(e.value)
    assert not complete(out) and not (out / MANIFEST).exists()
    assert not list(out.glob(".*.partial"))
    assert ckpt("validate", out, code=None).exit_code != 0


def test_stitch_validation_failure_is_exit_4_with_the_rule(verifier, tmp_path, monkeypatch):
    import ckpt_tools.ops.check.validate as v

    real = v.validate

    def failing(path, arch=None, *, pending=None):
        report = real(path, arch, pending=pending)
        report.add("mtp-missing", Path(path) / "config.json", "model.layers.3.eh_proj.weight", "injected")
        return report

    draft = finetuned_draft(verifier, tmp_path / "draft")
    monkeypatch.setattr(v, "validate", failing)
    out = tmp_path / "out"
    r = ckpt("stitch", draft, verifier, "-o", out, code=4)
    assert "[mtp-missing]" in r.output and "left incomplete" in r.output
    assert not complete(out) and not (out / MANIFEST).exists()


def test_init_draft_with_too_many_layers_leaves_no_complete_output(verifier, tmp_path):
    out = tmp_path / "out"
    r = ckpt("init-draft", verifier, "-o", out, "--num-layers", "65", code=None)
    assert r.exit_code in (2, 4), r.output  # refused at once, or by the check before the marker
    assert "65" in r.output
    assert not out.exists() or (not complete(out) and not (out / MANIFEST).exists())


# -- every tensor accounted for ------------------------------------------------------------------------


@pytest.fixture(params=["copy", "hardlink"])
def stitched(verifier, tmp_path, request):
    draft = finetuned_draft(verifier, tmp_path / "draft")
    out = tmp_path / "stitched"
    ckpt("stitch", draft, verifier, "-o", out, "--link", request.param)
    if request.param == "hardlink":  # tampering must not reach the verifier: copy the linked shards apart
        for p in out.glob("*.safetensors"):
            data = p.read_bytes()
            p.unlink()
            p.write_bytes(data)
    return out


def test_stitch_manifest_lists_every_tensor_and_verifies(stitched, verifier):
    m = json.loads((stitched / MANIFEST).read_text())
    with Checkpoint.open(stitched) as c:
        assert set(m["tensors"]) == set(c.tensors)
        rewritten = set(json.loads((stitched / "stitch-report.json").read_text())["rewritten_shards"])
        copied = set(m["files"])  # shards copied whole: proven by their file's digest
        assert copied and rewritten and not copied & rewritten and copied | rewritten == set(c.headers)
        assert all("blake3" in m["tensors"][k] for k in c.tensors if m["tensors"][k]["file"] in rewritten)
    assert set(m["inputs"]) == {"verifier", "draft"}
    assert m["inputs"]["draft"]["tensors"]["count"] > 0
    assert set(m["inputs"]["verifier"]["files"]) == {p.name for p in verifier.glob("*.safetensors")}
    rep = json.loads(ckpt("verify-manifest", stitched, "--json").stdout)
    assert rep["ok"] and rep["listed"] == rep["verified"] == len(m["tensors"]) and rep["unlisted"] == 0
    assert rep["files_verified"] == len(copied)


def test_verify_manifest_fails_on_a_tampered_copied_shard(stitched):
    name = sorted(json.loads((stitched / MANIFEST).read_text())["files"])[0]
    with open(stitched / name, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    rep = json.loads(ckpt("verify-manifest", stitched, "--json", code=1).stdout)
    assert [(x["key"], x["problem"]) for x in rep["mismatches"]] == [(name, "file-digest")]


def test_an_output_whose_copied_shards_have_no_digest_is_not_verified(stitched):
    """A manifest of an earlier version (copied tensors listed without any digest) is not reported OK."""
    m = json.loads((stitched / MANIFEST).read_text())
    copied = m.pop("files")
    (stitched / MANIFEST).write_text(json.dumps(m))
    rep = json.loads(ckpt("verify-manifest", stitched, "--json", code=1).stdout)
    assert {x["problem"] for x in rep["mismatches"]} == {"no-hash"}
    assert {x["file"] for x in rep["mismatches"]} == set(copied)


def test_verify_manifest_fails_on_an_unlisted_tensor(stitched):
    import torch

    save_file({"model.extra.weight": torch.ones(4)}, stitched / "extra.safetensors", metadata={"format": "pt"})
    index = json.loads((stitched / INDEX).read_text())
    index["weight_map"]["model.extra.weight"] = "extra.safetensors"
    (stitched / INDEX).write_text(json.dumps(index))
    r = ckpt("verify-manifest", stitched, code=1)
    assert "unlisted" in r.output and "model.extra.weight" in r.output


def test_remote_shards_are_not_verifiable_locally(make_fixture, tmp_path, monkeypatch):
    from hubserver import serve_hub

    hub = serve_hub(monkeypatch, tmp_path)
    server = next(hub)
    try:
        ds = make_fixture("deepseek_v3")
        server.state.add_repo("org/verifier", ds)
        draft = finetuned_draft(ds, tmp_path / "draft")
        out = tmp_path / "out"
        ckpt("stitch", draft, "hf://org/verifier", "-o", out, "--link", "remote")
        m = json.loads((out / MANIFEST).read_text())
        remote = {n: f for n, f in m["files"].items() if "remote" in f}
        assert remote and all(len(f["sha256"]) == 64 for f in remote.values())  # the Hub's LFS sha256
        assert all("dtype" in m["tensors"][k] for k in Checkpoint.open(ds).tensors)
        r = ckpt("verify-manifest", out, code=1)
        assert "not verifiable locally" in r.output
    finally:
        hub.close()


# -- read errors vs write errors, short copies ------------------------------------------------------------


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _ending_after_headers(monkeypatch, under: Path) -> None:
    """``os.preadv`` of a shard under ``under`` returns 0 (end of file) past its header: its tensors' bytes
    cannot be read, its header can (the checkpoint opens)."""
    orig = os.preadv

    def fake(fd, buffers, offset, *a):
        path = _fd_path(fd)
        if path.startswith(str(under)) and path.endswith(".safetensors"):
            with open(path, "rb") as f:
                start = 8 + int.from_bytes(f.read(8), "little")
            if offset >= start:
                return 0
        return orig(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "preadv", fake)


def _failing(monkeypatch, name: str, under: Path, result=None, arg: int = 0):
    """Make ``os.<name>`` fail with EIO (or return ``result``) when its fd argument ``arg`` is under ``under``."""
    orig = getattr(os, name)

    def fake(*a, **k):
        if _fd_path(a[arg]).startswith(str(under)):
            if result is not None:
                return result
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return orig(*a, **k)

    monkeypatch.setattr(os, name, fake)


@pytest.mark.parametrize("failing", [("copy_file_range", "preadv"), ("preadv",)])
def test_a_read_error_on_an_input_is_exit_3_naming_it(failing, local_verifier, tmp_path, monkeypatch):
    for name in failing:
        _failing(monkeypatch, name, local_verifier)
    out = tmp_path / "out"
    r = ckpt("extract", local_verifier, "-o", out, code=3)
    assert "[read-error]" in r.output and str(local_verifier) in r.output and ".safetensors" in r.output
    assert not complete(out) and not list(out.glob(".*.partial"))


def test_an_ambiguous_copy_error_is_retried_and_a_write_error_names_the_output(verifier, tmp_path, monkeypatch):
    ref, out = tmp_path / "ref", tmp_path / "out"
    ckpt("extract", verifier, "-o", ref)
    with monkeypatch.context() as m:
        _failing(m, "copy_file_range", verifier)  # EIO from the kernel copy; the buffered retry reads fine
        ckpt("extract", verifier, "-o", out)
    assert visible(out) == visible(ref)
    out2 = tmp_path / "out2"
    _failing(monkeypatch, "copy_file_range", verifier)
    _failing(monkeypatch, "write", out2)  # the output side fails
    r = ckpt("extract", verifier, "-o", out2, code=4)
    assert "write failed" in r.output and str(out2) in r.output and "read-error" not in r.output
    assert not complete(out2)


@pytest.mark.parametrize("verb", ["extract", "stitch"])
def test_a_copy_that_ends_early_is_an_error(verb, verifier, tmp_path, monkeypatch):
    draft = finetuned_draft(verifier, tmp_path / "draft") if verb == "stitch" else None
    _failing(monkeypatch, "copy_file_range", verifier, result=0)  # as if the source ended here
    _ending_after_headers(monkeypatch, verifier)  # the writer's reads (it hashes what it copies) end there too
    out = tmp_path / "out"
    args = ("stitch", draft, verifier) if verb == "stitch" else ("extract", verifier)
    r = ckpt(*args, "-o", out, code=3)
    assert "[short-read]" in r.output and str(verifier) in r.output
    assert not complete(out) and not list(out.glob("*.safetensors")) and not list(out.glob(".*.partial"))


def test_a_source_that_shrank_is_a_short_read(local_verifier, tmp_path, monkeypatch):
    import ckpt_tools.stream.targets.local as w

    src = sorted(local_verifier.glob("*.safetensors"))[0]

    class Shrinking(w.LocalFile):  # the size is taken when opened; the file loses its tail right after
        def __init__(self, path):
            super().__init__(path)
            os.truncate(path, self.size - 100)

    monkeypatch.setattr(w, "LocalFile", Shrinking)
    with pytest.raises(InputError) as e:
        w.copy_whole_file(src, tmp_path / "copy", reflink=False, progress=w.Progress(),
                          buf=memoryview(bytearray(1 << 16)))
    assert e.value.rule == "short-read" and e.value.exit_code == 3 and str(src) in str(e.value)


def test_a_shard_is_flushed_while_the_next_is_copied(verifier, tmp_path, monkeypatch):
    """The disk flushes a copied shard (fsync) while the writer copies the next one; every shard is fsync'd before
    it is renamed into place, and all are in place before the manifest and the index."""
    import threading

    import ckpt_tools.stream.targets.local as w

    draft = finetuned_draft(verifier, tmp_path / "draft")
    second, copies, waited, synced, renamed = threading.Event(), [0], [], set(), []
    copy, fsync, replace = w.copy_whole_file, os.fsync, os.replace

    def counted(*a, **k):
        copies[0] += 1
        if copies[0] == 2:
            second.set()
        return copy(*a, **k)

    def flush(fd):
        path = _fd_path(fd)
        if path.endswith(".safetensors.partial") and not waited:
            waited.append(second.wait(timeout=10))  # fsyncing each file in turn, the next copy never starts
        synced.add(path)
        return fsync(fd)

    def rename(src, dst, *a, **k):
        renamed.append((Path(dst).name, str(src) in synced))
        return replace(src, dst, *a, **k)

    monkeypatch.setattr(w, "copy_whole_file", counted)
    monkeypatch.setattr(os, "fsync", flush)
    monkeypatch.setattr(os, "replace", rename)
    out = tmp_path / "out"
    ckpt("stitch", draft, verifier, "-o", out)
    assert waited == [True]
    names = [n for n, _ in renamed]
    shards = [i for i, n in enumerate(names) if n.endswith(".safetensors")]
    assert len(shards) == 4 and all(ok for n, ok in renamed if n.endswith(".safetensors"))
    assert max(shards) < names.index(MANIFEST) < names.index(INDEX)


def test_a_failed_flush_is_exit_4_naming_the_shard(verifier, tmp_path, monkeypatch):
    draft = finetuned_draft(verifier, tmp_path / "draft")
    out, fsync = tmp_path / "out", os.fsync

    def failing(fd):
        if _fd_path(fd).endswith("00002-of-00004.safetensors.partial"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    r = ckpt("stitch", draft, verifier, "-o", out, code=4)
    assert "write failed" in r.output and "model-00002-of-00004.safetensors" in r.output
    assert not complete(out) and not (out / MANIFEST).exists() and not list(out.glob(".*.partial"))
    assert not (out / "model-00002-of-00004.safetensors").exists()


# -- Checkpoint closes its files ------------------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_checkpoint_closes_its_files(verifier, tmp_path):
    before = _open_fds()
    with Checkpoint.open(verifier) as c:
        assert _open_fds() >= before + len(c.sources)
    assert _open_fds() == before
    broken = tmp_path / "broken"
    shutil.copytree(verifier, broken)
    last = sorted(broken.glob("*.safetensors"))[-1]
    last.write_bytes(struct.pack("<Q", 10**6) + b"{}")  # a header length past the end of the file
    with pytest.raises(Exception, match="header-length"):
        Checkpoint.open(broken)
    assert _open_fds() == before  # the shards opened before the broken one are closed too
    ckpt("extract", verifier, "-o", tmp_path / "out")
    ckpt("verify-manifest", tmp_path / "out")
    assert _open_fds() == before


@pytest.mark.parametrize("planted", [".model.safetensors.partial", ".config.json.partial", "sub"])
def test_leftovers_in_the_output_are_never_written_through(planted, verifier, tmp_path):
    """With --overwrite, a temporary name or a directory of the output that is a link is replaced, not followed."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x").write_text("precious\n")
    src = tmp_path / "src"
    shutil.copytree(verifier, src)
    (src / "sub").mkdir()
    (src / "sub" / "notes.json").write_text("{}")  # a carried file in a subdirectory
    out = tmp_path / "out"
    out.mkdir()
    (out / planted).symlink_to(victim if planted == "sub" else victim / "x")
    r = ckpt("extract", src, "-o", out, "--overwrite", code=None)
    assert (victim / "x").read_text() == "precious\n" and sorted(p.name for p in victim.iterdir()) == ["x"]
    if planted == "sub":
        assert r.exit_code == 4 and "[output-link]" in r.output and not complete(out)
    else:
        assert r.exit_code == 0, r.output
