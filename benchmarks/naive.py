"""The naive baseline: the job done the way most scripts do it.

``python naive.py JOB.json``: whole shards are loaded with ``safetensors.torch.load_file``,
tensors are changed with torch, results are written with ``save_file``. Independent of
ckpt_tools on purpose (nothing of ours is imported), so it also serves as a second
opinion on what each job has to produce.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

PER_EXPERT = re.compile(r"^(?P<p>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(r"^(?P<p>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
INDEX = "model.safetensors.index.json"


def weight_map(d: Path) -> dict[str, str]:
    if (d / INDEX).exists():
        return json.loads((d / INDEX).read_text())["weight_map"]
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")  # noqa: SIM118


def metadata(path: Path) -> dict | None:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def carry_files(src: Path, out: Path) -> None:
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != INDEX:
            shutil.copyfile(p, out / p.name)


def dequant(sd: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in sd.items():
        if k.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = sd[k[: -len("weight")] + "weight_scale_inv"] if k.endswith(".weight") else sd[k + "_scale_inv"]
            rows, cols = t.shape[-2:]
            s = s.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
            out[k] = (t.float() * s).to(torch.bfloat16)
        else:
            out[k] = t
    return out


def fuse(sd: dict[str, torch.Tensor], counts: dict[str, int], pending: dict) -> dict[str, torch.Tensor]:
    """Stack complete per-expert groups into gate_up_proj / down_proj; keep incomplete ones pending."""
    out = {}
    for k, t in sd.items():
        m = PER_EXPERT.match(k)
        if m:
            pending.setdefault(m["p"], {})[(int(m["e"]), m["proj"])] = t
        else:
            out[k] = t
    for p in list(pending):
        parts = pending[p]
        if len(parts) == 3 * counts[p]:
            n = counts[p]
            out[p + ".gate_up_proj"] = torch.stack(
                [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], 0) for e in range(n)])
            out[p + ".down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
            del pending[p]
    return out


def unfuse(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in sd.items():
        m = FUSED.match(k)
        if not m:
            out[k] = t
            continue
        for e in range(t.shape[0]):
            if m["proj"] == "gate_up_proj":
                half = t.shape[1] // 2
                out[f"{m['p']}.{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{m['p']}.{e}.up_proj.weight"] = t[e, half:].contiguous()
            else:
                out[f"{m['p']}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def expert_counts(wm: dict[str, str]) -> dict[str, int]:
    counts: dict[str, set] = {}
    for k in wm:
        m = PER_EXPERT.match(k)
        if m:
            counts.setdefault(m["p"], set()).add(int(m["e"]))
    return {p: len(es) for p, es in counts.items()}


def extract(job: dict) -> None:
    src, out = Path(job["src"]), Path(job["out"])
    out.mkdir(parents=True)
    wm = weight_map(src)
    by_shard: dict[str, list[str]] = {}
    for k in job["keys"]:
        by_shard.setdefault(wm[k], []).append(k)
    picked: dict[str, torch.Tensor] = {}
    for shard, keys in by_shard.items():
        sd = load_file(str(src / shard))
        picked.update({k: sd[k] for k in keys})
        del sd
    if job.get("dequant"):
        picked = dequant(picked, tuple(job.get("block", (128, 128))))
    if job.get("fuse_experts"):
        picked = fuse(picked, expert_counts({k: "" for k in picked}), {})
    save_file(picked, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(src / "config.json", out / "config.json")


def rewrite_shards(job: dict, transform) -> None:
    """fuse / unfuse the whole checkpoint, shard by shard, keeping shard names."""
    src, out = Path(job["src"]), Path(job["out"])
    out.mkdir(parents=True)
    wm = weight_map(src)
    new_map: dict[str, str] = {}
    total = 0
    for shard in sorted(set(wm.values())):
        sd = transform(load_file(str(src / shard)))
        save_file(sd, str(out / shard), metadata=metadata(src / shard))
        for k, t in sd.items():
            new_map[k] = shard
            total += t.numel() * t.element_size()
        del sd
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(new_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    carry_files(src, out)


def stitch(job: dict) -> None:
    draft, verifier, out = Path(job["draft"]), Path(job["verifier"]), Path(job["out"])
    out.mkdir(parents=True)
    new: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map(draft).values())):
        new.update(load_file(str(draft / shard)))
    vmap = weight_map(verifier)
    affected: dict[str, list[str]] = {}
    for k in new:
        affected.setdefault(vmap[k], []).append(k)
    for p in sorted(verifier.iterdir()):
        if p.name in affected:
            sd = load_file(str(p))
            sd.update({k: new[k] for k in affected[p.name]})
            save_file(sd, str(out / p.name), metadata=metadata(p))
            del sd
        elif job.get("link") == "hardlink" and p.name.endswith(".safetensors"):
            os.link(p, out / p.name)
        elif p.is_file():
            shutil.copyfile(p, out / p.name)


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    op = job["op"]
    if op == "extract":
        extract(job)
    elif op == "fuse":
        counts = expert_counts(weight_map(Path(job["src"])))
        pending: dict = {}
        rewrite_shards(job, lambda sd: fuse(sd, counts, pending))
        if pending:
            raise SystemExit(f"incomplete expert groups: {sorted(pending)}")
    elif op == "unfuse":
        rewrite_shards(job, unfuse)
    elif op == "stitch":
        stitch(job)
    else:
        raise SystemExit(f"unknown op {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
