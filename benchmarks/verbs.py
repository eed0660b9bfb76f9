"""What each benchmarked verb runs, and its floor, naive baseline and peer.

A verb names the input it needs (a synthetic checkpoint variant or a draft), the ckpt
command line, the floor job (the bytes it must move, for ``floor.py``), the naive job
(for ``naive.py``) and optionally a peer command. The verb is benchmarked only when
``ckpt <sub> --help`` works and mentions every option it uses.

A floor is fair when it moves the same bytes with the same durability as the verb: the
tensors and the side files (config, tokenizer files, index) the verb writes, fsynced
when the verb fsyncs (the ``--fsync`` run), and, for stitch, the draft's tensors and the
verifier's MTP tensors read into memory, which stitch must compare before it writes.
Only what ckpt adds for integrity (manifest, resume record, lock) is left out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_tools.io import digest

from . import layout, s3bench
from .peers import Peer, peer_env
from .synth import Sizing, Synthetic, generate

HERE = Path(__file__).resolve().parent


def ckpt_argv() -> list[str]:
    exe = Path(sys.executable).parent / "ckpt"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ckpt_tools"]


@dataclass
class Ctx:
    """One size: its directory, its synthetic inputs (made on demand) and the peer."""

    root: Path
    family: str
    sizing: Sizing
    shards: int
    peer: Peer | None
    log: Callable[[str], None] = print
    synth: dict[str, Synthetic] = field(default_factory=dict)
    drafts: dict[str, Path] = field(default_factory=dict)
    setup_seconds: dict[str, float] = field(default_factory=dict)
    tmpfs: Path | None = None  # where verbs that write into tmpfs put their outputs (made by the runner)

    def variant(self, name: str) -> Synthetic:
        if name not in self.synth:
            import time

            t0 = time.perf_counter()
            self.synth[name] = generate(self.family, self.sizing, name, self.root / f"in-{name}",
                                        shards=self.shards)
            self.setup_seconds[f"generate {name}"] = time.perf_counter() - t0
            self.log(f"  generated {name}: {self.synth[name].total_bytes / 1e9:.2f} GB in "
                     f"{self.setup_seconds[f'generate {name}']:.1f} s")
        return self.synth[name]

    def mtp_extents(self, variant: str) -> list[layout.Extent]:
        syn = self.variant(variant)
        ext = layout.extents(syn.path)
        return [ext[k] for k in syn.mtp_keys]

    def trunk_gguf(self, variant: str) -> Path:
        """A trunk GGUF for ``variant`` (llama.cpp's key-values and a stand-in vocabulary; no tensors: a sidecar
        takes nothing else of its trunk), the --gguf-trunk of extract --format gguf."""
        from ckpt_tools.testing.gguf_trunk import write_trunk_gguf

        path = self.root / f"trunk-{variant}" / "trunk.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_trunk_gguf(self.variant(variant).path, path, tensors=False)
        return path

    def sidecar_extents(self, variant: str) -> list[layout.Extent]:
        """The bytes a GGUF sidecar reads: the MTP tensors and the shared ones (embedding, final norm, head)."""
        from ckpt_tools.io.checkpoint import Checkpoint
        from ckpt_tools.model.gate import require_consistent

        syn = self.variant(variant)
        with Checkpoint.open(syn.path) as ckpt:
            shared = [s.key for s in require_consistent(ckpt).view.resolved.shared.values()]
        ext = layout.extents(syn.path)
        return [ext[k] for k in dict.fromkeys([*syn.mtp_keys, *shared]) if k in ext]

    def native_draft(self) -> Path:
        """A finetuned draft in the verifier's own names: the verifier's values each moved a little
        (stitch refuses unrelated values as divergent), one file, no manifest."""
        if "native" not in self.drafts:
            syn = self.variant("bf16")
            out = self.root / "draft-native"
            generate(self.family, self.sizing, "bf16", out, only=set(syn.mtp_keys), finetuned=True)
            self.drafts["native"] = out
        return self.drafts["native"]

    def speculators_draft(self) -> Path | None:
        """A finetuned speculators draft: the peer's own converter output, minus its all-NaN
        ``verifier_lm_head`` (stitch-mtp rejects raw converter output; training drops it)."""
        if "speculators" in self.drafts:
            return self.drafts["speculators"]
        if self.peer is None or not self.peer.ok:
            return None
        raw, out = self.root / "draft-spec-raw", self.root / "draft-speculators"
        syn = self.variant("bf16")
        cmd = [self.peer.exe("speculators"), "convert", str(syn.path), "--verifier", str(syn.path),
               "--algorithm", "mtp", "--output-path", str(raw)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=peer_env(), timeout=1800)
        if r.returncode != 0:
            self.log(f"  speculators convert failed: {r.stderr[-300:]}")
            return None
        from safetensors import safe_open
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        for p in raw.iterdir():
            if not p.name.endswith(".safetensors"):
                shutil.copyfile(p, out / p.name)
        with safe_open(str(raw / "model.safetensors"), "pt") as f:
            meta = f.metadata()
            sd = {k: f.get_tensor(k) for k in f.keys() if k != "verifier_lm_head.weight"}  # noqa: SIM118
        save_file(sd, str(out / "model.safetensors"), metadata=meta)
        del sd
        shutil.rmtree(raw)
        self.drafts["speculators"] = out
        return out


Job = dict


@dataclass
class Verb:
    name: str
    summary: str
    sub: str  # ckpt subcommand whose --help must work ("" = top level)
    options: tuple[str, ...]  # option strings its --help must mention
    command: Callable[[Ctx, Path], list[str]]  # ckpt arguments
    floor: Callable[[Ctx, Path], Job] | None = None
    naive: Callable[[Ctx, Path], Job] | None = None
    peer: Callable[[Ctx, Path], list[str] | None] | None = None
    peer_label: str = ""
    max_floor_ratio: float | None = None  # target: ckpt wall <= this x fsync'd floor
    judge: str = "marginal"  # the target applies to: "marginal" ratio (two sizes), or "ratio" at the largest size
    library: bool = False  # runs our library directly, not the CLI
    default: bool = True
    env: dict[str, str] = field(default_factory=dict)  # set for the ckpt contender only
    tmpfs: bool = False  # outputs go to tmpfs (TMPFS), not the work directory
    family: str | None = None  # runs on its own checkpoints of this family, at the run's --own-sizes

    def argv(self, ctx: Ctx, out: Path) -> list[str]:
        if self.library:
            return self.command(ctx, out)
        return ckpt_argv() + self.command(ctx, out)

    def out(self, ctx: Ctx, contender: str) -> Path:
        """The output directory of one contender (the same for every run: removed before and after each)."""
        base = ctx.tmpfs if self.tmpfs else ctx.root
        if base is None:
            raise LookupError(f"{self.name} writes into tmpfs, and the run has no tmpfs directory")
        return base / self.name / f"out-{contender}"


def _one_file(out: Path, pieces: list[list], name: str = "model.safetensors") -> Job:
    return {"files": [{"path": str(out / name), "pieces": pieces}]}


def _whole_files(src: Path, out: Path, link: set[str] = frozenset()) -> Job:
    jobs = []
    for p in layout.files(src):
        if p.name in link:
            jobs.append({"path": str(out / p.name), "link": str(p)})
        else:
            jobs.append({"path": str(out / p.name), "pieces": [[str(p), 0, p.stat().st_size]]})
    return {"files": jobs}


def _side_files(src: Path, out: Path, index: bool = False) -> list[dict]:
    """Copies of the files beside the shards (config, tokenizer files; the index when the output has one):
    the verb writes them too, each fsynced."""
    return [{"path": str(out / p.name), "pieces": [[str(p), 0, p.stat().st_size]]} for p in layout.files(src)
            if not p.name.endswith(".safetensors") and (index or p.name != layout.INDEX)]


def _with_side_files(job: Job, src: Path, out: Path, index: bool = False) -> Job:
    job["files"] += _side_files(src, out, index)
    return job


def _mtp_floor(variant: str):
    return lambda ctx, out: _with_side_files(_one_file(out, layout.pieces(ctx.mtp_extents(variant))),
                                             ctx.variant(variant).path, out)


def _trunk_floor(ctx: Ctx, out: Path) -> Job:
    """extract --drop-mtp: each shard's tensors but the MTP ones, into a shard of its own, with sendfile (the
    output is in tmpfs: copy_file_range does not cross filesystems), and the side files with the index."""
    syn = ctx.variant("bf16")
    mtp = set(syn.mtp_keys)
    by_shard: dict[str, list[layout.Extent]] = {}
    for key, e in layout.extents(syn.path).items():
        if key not in mtp:
            by_shard.setdefault(e.file, []).append(e)
    files = [{"path": str(out / Path(f).name), "pieces": layout.pieces(ext)} for f, ext in sorted(by_shard.items())]
    return {"copy": "sendfile", "files": files + _side_files(syn.path, out, index=True)}


def _dequant_floor(ctx: Ctx, out: Path) -> Job:
    """Write as many bytes as the bf16 output has (FP8 weights doubled, scales dropped), copied
    from the FP8 checkpoint's data: "dequant >= 0.5x the copy speed of its bf16 output"."""
    syn = ctx.variant("fp8")
    ext = layout.extents(syn.path)
    n = sum(0 if k.endswith("scale_inv") else 2 * ext[k].length if ext[k].dtype == "F8_E4M3" else ext[k].length
            for k in syn.mtp_keys)
    return _with_side_files(_one_file(out, layout.first_bytes(syn.path, n)), syn.path, out)


