"""Proof that a refactor changed no output: every writing verb on a set of fixtures, each output file's sha256.

``python -m benchmarks.identical save REF.json`` on the old commit, ``python -m benchmarks.identical check REF.json``
on the new one (same ``--workdir``, so that paths recorded in manifests agree). JSON files are compared with the
fields that name a run rather than its bytes removed (an input's inode and mtime, which a manifest records to
recognise an unchanged file, and the plan digests folding them in); every other byte must match.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

# differ between two runs that write the same bytes (an input manifest's digest: it records its own inputs' mtimes)
RUN_FIELDS = {"mtime_ns", "ino", "ckpt_manifest.json"}
PLAN_RUN_FIELDS = {"inputs", "plan"}  # the plan digests that fold in the inputs' mtimes


def _fixtures(root: Path) -> dict[str, Path]:
    from ckpt_tools.testing import FixtureOptions, make_checkpoint
    from ckpt_tools.testing.gguf_trunk import write_trunk_gguf
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    made = {
        "glm": make_checkpoint("glm4_moe", root / "glm"),
        "dsv3": make_checkpoint("deepseek_v3", root / "dsv3"),
        "dsv3-fp8": make_checkpoint("deepseek_v3", root / "dsv3-fp8", FixtureOptions(fp8=True)),
        "dsv3-fp8-trunk": make_checkpoint("deepseek_v3", root / "dsv3-fp8-trunk",
                                          FixtureOptions(fp8=True, drop_mtp=True)),
        "hy": make_checkpoint("hy_v3", root / "hy"),
        "mxfp4-trunk": make_quantized_checkpoint("deepseek_v3", root / "mxfp4-trunk",
                                                 QuantOptions("ct-mxfp4", mtp="dropped")),
        "qnext": make_checkpoint("qwen3_next", root / "qnext"),
        "q35moe-fused": make_checkpoint("qwen3_5_moe", root / "q35moe-fused", FixtureOptions(expert_layout="fused")),
        "nvfp4": make_quantized_checkpoint("qwen3_5_moe", root / "nvfp4", QuantOptions("ct-nvfp4")),
        "nvfp4a16-trunk": make_quantized_checkpoint("deepseek_v3", root / "nvfp4a16-trunk",
                                                    QuantOptions("ct-nvfp4a16", mtp="dropped")),
    }
    made["glm.gguf"] = write_trunk_gguf(made["glm"], root / "glm-trunk.gguf")
    made |= {  # the matrix of draft formats, dtypes and quantized verifiers (_matrix)
        "dsv3-pe": make_checkpoint("deepseek_v3", root / "dsv3-pe", FixtureOptions(expert_layout="per-expert")),
        "qwen-moe": make_checkpoint("qwen3_5_moe", root / "qwen-moe"),
        "qwen": make_checkpoint("qwen3_5", root / "qwen"),
        "qwen-fp8": make_checkpoint("qwen3_5", root / "qwen-fp8", FixtureOptions(fp8=True)),
        "dsv3-nvfp4": make_quantized_checkpoint("deepseek_v3", root / "dsv3-nvfp4", QuantOptions("ct-nvfp4")),
        "dsv3-nvfp4-dropped": make_quantized_checkpoint("deepseek_v3", root / "dsv3-nvfp4-dropped",
                                                        QuantOptions("ct-nvfp4", mtp="dropped")),
        "dsv3-fp8b-dropped": make_quantized_checkpoint("deepseek_v3", root / "dsv3-fp8b-dropped",
                                                       QuantOptions("ct-fp8-block", mtp="dropped")),
    }
    return made


def _cases(f: dict[str, Path], out: Path) -> dict[str, Callable[[], object]]:
    import ckpt_tools as c

    def draft(name: str) -> Path:
        return out / name

    return _matrix(f, out) | {
        "extract-native": lambda: c.extract(f["glm"], draft("extract-native")),
        "extract-angelspec": lambda: c.extract(f["hy"], draft("extract-angelspec"), format="angelspec"),
        "extract-nextn": lambda: c.extract(f["dsv3-fp8"], draft("extract-nextn"), format="sglang-nextn"),
        "extract-speculators": lambda: c.extract(f["qnext"], draft("extract-speculators"), format="speculators"),
        "extract-drop-mtp": lambda: c.extract(f["dsv3-fp8"], draft("extract-drop-mtp"), drop_mtp=True),
        "extract-dequant": lambda: c.extract(f["dsv3-fp8"], draft("extract-dequant"), dequant="bf16"),
        "extract-gguf": lambda: c.extract_gguf(f["glm"], draft("extract-gguf"), f["glm.gguf"]),
        "extract-gguf-q8": lambda: c.extract_gguf(f["glm"], draft("extract-gguf-q8"), f["glm.gguf"], gguf_type="q8_0"),
        "stitch": lambda: c.stitch(out / "extract-native", f["glm"], draft("stitch")),
        "stitch-speculators": lambda: c.stitch(out / "extract-speculators", f["qnext"], draft("stitch-speculators")),
        "stitch-fp8": lambda: c.stitch(out / "extract-nextn", f["dsv3-fp8"], draft("stitch-fp8")),
        "graft": lambda: c.graft(f["dsv3"], f["dsv3-fp8-trunk"], draft("graft")),
        "graft-fp8": lambda: c.graft(f["dsv3"], f["dsv3-fp8-trunk"], draft("graft-fp8"), mtp_quant="fp8-block"),
        "graft-nvfp4": lambda: c.graft(f["dsv3"], f["nvfp4a16-trunk"], draft("graft-nvfp4"), mtp_quant="ct-nvfp4"),
        "graft-mxfp4": lambda: c.graft(f["dsv3"], f["mxfp4-trunk"], draft("graft-mxfp4"), mtp_quant="ct-mxfp4"),
        "dequant-fp8": lambda: c.dequant(f["dsv3-fp8"], draft("dequant-fp8")),
        "dequant-nvfp4": lambda: c.dequant(f["nvfp4"], draft("dequant-nvfp4")),
        "fuse-experts": lambda: c.fuse_experts(f["glm"], draft("fuse-experts")),
        "fuse-experts-fp8": lambda: c.fuse_experts(f["dsv3-fp8"], draft("fuse-experts-fp8"), to="stacked"),
        "unfuse-experts": lambda: c.unfuse_experts(f["q35moe-fused"], draft("unfuse-experts")),
        "init-draft": lambda: c.init_draft(f["glm"], draft("init-draft")),
        "init-draft-warm": lambda: c.init_draft(f["dsv3"], draft("init-draft-warm"), from_layer=2,
                                                format="sglang-nextn"),
    }


def _matrix(f: dict[str, Path], out: Path) -> dict[str, Callable[[], object]]:
    """extract and init-draft in every draft format (with and without --dequant), stitched back with each dtype
    policy, into quantized verifiers, and graft into quantized trunks."""
    import ckpt_tools as c
    from ckpt_tools.model.formats import all_formats

    cases: dict[str, Callable[[], object]] = {}
    for name in ("dsv3-pe", "dsv3-fp8", "qwen-moe", "qwen", "qwen-fp8", "dsv3-nvfp4"):
        for fmt in all_formats():
            for deq in (None, "bf16"):
                case = f"m-extract-{name}-{fmt}-{deq}"
                cases[case] = lambda n=name, f_=fmt, d=deq, o=out / case: c.extract(f[n], o, format=f_, dequant=d)
            case = f"m-init-draft-{name}-{fmt}"
            cases[case] = lambda n=name, f_=fmt, o=out / case: c.init_draft(f[n], o, num_layers=1, format=f_)
    for name in ("dsv3-pe", "dsv3-fp8", "qwen-moe", "qwen", "qwen-fp8"):
        for dtype in ("verifier", "draft"):
            case = f"m-stitch-{name}-{dtype}"
            cases[case] = lambda n=name, t=dtype, o=out / case: c.stitch(out / f"m-extract-{n}-native-None", f[n], o,
                                                                         dtype=t)
    cases["m-stitch-nvfp4"] = lambda: c.stitch(out / "m-extract-dsv3-pe-native-None", f["dsv3-nvfp4"],
                                               out / "m-stitch-nvfp4")
    cases["m-stitch-fp8-keep-bf16"] = lambda: c.stitch(out / "m-extract-dsv3-fp8-native-None", f["dsv3-fp8"],
                                                       out / "m-stitch-fp8-keep-bf16", keep_bf16=True)
    for fmt in ("speculators", "angelspec"):
        for name in ("qwen", "qwen-fp8"):
            case = f"m-stitch-{name}-{fmt}"
            cases[case] = lambda n=name, d=out / f"m-extract-qwen-{fmt}-None", o=out / case: c.stitch(d, f[n], o)
    for case, src, trunk, kw in (
            ("m-graft-nvfp4", "dsv3-pe", "dsv3-nvfp4-dropped", {}),
            ("m-graft-nvfp4-bf16", "dsv3-fp8", "dsv3-nvfp4-dropped", {"mtp_dtype": "bf16"}),
            ("m-graft-fp8b", "dsv3-fp8", "dsv3-fp8b-dropped", {"mtp_dtype": "bf16"}),
            ("m-graft-fp8b-quant", "dsv3-pe", "dsv3-fp8b-dropped", {"mtp_quant": "ct-fp8"}),
            ("m-graft-nvfp4-quant", "dsv3-pe", "dsv3-nvfp4-dropped", {"mtp_quant": "ct-nvfp4"})):
        cases[case] = lambda s_=src, t=trunk, k=kw, o=out / case: c.graft(f[s_], f[t], o, **k)
    return cases


def _strip(value: object, key: str = "") -> object:
    if isinstance(value, dict):
        drop = RUN_FIELDS | (PLAN_RUN_FIELDS if key == "plan" else set())
        return {k: _strip(v, k) for k, v in value.items() if k not in drop}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _digest(path: Path) -> str:
    if path.suffix == ".json":
        text = json.dumps(_strip(json.loads(path.read_text())), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def run(workdir: Path) -> dict[str, dict[str, str]]:
    shutil.rmtree(workdir, ignore_errors=True)
    fixtures = _fixtures(workdir / "in")
    out = workdir / "out"
    out.mkdir()
    digests: dict[str, dict[str, str]] = {}
    for name, case in _cases(fixtures, out).items():  # the matrix first: its drafts feed its stitch cases
        try:
            case()
        except Exception as e:  # a case that fails must fail the same way on both commits
            digests[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        digests[name] = {p.relative_to(out / name).as_posix(): _digest(p)
                         for p in sorted((out / name).rglob("*")) if p.is_file()}
    return digests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.identical", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("save", "check"))
    ap.add_argument("ref", type=Path, help="the digests of the reference commit (written by save, read by check)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-identical"))
    args = ap.parse_args(argv)
    digests = run(args.workdir)
    if args.action == "save":
        args.ref.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
        print(f"{len(digests)} cases, {sum(len(d) for d in digests.values())} files -> {args.ref}")
        return 0
    ref = json.loads(args.ref.read_text())
    differ = [name for name in sorted(set(ref) | set(digests)) if ref.get(name) != digests.get(name)]
    for name in differ:
        old, new = ref.get(name, {}), digests.get(name, {})
        files = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        print(f"DIFFERS {name}: {', '.join(files)}")
    print(f"{len(digests)} cases, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
