"""`ckpt push` against a local Hub (tests/hubserver.py) driven by the real huggingface_hub client.

What the server received is compared with the pushed directory byte for byte; bytes uploaded
are counted at the server, so `--base` is proven to copy unchanged shards server-side without
sending a byte of them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpt_tools.cli import app
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.io.digest import file_sha256

from hubserver import READ_TOKEN, WRITE_TOKEN, serve_hub


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from serve_hub(monkeypatch, tmp_path)


@pytest.fixture
def ds(make_fixture):
    return make_fixture("deepseek_v3", fp8=True)


def run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def card_of(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    _, meta, body = text.split("---\n", 2)
    return yaml.safe_load(meta), body


def draft_dir(ds: Path, tmp_path: Path) -> Path:
    """A checkpoint as ckpt writes it, without a README, with a manifest naming its Hub source."""
    d = tmp_path / "draft"
    shutil.copytree(ds, d)
    (d / "README.md").unlink()
    ck = Checkpoint.open(d)
    tensors = {k: {"file": ck.shard_of(k), "dtype": r.dtype, "shape": list(r.shape)} for k, r in ck.tensors.items()}
    manifest = {
        "tool": "ckpt-tools", "version": "0.1.0",
        "command": "ckpt extract hf://org/verifier@main -o draft --format native",
        "kind": "mtp-draft", "source": {"path": "org/verifier", "revision": "a" * 40},
        "family": "deepseek_v3", "format": "native", "layers": [0], "tensors": tensors,
    }
    (d / "ckpt_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return d


def stitched_dir(ds: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of ``ds`` whose MTP shard was rewritten with one changed tensor (a stitched verifier)."""
    d = tmp_path / "stitched"
    shutil.copytree(ds, d)
    (d / "README.md").unlink()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    key = next(k for k in sorted(index["weight_map"]) if k.endswith("enorm.weight"))
    shard = index["weight_map"][key]
    tensors = load_file(d / shard)
    tensors[key] = tensors[key] + 1
    save_file(tensors, d / shard, metadata={"format": "pt"})
    (d / "stitch-report.json").write_text(json.dumps({"summary": {"unchanged": len(index["weight_map"]) - 1,
                                                                  "replaced": 1}}) + "\n")
    return d, shard


def test_push_new_repo_files_identical_and_card_generated(hub, ds, tmp_path):
    d = draft_dir(ds, tmp_path)
    r = run("push", d, "me/draft")
    assert r.exit_code == 0, r.output
    got = hub.state.files("me/draft")
    local = files_of(d)
    for name, data in local.items():
        assert got[name] == data, name
    assert set(got) == set(local) | {"README.md", ".gitattributes"}
    # Every byte went over the wire once (LFS PUTs + inline files): nothing more.
    assert hub.state.stats.uploaded == sum(len(b) for b in local.values()) + len(got["README.md"])

    meta, body = card_of(got["README.md"].decode())
    assert meta["base_model"] == "org/verifier"
    assert {"mtp", "speculative-decoding", "deepseek-v3", "mtp-draft"} <= set(meta["tags"])
    assert "ckpt extract hf://org/verifier@main -o draft --format native" in body  # how it was produced
    assert "a" * 40 in body and "0.1.0" in body  # source revision and tool version
    assert "found no problems" in body  # validation summary
    assert '"method": "mtp"' in body and '"num_speculative_tokens": 1' in body and "--speculative-config" in body
    assert "sglang.launch_server" in body
    from huggingface_hub import ModelCard

    card = ModelCard(got["README.md"].decode())  # huggingface_hub parses it back
    assert card.data.base_model == "org/verifier"