def _nvfp4_dequant_floor(ctx: Ctx, out: Path) -> Job:
    """Write as many bytes as the bf16 output has (a packed weight quadrupled, its scales dropped)."""
    syn = ctx.variant("nvfp4")
    ext = layout.extents(syn.path)
    n = sum(4 * ext[k].length if k.endswith(".weight_packed") else
            0 if k.endswith((".weight_scale", ".weight_global_scale")) else ext[k].length for k in syn.mtp_keys)
    return _with_side_files(_one_file(out, layout.first_bytes(syn.path, n)), syn.path, out)


def _dequant_mtp_floor(ctx: Ctx, out: Path) -> Job:
    """dequant --only-mtp --link hardlink: the shards holding no MTP tensor hard-linked, the others' trunk tensors
    copied into a shard each, and as many bytes as the bf16 MTP has (``_dequant_floor``) into one new shard."""
    syn = ctx.variant("fp8")
    mtp, ext = set(syn.mtp_keys), layout.extents(syn.path)
    affected = {Path(ext[k].file).name for k in mtp}
    shards = {p.name for p in layout.files(syn.path) if p.name.endswith(".safetensors")}
    job = _whole_files(syn.path, out, shards - affected)
    job["files"] = [f for f in job["files"] if "link" in f]
    by_shard: dict[str, list[layout.Extent]] = {}
    for key, e in ext.items():
        if key not in mtp and Path(e.file).name in affected:
            by_shard.setdefault(Path(e.file).name, []).append(e)
    job["files"] += [{"path": str(out / name), "pieces": layout.pieces(e)} for name, e in sorted(by_shard.items())]
    n = sum(p[2] for f in _dequant_floor(ctx, out)["files"][:1] for p in f["pieces"])  # the bf16 MTP's bytes
    job["files"] += _one_file(out, layout.first_bytes(syn.path, n), "model-mtp.safetensors")["files"]
    return _with_side_files(job, syn.path, out, index=True)


