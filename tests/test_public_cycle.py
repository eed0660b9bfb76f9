"""A training script's whole cycle through the public names only: extract, finetune in memory, stitch from
the state dict, diff, validate. Nothing here imports below ``ckpt_tools``'s top level."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# the cycle runs in a fresh interpreter, so an import of a non-public module anywhere in it would show
CYCLE = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    import ckpt_tools
    from ckpt_tools import CheckFailed, diff, extract, stitch, validate

    verifier, work = Path(sys.argv[1]), Path(sys.argv[2])
    draft_dir = work / "draft"
    extracted = extract(verifier, draft_dir, format=sys.argv[3])
    state = load_file(draft_dir / "model.safetensors")
    norm = next(k for k in state if k.endswith("norm.weight"))
    state[norm] = state[norm] + 0.01                        # the "finetune"
    stitched = stitch(state, verifier, work / "stitched", arch=sys.argv[4])
    try:
        diff(verifier, work / "stitched")
        raise SystemExit("diff found no difference after a finetune")
    except CheckFailed as e:
        changed = sorted(t["key"] for t in e.report.to_json()["tensors"] if t["status"] != "unchanged")
    checked = validate(work / "stitched")
    replaced = sorted(t["key"] for t in stitched.to_json()["tensors"] if t["status"] == "replaced")
    print(json.dumps({"extracted": extracted.to_json()["files"], "replaced": replaced,
                      "totals": stitched.to_json()["totals"], "changed": changed, "valid": checked.to_json()["ok"],
                      "modules": sorted(m for m in sys.modules if m.startswith("ckpt_tools"))}))
""")


@pytest.mark.parametrize("fmt", ["native", "speculators"])
def test_extract_finetune_in_memory_stitch_diff_validate(make_fixture, tmp_path, fmt):
    verifier = make_fixture("qwen3_next")
    run = subprocess.run([sys.executable, "-c", CYCLE, str(verifier), str(tmp_path), fmt, "qwen3_next"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["valid"] is True
    assert out["extracted"]  # the draft was written
    # the one tensor finetuned is the one tensor stitch replaced and diff sees changed (in verifier names)
    assert len(out["replaced"]) == 1 and out["changed"] == out["replaced"]
    assert out["totals"]["replaced"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "stitched"]  # nothing staged for the state dict
    # only the public surface was imported by hand; what loaded below it is the verbs' own business
    assert "ckpt_tools.cli" not in out["modules"]  # the library path never goes through the CLI
