"""s3:// sources against a real S3-protocol server on 127.0.0.1 (tests/s3server.py), read by the real s3fs.

Bytes are counted on the server: opening, inspecting and validating read headers (plus config and
index) by ranged GETs only; extracting downloads the MTP bytes and little more, and gives the same
draft as extracting the local copy. A 403, a dropped connection, a missing bucket or object end in
a clean error (exit 3, the URL named, nothing marked complete); a missing backend names its extra.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tools.errors import InputError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.io.sources import DOWNLOADS, MissingExtra, coalesce_ranges

from conftest import run_ckpt

sys.path.insert(0, str(Path(__file__).parent))
from s3server import Fault, S3Server  # noqa: E402

SECRET = "s3cr3t-value-that-must-never-appear-7f3a"
BUCKET = "ckpts"


@pytest.fixture(scope="module")
def s3():
    server = S3Server().start()
    with pytest.MonkeyPatch.context() as mp:  # the endpoint and credentials as users set them: the environment
        for k, v in server.env().items():
            mp.setenv(k, v)
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    server.stop()


@pytest.fixture(autouse=True)
def _clean_faults(s3):
    s3.faults.clear()
    yield
    s3.faults.clear()


@pytest.fixture(scope="module")
def ds(make_fixture):
    return make_fixture("deepseek_v3", fp8=True)


_uploaded: set[str] = set()


def upload(s3, d: Path, prefix: str) -> str:
    if prefix not in _uploaded:
        client = s3.client()
        for p in sorted(d.rglob("*")):
            if p.is_file():
                client.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(d)}")
        _uploaded.add(prefix)
    return f"s3://{BUCKET}/{prefix}"


def meta_bytes(d: Path) -> int:
    """What opening must download: every shard header, config.json and the index."""
    local = Checkpoint.open(d)
    side = sum((d / n).stat().st_size for n in ("config.json", "model.safetensors.index.json") if (d / n).exists())
    return local.header_bytes() + side


def mtp_bytes(d: Path) -> int:
    from ckpt_tools.model.mtp import open_mtp

    ckpt = Checkpoint.open(d)
    return sum(ckpt.tensors[s.key].nbytes for s in open_mtp(ckpt).present)


def test_source_layer_imports_nothing_above_it():
    code = ("import sys, ckpt_tools.io.sources, ckpt_tools.io.sources.hf, ckpt_tools.io.hub; "
            "bad = [m for m in sys.modules if m.startswith('ckpt_tools.') and m.split('.')[1] not in "
            "('io', 'errors', 'dtypes')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_coalesce_ranges_merges_small_gaps_only():
    assert coalesce_ranges([(100, 200), (0, 100)]) == [(0, 200)]
    assert coalesce_ranges([(0, 3200), (3300, 6400)]) == [(0, 6400)]  # gap 100 <= 6400/32
    assert coalesce_ranges([(0, 100), (200, 300)]) == [(0, 100), (200, 300)]  # gap too large for 200 bytes
    assert coalesce_ranges([(0, 1 << 30), ((1 << 30) + (2 << 20), 2 << 30)], max_gap=1 << 20) == \
           [(0, 1 << 30), ((1 << 30) + (2 << 20), 2 << 30)]


def test_open_s3_reads_headers_only_and_matches_local(s3, ds):
    url = upload(s3, ds, "ds")
    local = Checkpoint.open(ds)
    s3.stats.reset()
    remote = Checkpoint.open(url)
    assert remote.local_dir is None and remote.root == url
    assert remote.config.raw == local.config.raw and remote.index == local.index
    assert remote.files == local.files and remote.shard_keys == local.shard_keys
    assert {k: (r.dtype, r.shape, r.offset, r.nbytes) for k, r in remote.tensors.items()} == \
           {k: (r.dtype, r.shape, r.offset, r.nbytes) for k, r in local.tensors.items()}
    assert remote.url_of("config.json") == f"{url}/config.json" and remote.fs.protocol[0] == "s3"
    assert s3.stats.downloaded == meta_bytes(ds)
    assert s3.stats.requests["GetObject"] == 0  # ranged reads only, never a whole object
    assert DOWNLOADS.bytes_downloaded >= s3.stats.downloaded


def test_a_long_read_is_split_in_parallel_parts_exactly(s3, ds, monkeypatch):
    from ckpt_tools.io.sources import ranges

    url = upload(s3, ds, "ds")
    remote, local = Checkpoint.open(url), Checkpoint.open(ds)
    key = max(local.tensors, key=lambda k: local.tensors[k].nbytes)
    monkeypatch.setattr(ranges, "PART", 1000)
    monkeypatch.setattr(ranges, "WINDOW", 3)
    s3.stats.reset()
    assert bytes(remote.tensors[key].read()) == bytes(local.tensors[key].read())
    n = local.tensors[key].nbytes
    assert s3.stats.downloaded == n and s3.stats.requests["GetObjectRange"] == -(-n // 1000)


def test_scheduled_ranges_are_coalesced_and_fetched_ahead_within_a_bound(s3, ds, monkeypatch):
    from ckpt_tools.io.sources import ranges

    url = upload(s3, ds, "ds")
    remote, local = Checkpoint.open(url), Checkpoint.open(ds)
    shard = max(local.headers, key=lambda n: len(local.shard_keys[n]))
    keys = local.shard_keys[shard]
    src = remote.sources[shard]
    monkeypatch.setattr(ranges, "PART", 4096)
    monkeypatch.setattr(ranges, "AHEAD_BYTES", 8192)
    refs = [remote.tensors[k] for k in keys]
    src.schedule([(r.offset, r.offset + r.nbytes) for r in refs])
    s3.stats.reset()
    held = 0
    for r in refs:  # what the writer does: each tensor's bytes, in order
        got = b"".join(bytes(c) for c in src.stream(r.offset, r.nbytes))
        assert got == bytes(local.tensors[r.key].read())
        held = max(held, len(src._ahead.fetched))
    span = refs[-1].offset + refs[-1].nbytes - refs[0].offset  # the tensors are contiguous: one range
    assert s3.stats.downloaded == span
    assert s3.stats.requests["GetObjectRange"] == -(-span // 4096) < len(refs)
    assert held <= 8192 // 4096 + 1  # bounded: the parts ahead, plus the one being read


@pytest.mark.parametrize("cmd", ["inspect", "validate"])
def test_inspect_and_validate_read_headers_only(s3, ds, cmd):
    url = upload(s3, ds, "ds")
    s3.stats.reset()
    r = run_ckpt(cmd, url, "--json")
    json.loads(r.stdout)
    assert s3.stats.downloaded == meta_bytes(ds), (s3.stats.downloaded, meta_bytes(ds))
    assert s3.stats.requests["GetObject"] == 0


def test_extract_downloads_the_mtp_and_equals_local(s3, ds, tmp_path):
    url = upload(s3, ds, "ds")
    a, b = tmp_path / "a", tmp_path / "b"
    run_ckpt("extract", ds, "-o", a, "--format", "native")
    s3.stats.reset()
    r = run_ckpt("extract", url, "-o", b, "--format", "native")
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        if n != "ckpt_manifest.json":  # it names its source
            assert (a / n).read_bytes() == (b / n).read_bytes(), n
    carried = sum((ds / f).stat().st_size for f in Checkpoint.open(ds).files if (b / f).exists())
    mtp, meta = mtp_bytes(ds), meta_bytes(ds)
    got = s3.stats.downloaded
    print(f"\nserver-side: extract downloaded {got} bytes; MTP {mtp}, headers+config+index {meta}, carried {carried}; "
          f"requests {dict(s3.stats.requests)}")
    assert mtp <= got <= mtp + meta + carried + 0.05 * mtp
    # coalesced: opening costs 2 ranged GETs per shard + config + index, each carried file one, and the MTP
    # tensors at most one request per shard holding them (they sit together), not one per tensor
    local = Checkpoint.open(ds)
    n_carried = sum(1 for f in local.files if (b / f).exists())
    assert s3.stats.requests["GetObjectRange"] <= 2 * len(local.headers) + 2 + n_carried + len(local.headers)
    assert s3.stats.requests["GetObject"] == 0
    assert "downloaded" in r.output and f"s3://{BUCKET}" in r.output


def _range_get_of_shard(method, path, query, headers):
    return method == "GET" and path.endswith(".safetensors") and "range" in headers


def _refused(out: Path, r, *needles: str) -> None:
    text = r.output + (r.stderr if r.stderr_bytes is not None else "")
    for n in needles:
        assert n in text, text
    assert not (out / "model.safetensors.index.json").exists()
    assert not (out / "ckpt_manifest.json").exists()
    assert not (out / "model.safetensors").exists()


def test_403_is_a_clean_error(s3, ds, tmp_path):
    url = upload(s3, ds, "ds")
    s3.faults.append(Fault(_range_get_of_shard, status=403))
    out = tmp_path / "out"
    r = run_ckpt("extract", url, "-o", out, "--format", "native", code=3)
    _refused(out, r, "permission denied", f"{url}/", "remote-forbidden")


def test_dropped_connection_is_a_clean_error(s3, ds, tmp_path):
    url = upload(s3, ds, "ds")
    Checkpoint.open(url)
    # headers are small: let them through; cut every tensor read after 100 bytes
    s3.faults.append(Fault(lambda m, p, q, h: _range_get_of_shard(m, p, q, h) and
                           int(h["range"].split("=")[1].split("-")[0]) > 8, status=None, after=100))
    out = tmp_path / "out"
    r = run_ckpt("extract", url, "-o", out, "--format", "native", code=3)
    _refused(out, r, f"{url}/")
    assert "network failure" in r.output or "short-read" in r.output, r.output


def test_missing_bucket_prefix_and_object_are_clean_errors(s3, ds, tmp_path):
    for url in ("s3://no-such-bucket/x", f"s3://{BUCKET}/no-such-prefix"):
        with pytest.raises(InputError) as e:
            Checkpoint.open(url)
        assert e.value.exit_code == 3 and e.value.rule == "remote-not-found" and url in str(e.value)
        r = run_ckpt("inspect", url, code=3)
        assert url in r.output
    # an object the index names is gone
    d = tmp_path / "partial"
    import shutil

    shutil.copytree(ds, d)
    shard = sorted(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values())[0]
    (d / shard).unlink()
    url = upload(s3, d, "partial")
    r = run_ckpt("inspect", url, code=3)
    assert "missing-shard" in r.output or "does not exist" in r.output


@pytest.mark.parametrize(("url", "module", "extra"), [("s3://b/p", "s3fs", "s3"), ("gs://b/p", "gcsfs", "gcs"),
                                                      ("az://c/p", "adlfs", "azure")])
def test_a_missing_extra_names_it(monkeypatch, url, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if it were not installed
    with pytest.raises(MissingExtra, match=rf"pip install 'ckpt-tools\[{extra}\]'") as e:
        Checkpoint.open(url)
    assert e.value.exit_code == 2 and e.value.rule == "missing-extra"
    r = run_ckpt("inspect", url, code=2)
    assert f"ckpt-tools[{extra}]" in r.output


def test_credentials_are_never_printed_or_written(s3, ds, tmp_path):
    url = upload(s3, ds, "ds")
    out = tmp_path / "out"
    r = run_ckpt("extract", url, "-o", out, "--format", "native", "--json")
    texts = [r.output] + [p.read_bytes().decode("utf-8", "replace") for p in out.rglob("*") if p.is_file()]
    s3.faults.append(Fault(_range_get_of_shard, status=403))
    r = run_ckpt("extract", url, "-o", tmp_path / "out2", "--format", "native", code=3)
    texts.append(r.output)
    assert len(texts) > 3 and not [t for t in texts if SECRET in t]


def test_benchmark_verb_extract_s3_runs(tmp_path):
    """`python -m benchmarks run --verbs extract-s3` on a tiny checkpoint: both contenders move the MTP bytes."""
    root = Path(__file__).parent.parent
    out = tmp_path / "r.json"
    argv = ["run", "--size", "2MB", "--verbs", "extract-s3", "--runs", "1", "--contenders", "naive", "--no-peers",
            "--json", str(out), "--workdir", str(tmp_path / "wd")]
    r = subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    v = json.loads(out.read_text())["sizes"]["2MB"]["verbs"]["extract-s3"]
    runs = {c: v["contenders"][c]["runs"][0] for c in ("ckpt", "naive")}
    assert all(run["returncode"] == 0 for run in runs.values()), runs
    assert runs["ckpt"]["output_bytes"] > runs["naive"]["output_bytes"] > 0  # + header, config, manifest
    assert v["ratios"]["naive"] > 0