def _affected_shards(ctx: Ctx, verifier: str = "bf16") -> set[str]:
    return {Path(e.file).name for e in ctx.mtp_extents(verifier)}


def _stitch_floor(draft: str, link: bool, verifier: str = "bf16"):
    """The verifier's files (copied, or hard-linked but for the shards holding MTP tensors), after reading
    what stitch must compare: every tensor of the draft and the verifier's MTP tensors."""
    def job(ctx: Ctx, out: Path) -> Job:
        src = ctx.variant(verifier).path
        keep = {p.name for p in layout.files(src) if p.name.endswith(".safetensors")} - _affected_shards(ctx, verifier)
        d = ctx.native_draft() if draft == "native" else ctx.speculators_draft()
        if d is None:
            raise LookupError("no speculators draft (needs the speculators peer)")
        reads = layout.pieces(list(layout.extents(d).values())) + layout.pieces(ctx.mtp_extents(verifier))
        return {**_whole_files(src, out, keep if link else set()), "reads": reads}

    return job


def _graft_floor(target: str = "nvfp4-nomtp"):
    def job(ctx: Ctx, out: Path) -> Job:
        """Copying what graft writes: the trunk's files whole, and the release's MTP bytes into one new shard."""
        job = _whole_files(ctx.variant(target).path, out)
        job["files"] += _one_file(out, layout.pieces(ctx.mtp_extents("bf16")), "model-mtp.safetensors")["files"]
        return job

    return job


def _naive_extract(variant: str, **opts):
    def job(ctx: Ctx, out: Path) -> Job:
        syn = ctx.variant(variant)
        return {"op": "extract", "src": str(syn.path), "keys": syn.mtp_keys, "out": str(out), **opts}

    return job


