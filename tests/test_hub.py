"""hf:// sources against a local Hub (tests/hubserver.py) driven by the real huggingface_hub client.

Bytes are counted at the server: opening, inspecting and validating a remote checkpoint must
download headers (plus config and index) only; extracting must download the MTP bytes and little
more; failures (missing repository, bad token, connection refused mid-transfer) must end with a
clear message, a non-zero exit code and no output marked complete.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ckpt_tools.cli import app
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.io.hub import HUB_STATS, HubReadError, parse_hf_url
from ckpt_tools.io.safetensors_io import IO_STATS

from hubserver import serve_hub


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from serve_hub(monkeypatch, tmp_path)


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def _registered(name: str) -> bool:
    return any(c.name == name for c in app.registered_commands)


def _meta_bytes(local: Checkpoint) -> int:
    """What opening must download: every shard header, config.json and the index."""
    d = local.local_dir
    extra = sum((d / n).stat().st_size for n in ("config.json", "model.safetensors.index.json") if (d / n).exists())
    return local.header_bytes() + extra


@pytest.fixture
def ds(make_fixture):
    return make_fixture("deepseek_v3", fp8=True)


def test_parse_hf_url():
    assert parse_hf_url("hf://org/repo").repo_id == "org/repo"
    assert parse_hf_url("hf://org/repo").rev == "main"
    assert parse_hf_url("hf://org/repo@refs%2Fpr%2F3").revision == "refs/pr/3"
    assert parse_hf_url("hf://org/repo@v1.0").revision == "v1.0"
    for bad in ("hf://", "hf://a/b/c", "hf://org/repo@", "hf://../x"):
        with pytest.raises(Exception, match="ORG/REPO"):
            parse_hf_url(bad)


def test_open_remote_has_the_structure_of_a_local_checkpoint(hub, ds):
    sha = hub.state.add_repo("org/verifier", ds)
    local = Checkpoint.open(ds)
    hub.state.stats.reset()
    remote = Checkpoint.open("hf://org/verifier")
    assert remote.local_dir is None
    assert remote.root == f"hf://org/verifier@{sha}"  # pinned to the commit it was opened at
    assert remote.config.raw == local.config.raw
    assert remote.index == local.index
    assert remote.files == local.files
    assert remote.shard_keys == local.shard_keys
    assert {n: (h.header_len, h.tensors, h.metadata) for n, h in remote.headers.items()} == \
           {n: (h.header_len, h.tensors, h.metadata) for n, h in local.headers.items()}
    assert {k: (r.dtype, r.shape, r.offset, r.nbytes) for k, r in remote.tensors.items()} == \
           {k: (r.dtype, r.shape, r.offset, r.nbytes) for k, r in local.tensors.items()}
    for name, src in remote.sources.items():
        assert src.local_fd() is None and src.size == (ds / name).stat().st_size
        assert remote.shard_of(remote.shard_keys[name][0]) == name
    # Opening downloaded the headers, config and index: not one tensor byte.
    assert hub.state.stats.served == _meta_bytes(local)
    assert HUB_STATS.bytes_downloaded == hub.state.stats.served
    shard_gets = [r for r in hub.state.stats.requests if "safetensors/" not in r[1] and r[1].endswith(".safetensors")]
    assert shard_gets and all(r[2] is not None and r[3] == 206 for r in shard_gets)  # range requests only

    # A tensor read fetches exactly its bytes, identical to the local file's.
    key = max(local.tensors, key=lambda k: local.tensors[k].nbytes)
    before, io_before = hub.state.stats.served, IO_STATS.bytes_read
    assert bytes(remote.tensors[key].read()) == bytes(local.tensors[key].read())
    assert hub.state.stats.served - before == local.tensors[key].nbytes
    assert IO_STATS.bytes_read - io_before >= local.tensors[key].nbytes

    # Non-weight files are fetched one by one, only when asked for.
    assert "tokenizer_config.json" in remote.files
    before = hub.state.stats.served
    p = remote.file_path("tokenizer_config.json")
    assert hub.state.stats.served == before  # a path costs nothing until the file is opened
    assert p.read_bytes() == (ds / "tokenizer_config.json").read_bytes()
    assert remote.read_file("generation_config.json") == (ds / "generation_config.json").read_bytes()
    assert hub.state.stats.served - before == (ds / "tokenizer_config.json").stat().st_size + \
           (ds / "generation_config.json").stat().st_size
    with pytest.raises(Exception, match="not a file of this repository"):
        remote.file_path("nope.json")


def test_revision_is_honoured(hub, ds):
    old = hub.state.add_repo("org/verifier", ds)
    repo = hub.state.repos["org/verifier"]
    # A second commit on branch v2 whose config differs.
    cfg = json.loads((ds / "config.json").read_text()) | {"note": "v2"}
    entry = hub.state._entry(repo, "config.json", json.dumps(cfg).encode())
    repo.commits["f" * 40] = dict(repo.commits[old], **{"config.json": entry})
    repo.refs["v2"] = "f" * 40
    a = Checkpoint.open("hf://org/verifier")
    b = Checkpoint.open("hf://org/verifier@v2")
    c = Checkpoint.open(f"hf://org/verifier@{old[:10]}")
    assert a.root.endswith(old) and b.root.endswith("f" * 40) and c.root.endswith(old)
    assert "note" not in a.config.raw and b.config.raw["note"] == "v2" and c.config.raw == a.config.raw
    with pytest.raises(HubReadError, match="revision 'nope' not found"):
        Checkpoint.open("hf://org/verifier@nope")


@pytest.mark.parametrize("cmd", ["inspect", "validate"])
def test_inspect_and_validate_download_only_headers(hub, ds, cmd):
    if not _registered(cmd):
        pytest.skip(f"`ckpt {cmd}` is not registered yet")
    hub.state.add_repo("org/verifier", ds)
    hub.state.stats.reset()
    r = run(cmd, "hf://org/verifier", "--json")
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)
    assert hub.state.stats.served == _meta_bytes(Checkpoint.open(ds))


def _mtp_bytes(ckpt: Checkpoint) -> int:
    from ckpt_tools.model.mtp import open_mtp

    view = open_mtp(ckpt)
    return sum(ckpt.tensors[s.key].nbytes for s in view.present)


def test_extract_remote_equals_extract_local(hub, ds, tmp_path):
    if not _registered("extract"):
        pytest.skip("`ckpt extract` is not registered yet (ckpt_tools.ops.draft.extract is being written)")
    hub.state.add_repo("org/verifier", ds)
    local = Checkpoint.open(ds)
    r = run("extract", str(ds), "-o", str(tmp_path / "a"), "--format", "native")
    assert r.exit_code == 0, r.output
    hub.state.stats.reset()
    r = run("extract", "hf://org/verifier", "-o", str(tmp_path / "b"), "--format", "native")
    assert r.exit_code == 0, r.output
    a, b = tmp_path / "a", tmp_path / "b"
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        if n != "ckpt_manifest.json":  # it names its source (a path vs hf://org/verifier@commit)
            assert (a / n).read_bytes() == (b / n).read_bytes(), n
    ma, mb = (json.loads((d / "ckpt_manifest.json").read_text()) for d in (a, b))
    hashes = [{k: v.get("blake3") for k, v in m["tensors"].items()} for m in (ma, mb)]
    assert hashes[0] == hashes[1]
    # Downloaded: the MTP tensors, the headers, config/index and the small files carried along.
    carried = sum((ds / f).stat().st_size for f in local.files if (b / f).exists())
    mtp = _mtp_bytes(local)
    served = hub.state.stats.served
    assert served >= mtp
    assert served <= mtp + _meta_bytes(local) + carried + 0.05 * mtp, (served, mtp)


def test_stitch_into_a_remote_verifier_equals_local(hub, ds, tmp_path):
    if not (_registered("stitch") and _registered("extract")):
        pytest.skip("`ckpt stitch` / `ckpt extract` are not registered yet")
    hub.state.add_repo("org/verifier", ds)
    draft = tmp_path / "draft"
    assert run("extract", str(ds), "-o", str(draft)).exit_code == 0
    r = run("stitch", str(draft), str(ds), "-o", str(tmp_path / "a"))
    assert r.exit_code == 0, r.output
    hub.state.stats.reset()
    HUB_STATS.reset()
    r = run("stitch", str(draft), "hf://org/verifier", "-o", str(tmp_path / "b"), "--dry-run")
    assert r.exit_code == 0, r.output
    # A dry run compares the MTP tensors (the report) and downloads no whole shard.
    local = Checkpoint.open(ds)
    assert HUB_STATS.files_downloaded == 0
    assert hub.state.stats.served <= _meta_bytes(local) + 1.05 * _mtp_bytes(local)
    r = run("stitch", str(draft), "hf://org/verifier", "-o", str(tmp_path / "b"))
    assert r.exit_code == 0, r.output
    a, b = tmp_path / "a", tmp_path / "b"
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        if n not in ("ckpt_manifest.json", "stitch-report.json"):  # these name their sources
            assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_diff_a_remote_checkpoint(hub, ds, tmp_path):
    if not _registered("diff"):
        pytest.skip("`ckpt diff` is not registered yet")
    from safetensors.torch import load_file, save_file

    hub.state.add_repo("org/verifier", ds)
    changed = tmp_path / "changed"
    shutil.copytree(ds, changed)
    index = json.loads((changed / "model.safetensors.index.json").read_text())
    key = next(k for k in sorted(index["weight_map"]) if k.endswith("enorm.weight"))
    tensors = load_file(changed / index["weight_map"][key])
    tensors[key] = tensors[key] + 1
    save_file(tensors, changed / index["weight_map"][key], metadata={"format": "pt"})
    r = run("diff", "hf://org/verifier", str(ds), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["identical"] is True
    r = run("diff", "hf://org/verifier", str(changed), "--json")
    assert r.exit_code == 1, r.output
    assert [t["key"] for t in json.loads(r.stdout)["tensors"]] == [key]


def test_missing_repo_is_a_clear_input_error(hub, tmp_path):
    for cmd in ("inspect", "validate"):
        if _registered(cmd):
            r = run(cmd, "hf://org/does-not-exist")
            assert r.exit_code == 3, r.output
            assert "org/does-not-exist not found" in r.output and "Traceback" not in r.output
    with pytest.raises(HubReadError, match="not found") as e:
        Checkpoint.open("hf://org/does-not-exist")
    assert e.value.exit_code == 3 and e.value.rule == "hub-repo-not-found"


def test_missing_revision_and_private_repo(hub, ds, monkeypatch):
    hub.state.add_repo("org/secret", ds, private=True)
    with pytest.raises(HubReadError, match="revision 'nope' not found") as e:
        Checkpoint.open("hf://org/secret@nope")
    assert e.value.rule == "hub-revision-not-found"
    monkeypatch.delenv("HF_TOKEN")  # and HF_TOKEN_PATH points at no file: anonymous
    with pytest.raises(HubReadError, match="private.*HF_TOKEN") as e:
        Checkpoint.open("hf://org/secret")
    assert e.value.rule == "hub-repo-not-found"


def test_bad_token_is_explained_and_never_printed(hub, ds, monkeypatch, tmp_path):
    hub.state.add_repo("org/verifier", ds)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_valid_token_42")
    with pytest.raises(HubReadError, match="rejected the token") as e:
        Checkpoint.open("hf://org/verifier")
    assert e.value.rule == "hub-auth" and e.value.exit_code == 3
    if _registered("extract"):
        r = run("extract", "hf://org/verifier", "-o", str(tmp_path / "out"))
        assert r.exit_code == 3 and "401" in r.output and "hf_not_a_valid_token_42" not in r.output


def test_connection_refused_mid_transfer_leaves_no_complete_output(hub, ds, tmp_path):
    if not _registered("extract"):
        pytest.skip("`ckpt extract` is not registered yet")
    hub.state.add_repo("org/verifier", ds)
    Checkpoint.open("hf://org/verifier")  # warm: the failure below happens while copying tensors
    hub.state.stats.reset()
    hub.drop_after(_meta_bytes(Checkpoint.open(ds)) + 1000)  # headers, then 1000 tensor bytes, then gone
    out = tmp_path / "out"
    r = run("extract", "hf://org/verifier", "-o", str(out), "--format", "native")
    assert r.exit_code == 3, r.output
    assert "network failure" in r.output and "Traceback" not in r.output
    assert not (out / "model.safetensors.index.json").exists()
    assert not (out / "ckpt_manifest.json").exists()
    assert not (out / "model.safetensors").exists()


def test_remote_file_resumes_a_broken_transfer(hub, ds):
    """A connection dropped part-way is resumed from the last byte (no server restart needed)."""
    hub.state.add_repo("org/verifier", ds)
    remote = Checkpoint.open("hf://org/verifier")
    local = Checkpoint.open(ds)
    key = max(local.tensors, key=lambda k: local.tensors[k].nbytes)
    hub.state.drop_after = hub.state.stats.served + 100  # drop once, keep listening
    data = bytes(remote.tensors[key].read())
    assert data == bytes(local.tensors[key].read())
    ranges = [r[2] for r in hub.state.stats.requests if r[2]]
    assert len(ranges) >= 2 and ranges[-1].startswith(f"bytes={local.tensors[key].offset + 100}-")


def test_hf_endpoint_in_a_fresh_process(hub, ds):
    """`ckpt` as users run it: HF_ENDPOINT read from the environment at start-up."""
    if not _registered("validate"):
        pytest.skip("`ckpt validate` is not registered yet")
    hub.state.add_repo("org/verifier", ds)
    hub.state.stats.reset()
    r = subprocess.run([sys.executable, "-m", "ckpt_tools", "validate", "hf://org/verifier", "--json"],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert hub.state.stats.served == _meta_bytes(Checkpoint.open(ds))


def test_hub_source_exposes_its_fsspec_filesystem(hub, ds):
    """The source contract: ``fs`` (HfFileSystem on the same endpoint) and ``url_of`` name the pinned files."""
    sha = hub.state.add_repo("org/verifier", ds)
    remote = Checkpoint.open("hf://org/verifier")
    name = remote.shard_names[0]
    assert remote.url_of(name) == f"hf://org/verifier@{sha}/{name}"
    fs_path = remote.url_of(name)[len("hf://"):]
    assert remote.fs.size(fs_path) == (ds / name).stat().st_size
    assert remote.fs.cat_file(fs_path, start=0, end=8) == (ds / name).read_bytes()[:8]
