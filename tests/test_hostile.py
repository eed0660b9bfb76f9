"""Hostile inputs through the real commands: each ends in a clear error (exit 3, rule named, no traceback),
nothing is written - in particular nothing outside the output directory - and the inputs stay as they were.

Checkpoints (headers, index, config, manifest), user tables via CKPT_TABLES and drafts for stitch are
each broken one way at a time; `ckpt validate` reports the same problems with exit 1 (by design) or 3.
A coverage-guided fuzz run of the header reader (tests/fuzz_header.py, atheris) closes the file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpt_tools.cli import app

runner = CliRunner()
INDEX = "model.safetensors.index.json"


def invoke(args, env=None):
    r = runner.invoke(app, [str(a) for a in args], env=env)
    assert "Traceback" not in r.output, r.output
    assert "internal error" not in r.output, r.output
    return r


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every path under ``root``: size, mtime and (for links) the target - to prove nothing was written."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, os.readlink(p) if p.is_symlink() else None)
    return out


# -- editing helpers ------------------------------------------------------------------------------


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def split(p: Path) -> tuple[dict, bytes]:
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def put(p: Path, header: bytes | dict, rest: bytes, n: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + rest)


def edit_header(fn: Callable[[dict, str], object]) -> Callable[[Path], None]:
    """Apply ``fn(header, first_tensor_key)`` to the first shard; fn may return the raw header bytes."""

    def mutate(d: Path) -> None:
        p = shards(d)[0]
        h, rest = split(p)
        key = next(k for k in h if k != "__metadata__")
        raw = fn(h, key)
        put(p, raw if isinstance(raw, bytes) else h, rest)

    return mutate


def edit_json(name: str, fn: Callable[[dict], object]) -> Callable[[Path], None]:
    """Edit a JSON file in place (``fn`` mutates the object; what it returns is ignored)."""

    def mutate(d: Path) -> None:
        obj = json.loads((d / name).read_text())
        fn(obj)
        (d / name).write_text(json.dumps(obj))

    return mutate


def replace_bytes(name: str, old: bytes, new: bytes) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        data = (d / name).read_bytes()
        assert old in data
        (d / name).write_bytes(data.replace(old, new, 1))

    return mutate


def _first_shard_name(d: Path) -> str:
    return shards(d)[0].name


def _remap(d: Path, name: str, target: str) -> None:
    """Point every key of shard ``name`` at ``target`` in the index."""
    p = d / INDEX
    idx = json.loads(p.read_text())
    idx["weight_map"] = {k: (target if v == name else v) for k, v in idx["weight_map"].items()}
    p.write_text(json.dumps(idx))


def shard_named(target: Callable[[Path], str]) -> Callable[[Path], None]:
    return lambda d: _remap(d, _first_shard_name(d), target(d))


def symlinked_shard(d: Path) -> None:
    outside = d.parent / "outside.safetensors"
    shutil.copy(shards(d)[0], outside)
    os.symlink(outside, d / "evil.safetensors")
    _remap(d, _first_shard_name(d), "evil.safetensors")


def symlinked_config(d: Path) -> None:
    outside = d.parent / "outside-config.json"
    shutil.move(d / "config.json", outside)
    os.symlink(outside, d / "config.json")


def sparse_huge_header(d: Path) -> None:
    """A file that really is 100 MB + a few bytes (sparse: no disk), claiming a 100 MB + 8 header."""
    p = shards(d)[0]
    n = 100_000_008
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", n) + b"{")
        f.truncate(8 + n + 16)


def _by_offset(h: dict) -> list[str]:
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"])


def overlapping(d: Path) -> None:
    """The second tensor (by offset) moved to start where the first does: same size, overlapping bytes."""
    p = shards(d)[0]
    h, rest = split(p)
    a, b = _by_offset(h)[:2]
    size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]
    put(p, h, rest)


def negative_zero_offset(d: Path) -> None:
    """`-0` is an integer to Python, a float to the library (found by the fuzzer)."""
    p = shards(d)[0]
    h, rest = split(p)
    raw = json.dumps({_by_offset(h)[0]: h.pop(_by_offset(h)[0]), **h}).encode()
    assert b'"data_offsets": [0,' in raw
    put(p, raw.replace(b'"data_offsets": [0,', b'"data_offsets": [-0,', 1), rest)


def sparse_huge(name: str) -> Callable[[Path], None]:
    """A 300 MB side file (sparse: no disk): refused by size, never read into memory."""

    def mutate(d: Path) -> None:
        with open(d / name, "r+b") as f:
            f.truncate(300 << 20)

    return mutate


def config_field(field: str, value) -> Callable[[Path], None]:
    return edit_json("config.json", lambda c: c.__setitem__(field, value))


# (case id, mutation, expected text in the error: the rule, and for configs the field)
CASES: list[tuple[str, Callable[[Path], None], list[str]]] = [
    # safetensors headers
    ("header-length-absurd", lambda d: put(shards(d)[0], *split(shards(d)[0]), n=2**63), ["header-too-large"]),
    ("header-length-past-eof", lambda d: put(shards(d)[0], *split(shards(d)[0]), n=10**7), ["header-length"]),
    ("header-100mb", sparse_huge_header, ["header-too-large"]),
    ("offsets-past-eof", lambda d: shards(d)[0].write_bytes(shards(d)[0].read_bytes()[:-16]), ["past-end"]),
    ("trailing-bytes", lambda d: shards(d)[0].write_bytes(shards(d)[0].read_bytes() + b"\0" * 8),
     ["trailing-bytes"]),
    ("overlapping-tensors", overlapping, ["overlap"]),
    ("negative-dim", edit_header(lambda h, k: h[k].__setitem__("shape", [-1, *h[k]["shape"]])), ["bad-shape"]),
    ("nan-dim", edit_header(lambda h, k: json.dumps({**h, k: {**h[k], "shape": [float("nan")]}}).encode()),
     ["bad-shape"]),
    ("float-dim", edit_header(lambda h, k: h[k].__setitem__("shape", [1e300])), ["bad-shape"]),
    ("dim-beyond-u64-with-zero", edit_header(lambda h, k: h[k].__setitem__("shape", [0, 2**70])), ["bad-shape"]),
    ("negative-zero-offset", negative_zero_offset, ["bad-offsets"]),
    ("rank-200000", edit_header(lambda h, k: h[k].__setitem__("shape", [1] * 200_000)), ["bad-shape"]),
    ("numel-overflow", edit_header(lambda h, k: h[k].__setitem__("shape", [2**40, 2**40, 0])), ["size-mismatch"]),
    ("dtype-size-mismatch", edit_header(lambda h, k: h[k].__setitem__("dtype", "F64")), ["size-mismatch"]),
    ("unknown-dtype", edit_header(lambda h, k: h[k].__setitem__("dtype", "Q4_K")), ["unknown-dtype"]),
    ("deeply-nested-json", edit_header(lambda h, k: b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
     ["header-json"]),
    ("huge-json-8mb", edit_header(lambda h, k: json.dumps({**h, "junk": {"dtype": "U8", "shape": [1] * 1024,
                                                                       "data_offsets": [0, 1], "x": "y" * 8_000_000}}
                                                          ).encode()),
     ["tensor-entry"]),
    ("duplicate-key", edit_header(lambda h, k: json.dumps(h).replace("{", '{"' + k + '": ' + json.dumps(h[k]) + ", ",
                                                                     1).encode()), ["duplicate-key"]),
    ("lone-surrogate-key", edit_header(lambda h, k: json.dumps({"\ud800x" if x == k else x: v for x, v in h.items()}
                                                               ).encode()), ["header-json", "surrogate"]),
    ("non-utf8-key", edit_header(lambda h, k: json.dumps(h).encode().replace(k.encode(), b"\xff\xfe" + k.encode(),
                                                                             1)), ["header-json", "UTF-8"]),
    ("metadata-not-string", edit_header(lambda h, k: h.__setitem__("__metadata__", {"format": ["pt"]})),
     ["metadata-not-string"]),
    # the index
    ("shard-absolute", shard_named(lambda d: str(shards(d)[0].resolve())), ["shard-path"]),
    ("shard-dotdot", shard_named(lambda d: f"../{d.name}/{_first_shard_name(d)}"), ["shard-path"]),
    ("shard-symlink-outside", symlinked_shard, ["shard-path", "outside"]),
    ("shard-nul-byte", shard_named(lambda d: "model\0.safetensors"), ["shard-path"]),
    ("shard-devzero-link", lambda d: (os.symlink("/dev/zero", d / "z.safetensors"),
                                      _remap(d, _first_shard_name(d), "z.safetensors")), ["shard-path"]),
    ("shard-missing", shard_named(lambda d: "nope.safetensors"), ["missing-shard"]),
    ("index-not-utf8", replace_bytes(INDEX, b"model", b"mod\xffl"), ["index-json"]),
    ("index-nested", lambda d: (d / INDEX).write_text('{"weight_map":' + "[" * 100_000 + "]" * 100_000 + "}"),
     ["index-json"]),
    ("index-names-not-strings", edit_json(INDEX, lambda i: i["weight_map"].__setitem__("lm_head.weight", 5)),
     ["index-json"]),
    ("index-key-elsewhere", edit_json(INDEX, lambda i: i["weight_map"].__setitem__(
        "lm_head.weight", sorted(set(i["weight_map"].values()))[-1])), ["index-key-missing"]),
    ("config-symlink-outside", symlinked_config, ["shard-path", "config.json"]),
    ("index-300mb", sparse_huge(INDEX), ["index-json", "refusing to read"]),
    ("config-300mb", sparse_huge("config.json"), ["config-json", "refusing to read"]),
    # config.json: wrong types and missing fields name the file and the field
    ("config-layers-string", config_field("num_hidden_layers", "three"),
     ["config-field", "config.json", "num_hidden_layers"]),
    ("config-hidden-null", config_field("hidden_size", None), ["config-field", "config.json", "hidden_size"]),
    ("config-hidden-list", config_field("hidden_size", [64]), ["config-field", "config.json", "hidden_size"]),
    ("config-hidden-float", config_field("hidden_size", 64.5), ["config-field", "config.json", "hidden_size"]),
    ("config-hidden-dict", config_field("hidden_size", {"a": 1}), ["config-field", "config.json", "hidden_size"]),
    ("config-hidden-nan", replace_bytes("config.json", b'"hidden_size": 64', b'"hidden_size": NaN'),
     ["config-field", "config.json", "hidden_size"]),
    ("config-hidden-inf", replace_bytes("config.json", b'"hidden_size": 64', b'"hidden_size": -Infinity'),
     ["config-field", "config.json", "hidden_size"]),
    ("config-mtp-huge", config_field("num_nextn_predict_layers", 10**12),
     ["config-field", "config.json", "num_nextn_predict_layers"]),
    ("config-mtp-negative", config_field("num_nextn_predict_layers", -1),
     ["config-field", "config.json", "num_nextn_predict_layers"]),
    ("config-mtp-bool", config_field("num_nextn_predict_layers", True),
     ["config-field", "config.json", "num_nextn_predict_layers"]),
    ("config-experts-huge", config_field("n_routed_experts", 10**9),
     ["config-field", "config.json", "n_routed_experts"]),
    ("config-missing-field", edit_json("config.json", lambda c: c.pop("hidden_size")),
     ["config-field", "config.json", "hidden_size"]),
    ("config-not-object", lambda d: (d / "config.json").write_text("[1, 2]"), ["config.json", "JSON object"]),
    ("config-not-utf8", replace_bytes("config.json", b"deepseek_v3", b"deepseek\xff"), ["config.json", "JSON"]),
    ("config-nested", lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000), ["config.json"]),
    # a manifest is input too (stitch steers by it)
    ("manifest-garbage", lambda d: (d / "ckpt_manifest.json").write_text("{nope"), ["manifest-json"]),
    ("manifest-nested", lambda d: (d / "ckpt_manifest.json").write_text('{"a":' + "[" * 100_000 + "]" * 100_000
                                                                        + "}"), ["manifest-json"]),
    ("manifest-wrong-types", lambda d: (d / "ckpt_manifest.json").write_text('{"format": ["native"], "layers": "x"}'),
     ["manifest-json", "format"]),
]


@pytest.fixture(scope="module")
def base(make_fixture):
    return make_fixture("deepseek_v3")


@pytest.mark.parametrize(("case", "mutate", "expect"), CASES, ids=[c[0] for c in CASES])
def test_hostile_checkpoint(case, mutate, expect, base, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(base, d)
    mutate(d)
    before = snapshot(tmp_path)
    out = tmp_path / "out"
    for verb in (["inspect", d], ["extract", d, "-o", out]):
        r = invoke(verb)
        flat = " ".join(r.output.split())
        assert r.exit_code == 3, f"{verb[0]}: exit {r.exit_code}: {r.output}"
        for text in expect:
            assert text in flat, f"{verb[0]}: {text!r} not in {r.output}"
        assert not out.exists(), "an output directory after a refused input"
    r = invoke(["validate", d])
    assert r.exit_code in (1, 3), r.output
    assert expect[0] in r.output, r.output
    assert snapshot(tmp_path) == before, "a file was written or changed outside the output directory"


@pytest.fixture(scope="module")
def draft(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile") / "draft"
    assert invoke(["extract", base, "-o", out]).exit_code == 0
    return out


def poison(value: float) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        tensors = load_file(d / "model.safetensors")
        key = sorted(tensors)[0]
        t = tensors[key].clone()
        t.view(-1)[5] = value
        tensors[key] = t
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})

    return mutate


DRAFT_CASES = [
    ("nan", poison(float("nan")), ["nonfinite", "NaN/Inf"]),
    ("inf", poison(float("-inf")), ["nonfinite", "NaN/Inf"]),
    ("bad-header", lambda d: put(d / "model.safetensors", *split(d / "model.safetensors"), n=10**7),
     ["header-length"]),
    ("non-utf8-key", lambda d: put(d / "model.safetensors", json.dumps(split(d / "model.safetensors")[0]).encode()
                                   .replace(b"model.", b"\xc0model.", 1), split(d / "model.safetensors")[1]),
     ["header-json"]),
    ("manifest-layers", lambda d: (d / "ckpt_manifest.json").write_text(
        json.dumps({**json.loads((d / "ckpt_manifest.json").read_text()), "layers": ["zero"]})),
     ["manifest-json", "layers"]),
]


@pytest.mark.parametrize(("case", "mutate", "expect"), DRAFT_CASES, ids=[c[0] for c in DRAFT_CASES])
def test_hostile_draft_for_stitch(case, mutate, expect, base, draft, tmp_path):
    d = tmp_path / "draft"
    shutil.copytree(draft, d)
    mutate(d)
    verifier = tmp_path / "verifier"
    shutil.copytree(base, verifier)
    before = snapshot(tmp_path)
    out = tmp_path / "out"
    r = invoke(["stitch", d, verifier, "-o", out])
    flat = " ".join(r.output.split())
    assert r.exit_code == 3, r.output
    for text in expect:
        assert text in flat, r.output
    assert not out.exists()
    assert snapshot(tmp_path) == before


SHIPPED = Path(__file__).resolve().parent.parent / "mappings" / "architectures" / "deepseek_v3.yaml"


def evil_table(expr: str) -> str:
    text = SHIPPED.read_text().replace("family: deepseek_v3", "family: evil")
    return text.replace('shape: [hidden, "2 * hidden"]', f"shape: [hidden, {json.dumps(expr)}]")


TABLE_CASES = [
    ("schema", "family: bad\ntitle: x\ndetect: {architectures: [Foo]}\nconfig: {a: 5}\n", ["bad.yaml", "field"]),
    ("python-tag", "!!python/object/apply:os.system ['echo pwned > pwned.txt']\n", ["bad.yaml", "YAML"]),
    ("not-utf8", b"family: \xff\xfe\n", ["bad.yaml", "UTF-8"]),
    ("call", evil_table("__import__('os').system('echo pwned > pwned.txt')"), ["evil.yaml", "may be called"]),
    ("attribute", evil_table("hidden.__class__.__mro__"), ["evil.yaml", "Attribute"]),
]


@pytest.mark.parametrize(("case", "content", "expect"), TABLE_CASES, ids=[c[0] for c in TABLE_CASES])
def test_hostile_user_table(case, content, expect, base, tmp_path, monkeypatch):
    tables = tmp_path / "tables"
    tables.mkdir()
    name = "evil.yaml" if "evil" in expect[0] else "bad.yaml"
    (tables / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    r = invoke(["inspect", base], env={"CKPT_TABLES": str(tables)})
    flat = " ".join(r.output.split())
    assert r.exit_code == 3, r.output
    for text in expect:
        assert text in flat, r.output
    assert not (tmp_path / "pwned.txt").exists()
    assert snapshot(tmp_path) == before


# -- coverage-guided fuzzing of the header reader ----------------------------------------------------

FUZZ_SECONDS = 10


def test_coverage_guided_header_fuzz(tmp_path):
    """atheris (libFuzzer) on read_header for a bounded time, from a seed corpus: any exception other than
    HeaderError, or an accepted file the safetensors library refuses, fails with the input that did it."""
    pytest.importorskip("atheris")
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import fuzz_header
    finally:
        sys.path.pop(0)
    seeds, corpus, crashes = tmp_path / "seeds", tmp_path / "corpus", tmp_path / "crashes"
    corpus.mkdir()
    crashes.mkdir()
    fuzz_header.seed_corpus(seeds)
    fuzz_header.write_dict(tmp_path / "dict")
    cmd = [sys.executable, fuzz_header.__file__, f"-max_total_time={FUZZ_SECONDS}", f"-dict={tmp_path / 'dict'}",
           f"-artifact_prefix={crashes}/", "-timeout=5", "-rss_limit_mb=2048", "-seed=1", str(corpus), str(seeds)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=FUZZ_SECONDS + 60)
    found = sorted(crashes.iterdir())
    detail = "\n".join(f"{p.name}: {p.read_bytes()[:300]!r}" for p in found)
    assert r.returncode == 0 and not found, f"fuzzer found a failing input:\n{detail}\n{r.stderr[-3000:]}"
    runs = [line for line in r.stderr.splitlines() if line.startswith("Done ")]
    assert runs and int(runs[0].split()[1]) > 1000, r.stderr[-2000:]


def test_special_files_are_never_carried(base, tmp_path):
    """A FIFO (or device) among a checkpoint's files would block a copy for ever: only regular files are carried."""
    import threading

    d = tmp_path / "ck"
    shutil.copytree(base, d)
    fifo = d / "tokenizer.json"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    result: list = []
    worker = threading.Thread(target=lambda: result.append(invoke(["extract", d, "-o", out])), daemon=True)
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():  # unblock the reader before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout=10)
        pytest.fail("extract blocked on a FIFO in the checkpoint")
    assert result[0].exit_code == 0, result[0].output
    assert not (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").is_file()