def _speculators_convert(ctx: Ctx, out: Path) -> list[str] | None:
    if ctx.peer is None or not ctx.peer.ok:
        return None
    src = str(ctx.variant("bf16").path)
    return [ctx.peer.exe("speculators"), "convert", src, "--verifier", src, "--algorithm", "mtp",
            "--output-path", str(out)]


def _speculators_stitch(ctx: Ctx, out: Path) -> list[str] | None:
    draft = ctx.speculators_draft() if ctx.peer is not None and ctx.peer.ok else None
    if draft is None:
        return None
    return [ctx.peer.exe("speculators"), "stitch-mtp", str(draft), str(ctx.variant("bf16").path),
            "--output-path", str(out)]


def _stitch_cmd(draft: str, *extra: str, verifier: str = "bf16"):
    def cmd(ctx: Ctx, out: Path) -> list[str]:
        d = ctx.native_draft() if draft == "native" else ctx.speculators_draft()
        if d is None:
            raise LookupError("no speculators draft (needs the speculators peer)")
        return ["stitch", str(d), str(ctx.variant(verifier).path), "-o", str(out), *extra]

    return cmd


# extract --drop-mtp into tmpfs, where the disk hides nothing: what hashing every output byte costs. Each entry
# runs the same job with the manifest's digest set through ckpt_tools.io.digest's environment knobs.
TMPFS_FAMILY = "deepseek_v3"
HASHING = {  # verb name suffix -> (ckpt's environment, what it stands for, default verb)
    "": ({}, "BLAKE3 on 2 hash threads beside the copies (now)", True),
    "-sha256-inline": ({"CKPT_MANIFEST_DIGEST": "sha256", "CKPT_HASH_THREADS": "0"},
                       "sha256 per tensor, inline on the writing thread (before the hashing change)", True),
    "-sha256": ({"CKPT_MANIFEST_DIGEST": "sha256"}, "sha256 on 2 hash threads", False),
    "-blake3-inline": ({"CKPT_HASH_THREADS": "0"}, "BLAKE3, inline on the writing thread", False),
}


def one_thread(v: Verb) -> Verb:
    """``v`` decoding on one thread (``--threads 1``): the 1 -> N cores comparison of the decoding verbs."""
    import dataclasses

    return dataclasses.replace(v, name=f"{v.name}-1thread", summary=f"{v.summary}; --threads 1",
                               options=(*v.options, "--threads"),
                               command=lambda ctx, out, c=v.command: [*c(ctx, out), "--threads", "1"], default=False)


def hashing_of(env: dict[str, str]) -> dict:
    """The manifest's digest and hash threads a ckpt run with ``env`` uses (digest's knobs, else its defaults)."""
    return {"algo": env.get(digest.ALGO_ENV) or digest.DEFAULT_ALGO,
            "threads": int(env.get(digest.THREADS_ENV) or digest.DEFAULT_HASH_THREADS)}


def ckpt_env(verb: Verb) -> dict[str, str]:
    """The environment of the ckpt contender: the harness's, without digest knobs it may carry, plus the verb's."""
    env = {k: v for k, v in os.environ.items() if k not in (digest.ALGO_ENV, digest.THREADS_ENV)}
    return {**env, "NO_COLOR": "1", **verb.env}


def _tmpfs_verbs() -> list[Verb]:
    return [Verb(f"extract-drop-mtp-tmpfs{sfx}", f"extract --drop-mtp of a DeepSeek-V3-layout checkpoint into tmpfs; "
                 f"hashing: {what}; floor: sendfile of the same bytes into tmpfs (target <= 1.5x)", "extract",
                 ("--drop-mtp",),
                 lambda ctx, out: ["extract", str(ctx.variant("bf16").path), "-o", str(out), "--drop-mtp"],
                 floor=_trunk_floor, max_floor_ratio=1.5, judge="ratio", default=default, env=env, tmpfs=True,
                 family=TMPFS_FAMILY)
            for sfx, (env, what, default) in HASHING.items()]


