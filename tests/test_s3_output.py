"""Outputs to an object store (-o s3://bucket/prefix) against moto's S3 server on 127.0.0.1.

The real s3fs / botocore client writes; the server counts what arrives (tests/s3server.py), so
byte counts are the server's own: uploaded bytes, copy requests, parts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from s3server import Fault, S3Server

from ckpt_tools.errors import OutputError, UsageError
from ckpt_tools.io.artefacts import LOCK_NAME, MANIFEST_NAME, RESUME_NAME
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.io.safetensors_io import LocalFile, Segment
from ckpt_tools.stream.execute import execute
from ckpt_tools.stream.plan import CopyBytes, OutputFile, OutputTensor, Plan

from conftest import run_ckpt as ckpt

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def server():
    s = S3Server().start()
    yield s
    s.stop()


@pytest.fixture
def s3(server, monkeypatch):
    """The server, found through the environment as a user's client finds its endpoint and credentials."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # botocore's retries: a failing request fails in seconds
    server.faults.clear()
    server.stats.reset()
    yield server
    server.faults.clear()


@pytest.fixture
def bucket(s3):
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3.client().create_bucket(Bucket=name)
    s3.stats.reset()
    return name


def objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix/``: name -> bytes (a download: call it after reading the counters)."""
    c = s3.client()
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
    return {k[len(prefix) + 1:]: c.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def local_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def upload_dir(s3, src: Path, bucket: str, prefix: str) -> None:
    c = s3.client()
    for name, data in local_files(src).items():
        c.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)


def same_output(remote: dict[str, bytes], local: dict[str, bytes], reports=("stitch-report.json",)) -> None:
    """Byte-identical but for what names -o: the manifest's command line (and a report's output path), and the
    file_stats only a local output records (inodes and mtimes)."""
    assert set(remote) == set(local)
    for name in remote:
        if name == MANIFEST_NAME:
            a, b = json.loads(remote[name]), json.loads(local[name])
            for m in (a, b):
                m.pop("command")
                m.pop("file_stats", None)
            assert a == b
        elif name not in reports:
            assert remote[name] == local[name], name


def uploads_left(s3, bucket: str) -> list:
    return s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def assert_clean_failure(s3, bucket: str, prefix: str) -> None:
    """Nothing marked complete: no index, no manifest, no lock, no upload left open."""
    left = objects(s3, bucket, prefix)
    assert INDEX not in left and MANIFEST_NAME not in left and LOCK_NAME not in left, sorted(left)
    assert uploads_left(s3, bucket) == []


@pytest.fixture(scope="module")
def verifier(make_fixture):
    return make_fixture("deepseek_v3")


# -- byte-identical outputs ---------------------------------------------------------------------


def test_extract_to_s3_is_byte_identical_to_a_local_extract(s3, bucket, verifier, tmp_path):
    ckpt("extract", verifier, "-o", tmp_path / "draft", "--max-shard-size", "60KB")
    r = ckpt("extract", verifier, "-o", f"s3://{bucket}/draft", "--max-shard-size", "60KB", "--json")
    report = json.loads(r.output)
    assert report["output"] == f"s3://{bucket}/draft"
    stats = s3.stats
    got = objects(s3, bucket, "draft")
    same_output(got, local_files(tmp_path / "draft"))
    shards = [n for n in got if n.endswith(".safetensors")]
    assert len(shards) > 1 and INDEX in got
    # every shard went up as a multipart upload, streamed; nothing was copied
    assert stats.requests["CompleteMultipartUpload"] == len(shards)
    assert stats.bytes_in["UploadPart"] == sum(len(got[n]) for n in shards)
    assert stats.requests["CopyObject"] == stats.requests["UploadPartCopy"] == 0
    # small files by single PUTs: the output's own, the lock and the resume record (rewritten per finished shard)
    small = sum(len(v) for n, v in got.items() if n not in shards)
    assert small <= stats.bytes_in["PutObject"]
    print(f"\nextract -> s3: output {sum(map(len, got.values()))} B, uploaded {stats.uploaded} B "
          f"(parts {stats.bytes_in['UploadPart']} B = shards; PUTs {stats.bytes_in['PutObject']} B, of which "
          f"{small} B output files, the rest lock and resume record)")
    # the manifest says where the bytes came from, never a credential
    manifest = got[MANIFEST_NAME].decode()
    assert "testing" not in manifest and "AWS_" not in manifest and "secret" not in manifest.lower()


def test_stitch_from_local_inputs_uploads_every_shard(s3, bucket, verifier, tmp_path):
    finetuned_draft(verifier, tmp_path / "draft")
    ckpt("stitch", tmp_path / "draft", verifier, "-o", tmp_path / "local")
    ckpt("stitch", tmp_path / "draft", verifier, "-o", f"s3://{bucket}/out")
    uploaded = s3.stats.uploaded
    got = objects(s3, bucket, "out")
    same_output(got, local_files(tmp_path / "local"))
    report = json.loads(got["stitch-report.json"])
    assert report["validation"]["ok"] is True
    shard_bytes = sum(len(v) for n, v in got.items() if n.endswith(".safetensors"))
    assert s3.stats.requests["CopyObject"] == 0 and uploaded >= shard_bytes


def finetuned_draft(verifier: Path, out: Path) -> Path:
    """A native draft of ``verifier`` with one tensor changed: stitching it rewrites that tensor's shard."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt("extract", verifier, "-o", out)
    shard = sorted(out.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    key = next(k for k, t in sorted(tensors.items()) if t.dtype == torch.bfloat16 and t.dim() == 2)
    tensors[key] = (tensors[key].float() * 1.01).to(torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return out


def _stitch_plan(verifier: Path, draft: Path, remote_root: str, how: str) -> Plan:
    """A stitch plan whose untouched files are the same files in the store (``remote_root``), as a
    source opened from that store hands them over: ``link="remote"`` or a source URL."""
    from ckpt_tools.ops.stitch.plan import StitchRequest, plan_stitch

    d, v = Checkpoint.open(draft), Checkpoint.open(verifier)
    plan, _ = plan_stitch(d, v, StitchRequest(command="ckpt stitch (test)"))
    files = []
    for f in plan.files:
        if f.source is not None:
            url = f"{remote_root}/{f.name}"
            f = (OutputFile(f.name, link="remote", remote=url, tensors=f.tensors, header=f.header) if how == "remote"
                 else OutputFile(f.name, source=url, tensors=f.tensors, header=f.header))
        files.append(f)
    plan.files = files
    return plan


@pytest.mark.parametrize("how", ["remote", "source-url"])
def test_stitch_server_side_copies_untouched_shards(s3, bucket, verifier, tmp_path, how):
    from ckpt_tools.ops.check.validate import validate_output

    finetuned_draft(verifier, tmp_path / "draft")
    ckpt("stitch", tmp_path / "draft", verifier, "-o", tmp_path / "local")
    upload_dir(s3, verifier, bucket, "verifier")
    plan = _stitch_plan(verifier, tmp_path / "draft", f"s3://{bucket}/verifier", how)
    copied = {f.name for f in plan.files if f.source is not None or f.link == "remote"}
    copied_shards = {n for n in copied if n.endswith(".safetensors")}
    assert copied_shards and not {n for n in Checkpoint.open(verifier).headers} <= copied_shards  # one is rewritten
    s3.stats.reset()
    checked = {}
    execute(plan, f"s3://{bucket}/out", check=lambda p, pending: checked.update(validate_output(p, pending=pending)))
    stats = s3.stats
    assert checked["ok"] is True
    got = objects(s3, bucket, "out")
    local = local_files(tmp_path / "local")
    local.pop("stitch-report.json")
    assert set(got) == set(local)
    for name in got:
        if name != MANIFEST_NAME:
            assert got[name] == local[name], name
    # every untouched file: one CopyObject, 0 bytes uploaded for it; only the rewritten shards and small files went up
    assert stats.requests["CopyObject"] + stats.requests["UploadPartCopy"] == len(copied)
    assert stats.bytes_in["CopyObject"] == stats.bytes_in["UploadPartCopy"] == 0
    written = {n for n in got if n.endswith(".safetensors")} - copied_shards
    assert stats.bytes_in["UploadPart"] == sum(len(got[n]) for n in written)
    not_copied = sum(len(v) for n, v in got.items() if n not in copied)
    assert stats.uploaded - not_copied < sum(len(got[n]) for n in copied_shards)  # none of the copied bytes
    manifest = json.loads(got[MANIFEST_NAME])
    for name in copied_shards:
        assert manifest["files"][name]["copied_from"] == f"s3://{bucket}/verifier/{name}"
    assert "remote_files" not in manifest  # every file is in the output
    print(f"\nstitch -> s3 ({how}): output {sum(map(len, got.values()))} B, of which {len(copied)} files "
          f"({sum(len(got[n]) for n in copied)} B) copied server-side by {stats.requests['CopyObject']} CopyObject, "
          f"{stats.requests['UploadPartCopy']} UploadPartCopy; uploaded {stats.uploaded} B "
          f"({stats.bytes_in['UploadPart']} B of rewritten shards {sorted(written)})")


def test_output_inside_an_input_in_the_same_store_is_refused(s3, bucket, verifier, tmp_path):
    ckpt("extract", verifier, "-o", tmp_path / "draft")
    plan = _stitch_plan(verifier, tmp_path / "draft", f"s3://{bucket}/verifier", "remote")
    with pytest.raises(UsageError) as e:
        execute(plan, f"s3://{bucket}/verifier/out")
    assert e.value.rule == "output-overlaps-input"
    with pytest.raises(UsageError):
        execute(plan, f"s3://{bucket}")  # contains the input


def test_parts_are_bounded_and_streamed(s3, bucket, tmp_path, monkeypatch):
    """A 13 MB shard goes up in 5 MiB parts (memory: a part or two), byte for byte."""
    import ckpt_tools.stream.targets.object_store as o

    monkeypatch.setattr(o, "PART_SIZE", 5 << 20)
    src = tmp_path / "blob"
    data = os.urandom(13 << 20)
    src.write_bytes(data)
    f = LocalFile(src)
    n = len(data) // 2
    plan = Plan("test", [OutputTensor("a", "F16", (n // 2,), CopyBytes([Segment(f, 0, n)])),
                         OutputTensor("b", "F16", (n // 2,), CopyBytes([Segment(f, n, n)]))])
    result = execute(plan, f"s3://{bucket}/big")
    got = objects(s3, bucket, "big")["model.safetensors"]
    assert got.endswith(data) and len(got) == result.bytes_written
    assert s3.stats.requests["UploadPart"] == 3 and s3.stats.bytes_in["UploadPart"] == len(got)
    assert s3.stats.requests["CompleteMultipartUpload"] == 1


# -- refusals -------------------------------------------------------------------------------------


def test_non_empty_prefix_is_refused_unless_overwrite(s3, bucket, verifier):
    s3.client().put_object(Bucket=bucket, Key="out/notes.txt", Body=b"x")
    r = ckpt("extract", verifier, "-o", f"s3://{bucket}/out", code=4)
    assert "not empty" in r.output and "--overwrite" in r.output
    ckpt("extract", verifier, "-o", f"s3://{bucket}/out", "--overwrite")
    got = objects(s3, bucket, "out")
    assert "notes.txt" in got and "model.safetensors" in got  # ours replaced, others' kept (as locally)
    ckpt("extract", verifier, "-o", f"s3://{bucket}/out", "--overwrite")


def test_overwrite_removes_the_previous_runs_side_files(s3, bucket, verifier, tmp_path):
    """--overwrite leaves what the new run writes: a side file of the previous run's source goes too."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(verifier, src)
    (src / "chat_template.jinja").write_text("{{ messages }}")  # the other model's template
    s3.client().put_object(Bucket=bucket, Key="out/notes.txt", Body=b"x")
    ckpt("extract", src, "-o", f"s3://{bucket}/out", "--overwrite")
    assert "chat_template.jinja" in objects(s3, bucket, "out")
    ckpt("extract", verifier, "-o", f"s3://{bucket}/out", "--overwrite")
    got = objects(s3, bucket, "out")
    assert "chat_template.jinja" not in got and "notes.txt" in got  # no run of ours wrote the note
    assert set(got) - {"notes.txt"} == set(json.loads(got[MANIFEST_NAME])["written"])


def test_credentials_in_the_url_are_refused(s3, bucket, verifier):
    r = ckpt("extract", verifier, "-o", f"s3://AKIA:secret@{bucket}/out", code=2)
    assert "credentials-in-url" in r.output and "secret" not in r.output.replace("secret@", "")


def test_missing_bucket_is_a_clean_error(s3, verifier):
    r = ckpt("extract", verifier, "-o", "s3://no-such-bucket-here/out", code=4)
    assert "does the bucket exist" in r.output


# -- failures leave nothing marked complete -------------------------------------------------------


def _is_part(method, path, query, headers) -> bool:
    return method == "PUT" and "partNumber" in query


def test_403_during_upload_is_a_clean_error(s3, bucket, verifier):
    s3.faults.append(Fault(_is_part, status=403))
    r = ckpt("extract", verifier, "-o", f"s3://{bucket}/out", "--max-shard-size", "60KB", code=4)
    assert "access denied" in r.output and "standard chain" in r.output
    assert "testing" not in r.output  # the (dummy) key is never printed
    assert_clean_failure(s3, bucket, "out")


class DropUploads:
    """WSGI layer: a matching upload's connection is closed after ``after`` body bytes were read.

    The test server's own faults drop responses; an UploadPart response has no body, so this
    drops the request instead: the client sees its connection die while it sends the part.
    The first ``skip`` parts go through.
    """

    def __init__(self, app, after: int = 1024) -> None:
        self.app, self.after, self.dropped, self.skip = app, after, 0, 0
        self.active = True

    def __call__(self, environ, start_response):
        query = environ.get("QUERY_STRING", "")
        if self.active and environ["REQUEST_METHOD"] == "PUT" and "partNumber=" in query:
            if self.skip > 0:
                self.skip -= 1
                return self.app(environ, start_response)
            environ["wsgi.input"].read(self.after)
            self.dropped += 1
            sock = environ.get("werkzeug.socket")
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionAbortedError("test: connection dropped during the upload")
        return self.app(environ, start_response)


@pytest.fixture
def drops(s3):
    layer = DropUploads(s3._server.app)
    s3._server.app = layer
    yield layer
    s3._server.app = layer.app


def test_dropped_connection_during_upload_is_a_clean_error(s3, bucket, verifier, drops):
    r = ckpt("extract", verifier, "-o", f"s3://{bucket}/out", "--max-shard-size", "60KB", code=4)
    assert drops.dropped >= 1
    assert "write failed" in r.output
    assert_clean_failure(s3, bucket, "out")


def test_a_failed_check_leaves_no_index_and_names_the_object(s3, bucket, verifier, tmp_path):
    from ckpt_tools.ops.draft.extract import ExtractRequest, plan_extract

    seen = {}

    def check(root: Path, pending) -> None:
        seen["headers"] = dict(Checkpoint.open(root).headers) if pending.index is None else None
        seen["files"] = sorted(p.name for p in root.iterdir())
        raise OutputError("planted failure", rule="planted", path=str(root / "model.safetensors"))

    with Checkpoint.open(verifier) as v:
        plan = plan_extract(v, ExtractRequest(command="ckpt extract (test)"))
        with pytest.raises(OutputError) as e:
            execute(plan, f"s3://{bucket}/out", check=check)
    assert e.value.rule == "planted" and e.value.path == f"s3://{bucket}/out/model.safetensors"
    assert "left incomplete" in e.value.message
    # the check saw the lone shard's header as streamed (its upload held back until the check passes)
    assert MANIFEST_NAME in seen["files"] and "model.safetensors" in seen["files"]
    assert sorted(seen["headers"]["model.safetensors"].tensors) == sorted(t.key for t in plan.tensors)
    left = objects(s3, bucket, "out")
    assert "model.safetensors" not in left  # the lone file is its own marker: never completed
    assert_clean_failure(s3, bucket, "out")


def test_ctrl_c_during_upload_aborts_it_and_releases_the_lock(s3, bucket, verifier, monkeypatch):
    import ckpt_tools.stream.targets.object_store as o
    from ckpt_tools.stream.writer import Writer

    orig, calls = Writer._write_shard, [0]

    def interrupted(self, *a, **k):
        calls[0] += 1
        if calls[0] == 2:  # the first shard is in, the second's upload begun
            self.target.open("model-00002-of-00003.safetensors", b"x" * (6 << 20))  # one part sent
            assert uploads_left(s3, bucket)
            raise KeyboardInterrupt
        return orig(self, *a, **k)

    monkeypatch.setattr(Writer, "_write_shard", interrupted)
    monkeypatch.setattr(o, "PART_SIZE", 5 << 20)
    r = ckpt("extract", verifier, "-o", f"s3://{bucket}/out", "--max-shard-size", "60KB", code=130)
    assert "no output was marked complete" in r.output and "--resume" in r.output
    assert_clean_failure(s3, bucket, "out")


# -- two writers ----------------------------------------------------------------------------------


def test_two_writers_on_one_prefix_one_refuses(s3, bucket, verifier, monkeypatch):
    from ckpt_tools.stream.writer import Writer

    inside, go = threading.Event(), threading.Event()
    orig = Writer._write_shard

    def paused(self, *a, **k):
        inside.set()
        go.wait(60)
        return orig(self, *a, **k)

    monkeypatch.setattr(Writer, "_write_shard", paused)
    first: dict = {}

    def run_first():
        try:
            first["result"] = ckpt("extract", verifier, "-o", f"s3://{bucket}/out")
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            first["error"] = e

    t = threading.Thread(target=run_first)
    t.start()
    assert inside.wait(60)
    monkeypatch.setattr(Writer, "_write_shard", orig)
    r = ckpt("extract", verifier, "-o", f"s3://{bucket}/out", "--overwrite", code=4)
    assert "[output-locked]" in r.output and "another ckpt command" in r.output
    r = ckpt("extract", verifier, "-o", f"s3://{bucket}/out", code=4)  # without --overwrite: not empty
    go.set()
    t.join(60)
    assert "error" not in first, first
    got = objects(s3, bucket, "out")
    assert INDEX in got or "model.safetensors" in got
    assert LOCK_NAME not in got  # released at the end
    ckpt("validate", verifier)  # the input untouched (and readable)


def test_lock_object_is_created_once(s3, bucket):
    from ckpt_tools.stream.targets.lock import ObjectLock
    from ckpt_tools.stream.targets.store import Store

    store = Store.open(f"s3://{bucket}/x")
    a = ObjectLock(store)
    with pytest.raises(OutputError) as e:
        ObjectLock(store)
    assert e.value.rule == "output-locked"
    assert s3.stats.requests["PutObject"] == 2  # two conditional puts; the second got 412
    a.release()
    ObjectLock(store).release()


# -- resume ----------------------------------------------------------------------------------------


def test_resume_after_an_interrupted_upload_equals_an_uninterrupted_run(s3, bucket, verifier, drops):
    args = ("extract", verifier, "--max-shard-size", "30KB")
    drops.active = False
    ckpt(*args, "-o", f"s3://{bucket}/clean")
    clean = objects(s3, bucket, "clean")
    shards = sorted(n for n in clean if n.endswith(".safetensors"))
    assert len(shards) >= 3
    # the connection drops while the third shard goes up
    drops.active, drops.skip = True, 2
    ckpt(*args, "-o", f"s3://{bucket}/out", code=4)
    partial = objects(s3, bucket, "out")
    assert INDEX not in partial and RESUME_NAME in partial
    kept = sorted(n for n in partial if n.endswith(".safetensors"))
    assert len(kept) == 2
    # --resume: keeps the two finished shards (size and ETag as recorded), uploads the rest
    drops.active = False
    s3.stats.reset()
    ckpt(*args, "-o", f"s3://{bucket}/out", "--resume")
    uploaded_parts = s3.stats.bytes_in["UploadPart"]
    done = objects(s3, bucket, "out")
    assert uploaded_parts == sum(len(done[n]) for n in shards if n not in kept)
    same_output(done, clean)
    assert RESUME_NAME not in done and LOCK_NAME not in done
    # the manifest of a resumed run carries the digests of the kept shards' tensors too
    assert json.loads(done[MANIFEST_NAME])["tensors"] == json.loads(clean[MANIFEST_NAME])["tensors"]


def test_resume_takes_over_the_lock_of_a_killed_run_on_this_host(s3, bucket, verifier):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = {"host": socket.gethostname(), "pid": dead.pid, "since": "2026-01-01T00:00:00Z"}
    s3.client().put_object(Bucket=bucket, Key=f"out/{LOCK_NAME}", Body=json.dumps(lock).encode())
    ckpt("extract", verifier, "-o", f"s3://{bucket}/out", "--resume")
    assert "model.safetensors" in objects(s3, bucket, "out")
    # a live holder on another host is never taken over
    lock["host"] = "elsewhere"
    s3.client().put_object(Bucket=bucket, Key=f"out2/{LOCK_NAME}", Body=json.dumps(lock).encode())
    r = ckpt("extract", verifier, "-o", f"s3://{bucket}/out2", "--resume", code=4)
    assert "[output-locked]" in r.output and f"s3://{bucket}/out2/{LOCK_NAME}" in r.output


# -- every writing verb ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(make_fixture, tmp_path_factory):
    """Inputs of the writing verbs, built once: a checkpoint, its trunk, a fused copy, a fixable quantized one."""
    from ckpt_tools.testing import FixtureOptions
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    fused = tmp_path_factory.mktemp("fused") / "fused"
    full = make_fixture("deepseek_v3")
    ckpt("fuse-experts", full, "-o", fused)
    quant = make_quantized_checkpoint("deepseek_v3", tmp_path_factory.mktemp("q"),
                                      QuantOptions(scheme="ct-fp8-block", mtp="bf16", mtp_exclude="no-fusion"),
                                      FixtureOptions())
    return {"full": full, "trunk": make_fixture("deepseek_v3", drop_mtp=True), "fused": fused, "quant": quant}


VERBS = {
    "graft": lambda i: ("graft", i["full"], i["trunk"]),
    "fuse-experts": lambda i: ("fuse-experts", i["full"]),
    "unfuse-experts": lambda i: ("unfuse-experts", i["fused"]),
    "init-draft": lambda i: ("init-draft", i["trunk"]),
    "fix-quant-config": lambda i: ("validate", "--fix-quant-config", i["quant"]),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_writing_verb_writes_to_s3_what_it_writes_locally(s3, bucket, inputs, verb, tmp_path):
    args = VERBS[verb](inputs)
    ckpt(*args, "-o", tmp_path / "local")
    s3.stats.reset()
    ckpt(*args, "-o", f"s3://{bucket}/out")
    got = objects(s3, bucket, "out")
    same_output(got, local_files(tmp_path / "local"), reports=("graft-report.json",))
    assert INDEX in got or "model.safetensors" in got
    assert LOCK_NAME not in got and RESUME_NAME not in got


def test_stitch_from_an_s3_verifier_to_s3_copies_untouched_shards_server_side(s3, bucket, verifier, tmp_path):
    """End to end through the CLI: verifier opened from s3://, output to s3:// in the same store. Untouched
    shards are never downloaded nor uploaded: each is one CopyObject on the server."""
    finetuned_draft(verifier, tmp_path / "draft")
    ckpt("stitch", tmp_path / "draft", verifier, "-o", tmp_path / "local")
    upload_dir(s3, verifier, bucket, "verifier")
    s3.stats.reset()
    ckpt("stitch", tmp_path / "draft", f"s3://{bucket}/verifier", "-o", f"s3://{bucket}/out")
    copies = s3.stats.requests["CopyObject"] + s3.stats.requests["UploadPartCopy"]
    parts_in, downloaded = s3.stats.bytes_in["UploadPart"], s3.stats.downloaded  # before objects() downloads
    got = objects(s3, bucket, "out")
    local = local_files(tmp_path / "local")
    shards = {n for n in got if n.endswith(".safetensors")}
    for name in shards:
        assert got[name] == local[name], name
    copied = {n for n in shards if got[n] == (verifier / n).read_bytes()}
    assert copied and copied != shards  # some shards untouched, one rewritten
    assert copies >= len(copied)
    assert parts_in == sum(len(got[n]) for n in shards - copied)  # only the rewritten shards went up
    untouched = sum(len(got[n]) for n in copied)
    # downloads: headers and what stitch reads (the MTP tensors it compares, the shard it rewrites), never the
    # untouched shards' bytes
    v = Checkpoint.open(verifier)
    mtp = sum(r.nbytes for k, r in v.tensors.items() if k.startswith("model.layers.3."))  # compared, then copied
    rewritten = sum(len(got[n]) for n in shards - copied)
    assert downloaded < rewritten + mtp + 64_000, (downloaded, rewritten, mtp, untouched)
    print(f"\nstitch s3 -> s3: {len(copied)} untouched shards ({untouched} B) by {copies} server-side copies; "
          f"uploaded parts {parts_in} B; downloaded {downloaded} B")


def test_verify_manifest_of_an_s3_output_vouches_for_server_side_copies_by_etag(s3, bucket, verifier, tmp_path):
    """Issue 14's guarantee holds for object-store outputs: every tensor is accounted for. Uploaded shards
    are re-hashed from the store; server-side copies (never downloaded) are held to the ETag the store gave
    the copy, so rewriting one of them is caught."""
    finetuned_draft(verifier, tmp_path / "draft")
    upload_dir(s3, verifier, bucket, "verifier")
    ckpt("stitch", tmp_path / "draft", f"s3://{bucket}/verifier", "-o", f"s3://{bucket}/out")
    manifest = json.loads(objects(s3, bucket, "out")[MANIFEST_NAME])
    copies = [n for n, f in manifest["files"].items() if f.get("link") == "server-copy"]
    assert copies and all(manifest["files"][n]["etag"] for n in copies)
    ok = json.loads(ckpt("verify-manifest", f"s3://{bucket}/out", "--json").stdout)  # stderr: downloads
    assert ok["ok"] and ok["verified"] == ok["listed"] and ok["files_verified"] >= len(copies)
    assert ok["bytes_hashed"] > 0  # the rewritten shard's tensors, hashed from the store
    c = s3.client()
    key = f"out/{copies[0]}"
    data = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-1] ^= 1  # same size, one bit of the last tensor changed
    c.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    bad = json.loads(ckpt("verify-manifest", f"s3://{bucket}/out", "--json", code=1).stdout)
    assert not bad["ok"] and [m for m in bad["mismatches"] if m["file"] == copies[0] and m["problem"] == "file-digest"]


def test_an_output_store_without_its_backend_names_the_extra(verifier, tmp_path, monkeypatch):
    """The same missing-extra error as for sources (one table of extras): exit 2, nothing written."""
    import builtins

    real = builtins.__import__

    def no_gcsfs(name, *a, **kw):
        if name == "gcsfs":
            raise ImportError("no module named gcsfs", name="gcsfs")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_gcsfs)
    r = ckpt("extract", verifier, "-o", "gs://bucket/draft", code=2)
    assert "missing-extra" in r.output and "pip install 'ckpt-tools[gcs]'" in r.output


def test_graft_into_a_bucket_refuses_a_source_with_nan_mtp_as_it_uploads(s3, bucket, tmp_path):
    """The source's MTP tensors written as they are are checked as the writer uploads them (rule nonfinite):
    nothing is marked complete."""
    import shutil
    import struct

    from ckpt_tools.io.checkpoint import Checkpoint

    corpus = Path(__file__).resolve().parents[1] / "fixtures" / "producers"
    src = tmp_path / "src"
    shutil.copytree(corpus / "transformers-deepseek_v3", src)
    key = "model.layers.2.eh_proj.weight"
    with Checkpoint.open(str(src)) as c:
        seg = c.tensors[key].segment()
    with open(seg.source.name, "r+b") as f:
        f.seek(seg.offset + 22)
        f.write(struct.pack("<H", 0x7FC0))  # a bf16 NaN
    r = ckpt("graft", src, corpus / "llmcompressor-nvfp4a16", "-o", f"s3://{bucket}/g", code=3)
    assert "[nonfinite]" in r.output and key in " ".join(r.output.split())
    assert_clean_failure(s3, bucket, "g")
