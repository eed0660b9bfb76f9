"""A shard carried whole (graft, stitch --link hardlink/copy) takes its digest from its input's own manifest.

Only when that manifest provably describes the file as it is now (``known_digests``: size, mtime_ns, inode,
device recorded in ``file_stats``; for a hard link the output's inode is the input's). Each test counts the
whole files the writer hashes (its ``_hash_shard_file``) and runs ``ckpt verify-manifest`` on the output:
a reused digest is still the digest of the output's bytes. An input changed after its manifest was written
(rewritten in place, touched, or replaced by another file with the recorded mtime) is hashed again.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from test_stitch import _perturb

import ckpt_tools.stream.writer as writer

from conftest import run_ckpt as ckpt

MANIFEST = "ckpt_manifest.json"
MTP = "model.layers.3."  # the fixture's MTP layer: stitch compares it, so a change there is not carried whole


def _header(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items()}  # key -> absolute offset


def _flip(data: bytearray, path: Path) -> None:
    """Change one byte of a trunk tensor (not MTP) of the shard read from ``path``."""
    key, at = max(((k, at) for k, at in _header(path).items() if not k.startswith(MTP)), key=lambda kv: kv[1])
    data[at] ^= 0xFF


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """Names of the whole files the writer hashes (in this process: the CLI runs in-process)."""
    names: list[str] = []
    real = writer._hash_shard_file

    def counting(path):
        names.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(writer, "_hash_shard_file", counting)
    return names


@pytest.fixture(scope="module")
def stitched(make_fixture, tmp_path_factory):
    """(draft, ``make()``): ``make()`` writes a fresh verifier written by ckpt (stitch --link copy: shards
    copied whole, and one rewritten), whose manifest has whole-file and per-tensor digests."""
    verifier = make_fixture("deepseek_v3")
    root = tmp_path_factory.mktemp("reuse")
    draft = root / "draft"
    ckpt("extract", verifier, "-o", draft)
    _perturb(draft, ["model.layers.3.hnorm.weight"], np.random.default_rng(3))
    made = []

    def make() -> Path:
        out = root / f"s{len(made)}"
        ckpt("stitch", draft, verifier, "-o", out, "--link", "copy")
        made.append(out)
        return out

    return draft, make


def _manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def _verified(path: Path) -> dict:
    r = json.loads(ckpt("verify-manifest", path, "--json").output)
    assert r["ok"], r
    return r


def test_every_local_shard_records_how_it_landed(stitched):
    _, make = stitched
    src = make()
    m = _manifest(src)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert sorted(m["file_stats"]) == shards
    for name in shards:
        st = os.stat(src / name)
        assert m["file_stats"][name] == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
                                         "dev": st.st_dev}
    whole = {n for n, about in m["files"].items() if "blake3" in about}
    assert whole and whole < set(shards)  # copied ones hashed whole, the rewritten one per tensor
    assert not any("digest_from" in m["files"][n] for n in whole)  # hashed from the landed bytes


@pytest.mark.parametrize("link", ["hardlink", "copy"])
def test_a_ckpt_written_input_is_not_hashed_again(stitched, hashed, tmp_path, link):
    draft, make = stitched
    src = make()
    before = _manifest(src)
    hashed.clear()
    out = tmp_path / "out"
    r = json.loads(ckpt("stitch", draft, src, "-o", out, "--link", link, "--json").output)
    assert r["linked_files"] and not r["rewritten_shards"]
    assert hashed == []  # not one whole file read to be hashed
    m = _manifest(out)
    for name in r["linked_files"]:
        about = m["files"][name]
        assert about["digest_from"] == str(src / MANIFEST)
        if "blake3" in before["files"].get(name, {}):
            assert about["blake3"] == before["files"][name]["blake3"]
        else:  # the input wrote it: its tensors keep their own digests
            assert about["digests"] == "per-tensor" and "blake3" not in about
            keys = _header(out / name)
            assert all(m["tensors"][k]["blake3"] == before["tensors"][k]["blake3"] for k in keys)
        if link == "hardlink":
            assert (out / name).stat().st_ino == (src / name).stat().st_ino
    assert any(a.get("digests") == "per-tensor" for a in m["files"].values())
    rep = _verified(out)
    assert rep["verified"] == rep["listed"]


def _rewrite_in_place(path: Path, recorded: dict) -> None:
    data = bytearray(path.read_bytes())
    _flip(data, path)  # same size, other bytes
    with open(path, "r+b") as f:
        f.write(data)
    if os.stat(path).st_mtime_ns == recorded["mtime_ns"]:  # within the clock tick of the input's own write
        os.utime(path, ns=(recorded["mtime_ns"], recorded["mtime_ns"] + 1))


def _touch(path: Path, recorded: dict) -> None:
    os.utime(path, ns=(recorded["mtime_ns"], recorded["mtime_ns"] + 1_000_000_000))  # bytes as they were


def _replace_keeping_mtime(path: Path, recorded: dict) -> None:
    other = path.with_name("replacement")
    shutil.copyfile(path, other)
    data = bytearray(other.read_bytes())
    _flip(data, path)
    other.write_bytes(bytes(data))
    os.utime(other, ns=(recorded["mtime_ns"], recorded["mtime_ns"]))  # same size, same mtime: another inode
    os.replace(other, path)


@pytest.mark.parametrize("change", [_rewrite_in_place, _touch, _replace_keeping_mtime],
                         ids=["rewritten-in-place", "touched", "replaced-same-mtime"])
@pytest.mark.parametrize("which", ["whole", "per-tensor"])
def test_an_input_changed_after_its_manifest_is_hashed_again(stitched, hashed, tmp_path, change, which):
    draft, make = stitched
    src = make()
    before = _manifest(src)
    whole = [n for n, about in before["files"].items() if "blake3" in about]
    name = whole[0] if which == "whole" else next(n for n in before["file_stats"] if n not in whole)
    change(src / name, before["file_stats"][name])
    st = os.stat(src / name)
    assert st.st_size == before["file_stats"][name]["size"]
    hashed.clear()
    out = tmp_path / "out"
    ckpt("stitch", draft, src, "-o", out, "--link", "hardlink")
    assert hashed == [name]  # that one file, and only it
    m = _manifest(out)
    assert "digest_from" not in m["files"][name] and "blake3" in m["files"][name]  # hashed
    assert all(a["digest_from"] == str(src / MANIFEST) for n, a in m["files"].items() if n != name)
    _verified(out)  # the output's manifest holds what it holds now
    if change is not _touch:  # while the input's own manifest no longer does: trusting it would have been wrong
        r = json.loads(ckpt("verify-manifest", src, "--json", code=None).output)
        assert not r["ok"] and {x["file"] for x in r["mismatches"]} == {name}


def test_a_manifest_of_another_digest_algorithm_is_not_reused(stitched, hashed, tmp_path, monkeypatch):
    draft, make = stitched
    src = make()
    monkeypatch.setenv("CKPT_MANIFEST_DIGEST", "sha256")
    hashed.clear()
    out = tmp_path / "out"
    ckpt("stitch", draft, src, "-o", out, "--link", "hardlink")
    assert sorted(hashed) == sorted(p.name for p in src.glob("*.safetensors"))
    assert all("sha256" in a and "digest_from" not in a for a in _manifest(out)["files"].values())
    _verified(out)


def test_graft_takes_a_ckpt_written_trunks_digests(make_fixture, tmp_path, hashed):
    """The trunk written by ckpt (extract --drop-mtp): graft copies or links its shards without hashing them;
    a trunk without a manifest of ours (a quantizer's output) is hashed."""
    src = make_fixture("deepseek_v3")
    trunk = tmp_path / "trunk"
    ckpt("extract", src, "--drop-mtp", "-o", trunk)
    shards = sorted(p.name for p in trunk.glob("*.safetensors"))
    for link in ("copy", "hardlink"):
        hashed.clear()
        out = tmp_path / f"out-{link}"
        ckpt("graft", src, trunk, "-o", out, "--link", link)
        assert hashed == []
        files = _manifest(out)["files"]
        assert sorted(files) == shards and all(a["digest_from"] == str(trunk / MANIFEST) for a in files.values())
        _verified(out)
    (trunk / MANIFEST).unlink()
    hashed.clear()
    ckpt("graft", src, trunk, "-o", tmp_path / "out-nomanifest", "--link", "hardlink")
    assert sorted(hashed) == shards


def test_a_wrong_digest_in_the_input_manifest_is_caught_by_verify(stitched, tmp_path):
    """Taken over, not re-proven at write time: a forged or corrupted input manifest makes the output's
    manifest wrong, and verify-manifest of the output says so (it rehashes every byte)."""
    draft, make = stitched
    src = make()
    m = _manifest(src)
    name = next(n for n, about in m["files"].items() if "blake3" in about)
    m["files"][name]["blake3"] = "0" * 64
    (src / MANIFEST).write_text(json.dumps(m))
    out = tmp_path / "out"
    ckpt("stitch", draft, src, "-o", out, "--link", "hardlink")
    r = json.loads(ckpt("verify-manifest", out, "--json", code=1).output)
    assert [(x["key"], x["problem"]) for x in r["mismatches"]] == [(name, "file-digest")]