VERBS: dict[str, Verb] = {
    v.name: v
    for v in [
        Verb("startup", "`ckpt --help`: interpreter, imports, CLI; the fixed cost of every verb", "", (),
             lambda ctx, out: ["--help"]),
        Verb("extract", "extract the MTP layers, native names (bf16 input)", "extract", (),
             lambda ctx, out: ["extract", str(ctx.variant("bf16").path), "-o", str(out)],
             floor=_mtp_floor("bf16"), naive=_naive_extract("bf16"), max_floor_ratio=1.3),
        Verb("extract-gguf", "extract the MTP layers as a GGUF sidecar for llama.cpp (bf16 input, f16 output: the "
             "same bytes); floor: an fsync'd copy of the MTP tensors and the shared ones (embedding, final norm, "
             "head), the bytes the sidecar holds (target <= 1.2x)", "extract", ("--gguf-trunk",),
             lambda ctx, out: ["extract", str(ctx.variant("bf16").path), "--format", "gguf", "--gguf-trunk",
                               str(ctx.trunk_gguf("bf16")), "-o", str(out)],
             floor=lambda ctx, out: _one_file(out, layout.pieces(ctx.sidecar_extents("bf16")), "sidecar.gguf"),
             max_floor_ratio=1.2),
        Verb("extract-speculators", "extract into the speculators format (experts fused)", "extract",
             ("--format", "speculators"),
             lambda ctx, out: ["extract", str(ctx.variant("bf16").path), "-o", str(out), "--format", "speculators"],
             floor=_mtp_floor("bf16"), naive=_naive_extract("bf16", fuse_experts=True),
             peer=_speculators_convert, peer_label="speculators convert --algorithm mtp", max_floor_ratio=1.3),
        Verb("dequant", "extract with --dequant bf16 from block-FP8 (floor: copying the bf16 output's bytes)",
             "extract", ("--dequant",),
             lambda ctx, out: ["extract", str(ctx.variant("fp8").path), "-o", str(out), "--dequant", "bf16"],
             floor=_dequant_floor, naive=_naive_extract("fp8", dequant=True), max_floor_ratio=2.0),
        Verb("dequant-nvfp4", "extract with --dequant bf16 from compressed-tensors NVFP4 (floor: copying the bf16 "
             "output's bytes)", "extract", ("--dequant",),
             lambda ctx, out: ["extract", str(ctx.variant("nvfp4").path), "-o", str(out), "--dequant", "bf16"],
             floor=_nvfp4_dequant_floor, max_floor_ratio=2.0),
        Verb("dequant-all", "every FP8 weight of the checkpoint to bf16 (`ckpt dequant`, DeepSeek's fp8_cast_bf16 "
             "job); floor: copying the bf16 checkpoint, about as many bytes as the output", "dequant", ("--dtype",),
             lambda ctx, out: ["dequant", str(ctx.variant("fp8").path), "-o", str(out), "--dtype", "bf16"],
             floor=lambda ctx, out: _whole_files(ctx.variant("bf16").path, out), max_floor_ratio=2.0, default=False),
        Verb("dequant-mtp-hardlink", "`ckpt dequant --only-mtp --link hardlink`: the MTP layers' FP8 weights to bf16 "
             "in new shards, the shards without MTP hard-linked (floor: the same links, the trunk tensors of the "
             "shards holding MTP copied, and the bf16 MTP's bytes)", "dequant", ("--only-mtp", "--link", "--dtype"),
             lambda ctx, out: ["dequant", str(ctx.variant("fp8").path), "-o", str(out), "--only-mtp", "--link",
                               "hardlink", "--dtype", "bf16"],
             floor=_dequant_mtp_floor, max_floor_ratio=2.0, default=False),
        Verb("fuse", "fuse-experts on the whole checkpoint, per-expert -> fused", "fuse-experts", ("--to",),
             lambda ctx, out: ["fuse-experts", str(ctx.variant("bf16").path), "-o", str(out)],
             floor=lambda ctx, out: _whole_files(ctx.variant("bf16").path, out),
             naive=lambda ctx, out: {"op": "fuse", "src": str(ctx.variant("bf16").path), "out": str(out)},
             max_floor_ratio=1.3),
        Verb("unfuse", "unfuse-experts on the whole checkpoint, fused -> per-expert", "unfuse-experts", (),
             lambda ctx, out: ["unfuse-experts", str(ctx.variant("fused").path), "-o", str(out)],
             floor=lambda ctx, out: _whole_files(ctx.variant("fused").path, out),
             naive=lambda ctx, out: {"op": "unfuse", "src": str(ctx.variant("fused").path), "out": str(out)},
             max_floor_ratio=1.3, default=False),
        Verb("stitch", "stitch a native finetuned draft into the verifier, --link copy", "stitch", ("--link",),
             _stitch_cmd("native"), floor=_stitch_floor("native", link=False),
             naive=lambda ctx, out: {"op": "stitch", "draft": str(ctx.native_draft()),
                                     "verifier": str(ctx.variant("bf16").path), "out": str(out)},
             max_floor_ratio=1.3),
        Verb("stitch-speculators", "stitch a speculators-format draft (the peer's own input), --link copy",
             "stitch", ("--format", "speculators"), _stitch_cmd("speculators"),
             floor=_stitch_floor("speculators", link=False),
             peer=_speculators_stitch, peer_label="speculators stitch-mtp", max_floor_ratio=1.3),
        Verb("stitch-hardlink", "stitch, untouched shards hard-linked (floor: copying the affected shards)",
             "stitch", ("--link", "hardlink"), _stitch_cmd("native", "--link", "hardlink"),
             floor=_stitch_floor("native", link=True),
             naive=lambda ctx, out: {"op": "stitch", "draft": str(ctx.native_draft()), "link": "hardlink",
                                     "verifier": str(ctx.variant("bf16").path), "out": str(out)},
             max_floor_ratio=1.3),
        Verb("graft", "graft the bf16 release's MTP into its NVFP4 trunk that lost it, --link copy (floor: copying "
             "the trunk's files and the MTP bytes)", "graft", ("--link",),
             lambda ctx, out: ["graft", str(ctx.variant("bf16").path), str(ctx.variant("nvfp4-nomtp").path), "-o",
                               str(out)],
             floor=_graft_floor(), max_floor_ratio=1.3),
        # the same two with inputs written by ckpt (manifest kept): their shards' digests are taken over, not hashed
        Verb("stitch-hardlink-ckpt", "stitch-hardlink into a verifier written by ckpt (its manifest vouches for the "
             "linked shards)", "stitch", ("--link", "hardlink"),
             _stitch_cmd("native", "--link", "hardlink", verifier="bf16@ckpt"),
             floor=_stitch_floor("native", link=True, verifier="bf16@ckpt"), max_floor_ratio=1.3, default=False),
        Verb("graft-ckpt", "graft into an NVFP4 trunk written by ckpt (its manifest vouches for the copied shards)",
             "graft", ("--link",),
             lambda ctx, out: ["graft", str(ctx.variant("bf16").path), str(ctx.variant("nvfp4-nomtp@ckpt").path),
                               "-o", str(out)],
             floor=_graft_floor("nvfp4-nomtp@ckpt"), max_floor_ratio=1.3, default=False),
        Verb("extract-s3", "extract the MTP layers from the checkpoint on a local S3 server (moto, started by the "
             "benchmark); naive: the same byte ranges through one plain s3fs cat_ranges (target <= 1.5x)", "extract",
             (), lambda ctx, out: ["extract", s3bench.serve(ctx, "bf16"), "-o", str(out)],
             naive=s3bench.cat_ranges_job("bf16"), default=False),
        Verb("extract-lib", "extract's job through the library (Checkpoint, open_mtp, writer), no CLI", "", (),
             lambda ctx, out: [sys.executable, str(HERE / "lib_extract.py"), str(ctx.variant("bf16").path), str(out)],
             floor=_mtp_floor("bf16"), naive=_naive_extract("bf16"), library=True, default=False),
        *_tmpfs_verbs(),
    ]
}
DECODING = ("dequant", "dequant-nvfp4", "dequant-all")  # verbs whose decoding runs on --threads
VERBS.update({w.name: w for w in (one_thread(VERBS[n]) for n in DECODING)})


def availability(verb: Verb) -> str | None:
    """None when ``verb`` can run, else why not."""
    if verb.library or not verb.sub:
        return None  # the library, or `ckpt --help` itself (a failure is then recorded as such)
    r = subprocess.run(ckpt_argv() + ([verb.sub] if verb.sub else []) + ["--help"], capture_output=True,
                       text=True, timeout=300, env=dict(peer_env(), COLUMNS="200"))
    if r.returncode != 0:
        return f"`ckpt {verb.sub} --help` exits {r.returncode}: verb not available yet"
    missing = [o for o in verb.options if o not in r.stdout]
    if missing:
        return f"`ckpt {verb.sub} --help` does not mention {', '.join(missing)}"
    return None


def write_job(job: Job, path: Path) -> Path:
    path.write_text(json.dumps(job) + "\n")
    return path