def test_push_twice_uploads_nothing(hub, ds, tmp_path):
    d = draft_dir(ds, tmp_path)
    assert run("push", d, "me/draft").exit_code == 0
    commits = len(hub.state.repos["me/draft"].commits)
    hub.state.stats.reset()
    r = run("push", d, "me/draft", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["bytes_to_upload"] == 0 and out["result"]["method"] == "nothing"
    assert out["counts"]["unchanged"] == len(files_of(d)) + 1  # and the card, generated identically
    assert len(hub.state.repos["me/draft"].commits) == commits  # no empty commit
    assert hub.state.stats.uploaded == 0


def test_push_with_base_copies_unchanged_shards_server_side(hub, ds, tmp_path):
    hub.state.add_repo("org/verifier", ds)
    d, changed = stitched_dir(ds, tmp_path)
    r = run("push", d, "me/stitched", "--base", "org/verifier", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    copied = [o["path"] for o in out["operations"] if o["op"] == "copy"]
    assert copied == [s for s in shards if s != changed]
    assert out["result"]["method"] == "create_commit"

    got = hub.state.files("me/stitched")
    for name, data in files_of(d).items():
        assert got[name] == data, name
    # The copied shards' bytes never crossed the wire: only the changed shard was PUT.
    st = hub.state.stats
    copied_oids = {file_sha256(d / s) for s in copied}
    assert st.uploaded_oids == [file_sha256(d / changed)]
    assert not copied_oids & set(st.uploaded_oids)
    small = sum(len(b) for n, b in files_of(d).items() if not n.endswith(".safetensors"))
    assert st.uploaded == (d / changed).stat().st_size + small + len(got["README.md"])
    # They arrived as cross-repository copies: duplicated from the base, committed by oid.
    dup = {f["sha256"] for p in st.duplicates for f in p["files"]}
    assert dup == copied_oids and all(p["target"]["name"] == "me/stitched" for p in st.duplicates)
    lines = {ln["value"]["path"]: ln for ln in st.commits[-1]["lines"] if ln["key"] == "lfsFile"}
    assert all("size" not in lines[s]["value"] for s in copied)  # a copy references the existing object

    meta, body = card_of(got["README.md"].decode())
    assert meta["base_model"] == "org/verifier" and meta["base_model_relation"] == "finetune"
    assert "stitched" in meta["tags"] and "replaced: 1" in body


def test_dry_run_prints_every_operation_and_changes_nothing(hub, ds, tmp_path):
    hub.state.add_repo("org/verifier", ds)
    stale = {"model-00001-of-00009.safetensors": b"old shard"}
    hub.state.add_repo("me/stitched", ds, files=stale)
    d, changed = stitched_dir(ds, tmp_path)
    before = {k: dict(v.refs) for k, v in hub.state.repos.items()}
    hub.state.stats.reset()
    r = run("push", d, "me/stitched", "--base", "org/verifier@main", "--dry-run", "--card", "overwrite")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    for op, path in [("add", changed), ("add", "README.md"), ("delete", "model-00001-of-00009.safetensors"),
                     ("unchanged", "config.json")]:
        assert any(ln.split()[:1] == [op] and path in ln for ln in lines), (op, path, r.stdout)
    js = json.loads(run("push", d, "me/stitched", "--base", "org/verifier", "--dry-run", "--json",
                        "--card", "overwrite").stdout)
    assert {o["op"] for o in js["operations"]} == {"add", "unchanged", "delete"}  # same shards are "unchanged"
    adds = {o["path"]: o["size"] for o in js["operations"] if o["op"] == "add"}
    assert set(adds) == {changed, "README.md", "stitch-report.json"}
    assert js["bytes_to_upload"] == sum(adds.values())
    assert f"({js['bytes_to_upload']} bytes)" in r.stdout
    # Nothing was written: no commit, no upload, no duplicate.
    assert {k: dict(v.refs) for k, v in hub.state.repos.items()} == before
    assert hub.state.stats.uploaded == 0 and not hub.state.stats.commits and not hub.state.stats.duplicates
    writes = [q for q in hub.state.stats.requests if q[0] in ("POST", "PUT") and "paths-info" not in q[1]]
    assert writes == []


def test_dry_run_into_a_new_repo_shows_copies_and_bytes(hub, ds, tmp_path):
    hub.state.add_repo("org/verifier", ds)
    d, changed = stitched_dir(ds, tmp_path)
    r = run("push", d, "me/new", "--base", "org/verifier", "--dry-run")
    assert r.exit_code == 0, r.output
    records = r.stdout.replace("\n    <- ", " <- ").splitlines()  # a source that did not fit went below its path
    copies = [ln for ln in records if ln.startswith("copy")]
    assert len(copies) == 3 and all(ln.endswith("<- org/verifier@main") for ln in copies)  # the same path there
    assert "repository will be created" in r.stdout and "3 server-side cop(ies)" in r.stdout
    adds = [ln.split()[-1] for ln in r.stdout.splitlines() if ln.startswith("add")]
    assert changed in " ".join(adds) or any(changed in ln for ln in r.stdout.splitlines() if ln.startswith("add"))
    assert "me/new" not in hub.state.repos


def test_invalid_checkpoint_is_refused_unless_forced(hub, ds, tmp_path):
    d = draft_dir(ds, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated: a tensor runs past the end
    r = run("push", d, "me/broken")
    assert r.exit_code == 3, r.output
    assert "refusing to push" in r.output and "past-end" in r.output
    assert "me/broken" not in hub.state.repos
    r = run("push", d, "me/broken", "--force")
    assert r.exit_code == 0, r.output
    _, body = card_of(hub.state.files("me/broken")["README.md"].decode())
    assert "pushed with `--force`" in body and "past-end" in body


def test_card_kept_unless_overwrite(hub, ds, tmp_path):
    d = tmp_path / "own"
    shutil.copytree(ds, d)
    own = (d / "README.md").read_bytes()
    assert run("push", d, "me/own").exit_code == 0
    assert hub.state.files("me/own")["README.md"] == own
    r = run("push", d, "me/own", "--card", "overwrite")
    assert r.exit_code == 0, r.output
    meta, _ = card_of(hub.state.files("me/own")["README.md"].decode())
    assert "speculative-decoding" in meta["tags"]
    assert (d / "README.md").read_bytes() == own  # the input is never modified


def test_create_pr_and_branch(hub, ds, tmp_path):
    d = draft_dir(ds, tmp_path)
    assert run("push", d, "me/draft").exit_code == 0
    main = hub.state.repos["me/draft"].refs["main"]
    (d / "generation_config.json").write_text('{"max_new_tokens": 7}\n')
    r = run("push", d, "me/draft", "--create-pr", "-m", "tweak generation")
    assert r.exit_code == 0, r.output
    assert "pull request:" in r.output and "/discussions/1" in r.output
    repo = hub.state.repos["me/draft"]
    assert repo.refs["main"] == main and "refs/pr/1" in repo.refs
    assert hub.state.files("me/draft", "refs/pr/1")["generation_config.json"] == b'{"max_new_tokens": 7}\n'
    assert repo.messages[repo.refs["refs/pr/1"]] == "tweak generation"
    r = run("push", d, "me/draft", "--revision", "exp")
    assert r.exit_code == 0, r.output
    assert repo.refs["main"] == main and hub.state.files("me/draft", "exp") == hub.state.files("me/draft", "refs/pr/1")


def test_private_repo(hub, ds, tmp_path, monkeypatch):
    d = draft_dir(ds, tmp_path)
    assert run("push", d, "me/secret", "--private").exit_code == 0
    assert hub.state.repos["me/secret"].private
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(Exception, match="not found"):
        Checkpoint.open("hf://me/secret")


@pytest.mark.parametrize("token, code, message", [
    ("hf_bogus_token_xyz", 4, "rejected the token"),
    (READ_TOKEN, 4, "permission denied"),
])
def test_auth_errors_are_explained_and_the_token_never_printed(hub, ds, tmp_path, monkeypatch, token, code, message):
    hub.state.add_repo("me/draft", ds)
    d = draft_dir(ds, tmp_path)
    monkeypatch.setenv("HF_TOKEN", token)
    r = run("push", d, "me/draft")
    assert r.exit_code == code, r.output
    assert message in r.output and "Traceback" not in r.output
    assert token not in r.output and WRITE_TOKEN not in r.output


def test_network_failure_is_reported(hub, ds, tmp_path):
    d = draft_dir(ds, tmp_path)
    hub.stop()
    r = run("push", d, "me/draft")
    assert r.exit_code == 4, r.output
    assert "network failure" in r.output and "Traceback" not in r.output


def test_push_a_draft_extracted_from_the_hub(hub, ds, tmp_path):
    """The whole loop: extract the MTP layers of hf://org/verifier, push the draft, read its card."""
    if not any(c.name == "extract" for c in app.registered_commands):
        pytest.skip("`ckpt extract` is not registered yet")
    sha = hub.state.add_repo("org/verifier", ds)
    out = tmp_path / "draft"
    r = run("extract", "hf://org/verifier", "-o", out)
    assert r.exit_code == 0, r.output
    r = run("push", out, "me/verifier-mtp", "--card", "overwrite")  # extract carried the verifier's README
    assert r.exit_code == 0, r.output
    got = hub.state.files("me/verifier-mtp")
    for name, data in files_of(out).items():
        if name != "README.md":
            assert got[name] == data, name
    meta, body = card_of(got["README.md"].decode())
    assert meta["base_model"] == "org/verifier" and "mtp-draft" in meta["tags"]
    assert sha in body  # the source revision the draft came from


def test_push_a_real_stitch_uploads_only_rewritten_shards(hub, ds, tmp_path):
    """extract -> change one draft tensor -> stitch -> push --base: only the rewritten shards travel."""
    if not all(any(c.name == n for c in app.registered_commands) for n in ("extract", "stitch")):
        pytest.skip("`ckpt extract` / `ckpt stitch` are not registered yet")
    hub.state.add_repo("org/verifier", ds)
    draft = tmp_path / "draft"
    assert run("extract", ds, "-o", draft).exit_code == 0
    shard = sorted(draft.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    key = next(k for k in sorted(tensors) if k.endswith("enorm.weight"))
    tensors[key] = tensors[key] * 2
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "stitched"
    r = run("stitch", draft, ds, "-o", out)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "stitch-report.json").read_text())
    rewritten = set(report["rewritten_shards"])
    assert rewritten
    r = run("push", out, "me/stitched", "--base", "org/verifier", "--card", "overwrite", "--json")
    assert r.exit_code == 0, r.output
    js = json.loads(r.stdout)
    shards = {p.name for p in out.glob("*.safetensors")}
    assert {o["path"] for o in js["operations"] if o["op"] == "copy"} == shards - rewritten
    assert set(hub.state.stats.uploaded_oids) == {file_sha256(out / s) for s in rewritten}
    got = hub.state.files("me/stitched")
    for name, data in files_of(out).items():
        if name != "README.md":
            assert got[name] == data, name
    meta, body = card_of(got["README.md"].decode())
    assert meta["base_model"] == "org/verifier" and meta["base_model_relation"] == "finetune"
    assert "replaced: 1" in body


def test_unfinished_output_is_refused(hub, ds, tmp_path):
    d = draft_dir(ds, tmp_path)
    (d / ".model-00002-of-00004.safetensors.partial").write_bytes(b"half")
    r = run("push", d, "me/draft")
    assert r.exit_code == 3 and "unfinished output" in r.output
    assert "me/draft" not in hub.state.repos


def test_stale_weight_files_are_deleted_other_files_kept(hub, ds, tmp_path):
    hub.state.add_repo("me/draft", ds, files={"model-00001-of-00009.safetensors": b"stale shard",
                                              "notes.txt": b"keep me\n"})
    d = draft_dir(ds, tmp_path)
    r = run("push", d, "me/draft")
    assert r.exit_code == 0, r.output
    got = hub.state.files("me/draft")
    assert "model-00001-of-00009.safetensors" not in got and got["notes.txt"] == b"keep me\n"
    assert {n: b for n, b in got.items() if n in files_of(d)} == files_of(d)


def test_missing_base_is_an_input_error(hub, ds, tmp_path):
    d = draft_dir(ds, tmp_path)
    r = run("push", d, "me/draft", "--base", "org/nope@main")
    assert r.exit_code == 3 and "org/nope not found" in r.output
    r = run("push", d, "me/draft", "--base", "org/nope@")
    assert r.exit_code == 2 and "ORG/REPO" in r.output
    assert "me/draft" not in hub.state.repos


def test_remote_stitch_downloads_only_affected_shards_and_push_copies_the_rest(hub, ds, tmp_path):
    """stitch into hf:// with --link remote, then push: untouched shards never travel either way."""
    hub.state.add_repo("org/verifier", ds)
    draft = tmp_path / "draft"
    assert run("extract", ds, "-o", draft).exit_code == 0
    shard = sorted(draft.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    key = next(k for k in sorted(tensors) if k.endswith("enorm.weight"))
    tensors[key] = tensors[key] * 2
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "stitched"
    hub.state.stats.reset()
    r = run("stitch", draft, "hf://org/verifier", "-o", out, "--link", "remote", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    rewritten, untouched = set(report["rewritten_shards"]), set(report["linked_files"])
    assert rewritten and untouched
    assert not any((out / s).exists() for s in untouched)  # left on the Hub
    by_file = dict(hub.state.stats.served_by_file)
    local = Checkpoint.open(ds)
    from ckpt_tools.model.mtp import open_mtp

    mtp = open_mtp(local)
    for s in untouched:  # its header, and the verifier MTP tensors stitch compares with the draft
        needed = 8 + local.headers[s].header_len + sum(local.tensors[k].nbytes for k in mtp.keys()
                                                      if local.shard_of(k) == s)
        assert by_file.get(s, 0) <= needed, (s, by_file.get(s), needed)
    assert sum(by_file.get(s, 0) for s in untouched) < sum((ds / s).stat().st_size for s in untouched)
    assert run("validate", out).exit_code == 0
    r = run("push", out, "me/stitched", "--card", "overwrite", "--json")  # base taken from the manifest
    assert r.exit_code == 0, r.output
    ops = {o["path"]: o["op"] for o in json.loads(r.stdout)["operations"]}
    assert {p for p, op in ops.items() if op == "copy"} == untouched
    got = hub.state.files("me/stitched")
    for s in untouched:
        assert got[s] == (ds / s).read_bytes()
    for s in rewritten:
        assert got[s] == (out / s).read_bytes()
    assert set(hub.state.stats.uploaded_oids) == {file_sha256(out / s) for s in rewritten}
