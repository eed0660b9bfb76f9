"""sha256 of every file stitch, graft, extract (every draft format) and init-draft write on a few fixtures.

Run before and after a refactor that must keep outputs byte-identical, then diff the two listings:
    PYTHONPATH=$PWD python -m benchmarks.outputs_digest WORKDIR > before.txt
The fixtures are built under WORKDIR (the same path both runs: manifests name their inputs).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from ckpt_tools import api
from ckpt_tools.model.formats import all_formats
from ckpt_tools.testing import FixtureOptions, make_checkpoint
from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint


def _fixtures(work: Path) -> dict[str, Path]:
    made = {
        "dsv3": make_checkpoint("deepseek_v3", work / "dsv3", FixtureOptions(expert_layout="per-expert")),
        "dsv3-fp8": make_checkpoint("deepseek_v3", work / "dsv3-fp8", FixtureOptions(fp8=True)),
        "qwen-moe": make_checkpoint("qwen3_5_moe", work / "qwen-moe"),
        "qwen": make_checkpoint("qwen3_5", work / "qwen"),
        "qwen-fp8": make_checkpoint("qwen3_5", work / "qwen-fp8", FixtureOptions(fp8=True)),
        "dsv3-nvfp4-dropped": make_quantized_checkpoint("deepseek_v3", work / "dsv3-nvfp4-dropped",
                                                        QuantOptions("ct-nvfp4", mtp="dropped")),
        "dsv3-fp8b-dropped": make_quantized_checkpoint("deepseek_v3", work / "dsv3-fp8b-dropped",
                                                       QuantOptions("ct-fp8-block", mtp="dropped")),
        "dsv3-nvfp4": make_quantized_checkpoint("deepseek_v3", work / "dsv3-nvfp4", QuantOptions("ct-nvfp4")),
    }
    return made


def _runs(fx: dict[str, Path], out: Path):
    for name in ("dsv3", "dsv3-fp8", "qwen-moe", "qwen", "qwen-fp8", "dsv3-nvfp4"):
        for fmt in all_formats():
            for deq in (None, "bf16"):
                yield f"extract-{name}-{fmt}-{deq}", lambda o, n=name, f=fmt, d=deq: api.extract(
                    fx[n], o, format=f, dequant=d)
            yield f"init-draft-{name}-{fmt}", lambda o, n=name, f=fmt: api.init_draft(fx[n], o, num_layers=1,
                                                                                    format=f)
    yield "extract-dsv3-drop", lambda o: api.extract(fx["dsv3"], o, drop_mtp=True)
    for name in ("dsv3", "dsv3-fp8", "qwen-moe", "qwen", "qwen-fp8"):  # a draft extracted, stitched back
        draft = out / f"extract-{name}-native-None"
        for dtype in ("verifier", "draft"):
            yield f"stitch-{name}-{dtype}", lambda o, n=name, d=draft, t=dtype: api.stitch(d, fx[n], o, dtype=t)
    yield "stitch-dsv3-add", lambda o: api.stitch(out / "extract-dsv3-native-None", out / "extract-dsv3-drop", o,
                                                  mode="add")
    yield "stitch-dsv3-fp8-keep", lambda o: api.stitch(out / "extract-dsv3-fp8-native-None", fx["dsv3-fp8"], o,
                                                       keep_bf16=True)
    yield "stitch-nvfp4", lambda o: api.stitch(out / "extract-dsv3-native-None", fx["dsv3-nvfp4"], o)
    yield "graft-nvfp4", lambda o: api.graft(fx["dsv3"], fx["dsv3-nvfp4-dropped"], o)
    yield "graft-nvfp4-bf16", lambda o: api.graft(fx["dsv3-fp8"], fx["dsv3-nvfp4-dropped"], o, mtp_dtype="bf16")
    yield "graft-fp8b", lambda o: api.graft(fx["dsv3-fp8"], fx["dsv3-fp8b-dropped"], o, mtp_dtype="bf16")
    yield "graft-fp8b-quant", lambda o: api.graft(fx["dsv3"], fx["dsv3-fp8b-dropped"], o, mtp_quant="ct-fp8")
    yield "graft-nvfp4-quant", lambda o: api.graft(fx["dsv3"], fx["dsv3-nvfp4-dropped"], o, mtp_quant="ct-nvfp4")
    for fmt in ("speculators", "angelspec"):
        draft = out / f"extract-qwen-{fmt}-None"
        yield f"stitch-qwen-{fmt}", lambda o, d=draft: api.stitch(d, fx["qwen"], o)
        yield f"stitch-qwen-fp8-{fmt}", lambda o, d=draft: api.stitch(d, fx["qwen-fp8"], o)


def main(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    fx = _fixtures(work / "fx")
    out = work / "out"
    for name, run in _runs(fx, out):
        o = out / name
        try:
            run(o)
        except Exception as e:  # an error is an outcome too: the same one before and after
            print(f"{name} ERROR {type(e).__name__}: {getattr(e, 'rule', '')} {str(e)[:200]}")
            continue
        for p in sorted(o.rglob("*")):
            if p.is_file():
                print(f"{name}/{p.relative_to(o)} {hashlib.sha256(_stable(p)).hexdigest()}")


def _stable(p: Path) -> bytes:
    """The file's bytes; a manifest without what changes from run to run (input files' mtimes, timings)."""
    if p.name != "ckpt_manifest.json":
        return p.read_bytes()

    def strip(o, parent=""):
        if isinstance(o, dict):
            return {k: strip(v, k) for k, v in o.items() if k not in VOLATILE and (parent, k) not in PLAN_INPUTS}
        return [strip(v) for v in o] if isinstance(o, list) else o

    return json.dumps(strip(json.loads(p.read_bytes())), sort_keys=True).encode()


VOLATILE = {"mtime_ns", "file_stats", "side_files"}  # side_files: an input manifest's digest
PLAN_INPUTS = {("plan", "inputs"), ("plan", "plan")}  # digests over the inputs' mtimes


if __name__ == "__main__":
    main(Path(sys.argv[1]))
