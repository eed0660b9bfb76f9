"""Run the benchmark: per size, generate inputs, then alternate verb / floor / naive / peer runs.

Every contender is a child process measured by ``measure.run``. Runs alternate
(run 1 of every contender of every verb, then run 2, ...), and the order of the
contenders rotates from one run to the next, so a slow minute on a shared machine
hits all of them. Before each run the output directory is removed and ``sync()`` is
called, so no run pays for the previous one's write-back.

Verbs with a family of their own (the tmpfs ones) run in rounds of their own, one per
``own_sizes`` entry, labelled e.g. ``3GB deepseek_v3``; their outputs go to ``TMPFS``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import report
from .layout import tree_bytes
from .measure import run as measure
from .peers import Peer, ensure_speculators, peer_env
from .synth import solve
from .verbs import VERBS, Ctx, Verb, availability, ckpt_env, hashing_of, write_job

HERE = Path(__file__).resolve().parent
TMPFS = Path("/dev/shm")
TMPFS_SLACK = 256 * 10**6  # beyond the checkpoint's size: manifest, index, a run's leftovers
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):] or "B"
    if unit not in UNITS:
        raise ValueError(f"size {text!r}: unit must be one of B, KB, MB, GB, KiB, MiB, GiB")
    return int(float(num) * UNITS[unit])


@dataclass
class Round:
    """One checkpoint size of one family, and the verbs that run on it."""

    label: str
    family: str
    target: int
    verbs: list[Verb]

    @property
    def dirname(self) -> str:
        return "size-" + self.label.replace(" ", "-")


def compile_package() -> None:
    """Byte-compile ckpt_tools first, as pip does when it installs the wheel: a user's start-up never
    compiles our sources, so a benchmark that did (PYTHONDONTWRITEBYTECODE set) would overstate it."""
    import compileall

    import ckpt_tools

    compileall.compile_dir(Path(ckpt_tools.__file__).parent, quiet=1)


def rounds(sizes: list[str], verbs: list[Verb], family: str, own_sizes: list[str]) -> list[Round]:
    """The run's sizes for the verbs on ``family``; ``own_sizes`` for each family a verb brings."""
    plain = [v for v in verbs if v.family is None]
    out = [Round(lb, family, parse_size(lb), plain) for lb in sizes] if plain else []
    for fam in dict.fromkeys(v.family for v in verbs if v.family):
        own = [v for v in verbs if v.family == fam]
        out += [Round(f"{lb} {fam}", fam, parse_size(lb), own) for lb in own_sizes]
    return out


def tmpfs_room(need: int, where: Path = TMPFS) -> str | None:
    """None when ``where`` is a tmpfs with ``need`` bytes free, else why a tmpfs verb cannot run."""
    if not where.is_dir():
        return f"{where} does not exist"
    fs = report.mount_of(where)[2]
    if fs != "tmpfs":
        return f"{where} is {fs or 'not a mount point'}, not tmpfs"
    free = shutil.disk_usage(where).free
    if free < need:
        return f"{where} has {free / 1e9:.2f} GB free; one output at a time needs {need / 1e9:.2f} GB"
    return None


def _argvs(verb: Verb, ctx: Ctx, vdir: Path, peer_ok: bool, want: set[str]) -> dict[str, list[str]]:
    """The command line of each contender (the floor and naive jobs written to files)."""
    py = sys.executable
    argvs = {"ckpt": verb.argv(ctx, verb.out(ctx, "ckpt"))}
    if verb.floor and "floor" in want:
        job = write_job(verb.floor(ctx, verb.out(ctx, "floor")), vdir / "floor.json")
        raw = write_job(verb.floor(ctx, verb.out(ctx, "floor-raw")), vdir / "floor-raw.json")
        argvs["floor"] = [py, "-S", str(HERE / "floor.py"), str(job), "--fsync"]
        argvs["floor-raw"] = [py, "-S", str(HERE / "floor.py"), str(raw)]
    if verb.naive and "naive" in want:
        spec = verb.naive(ctx, verb.out(ctx, "naive"))
        job = write_job(spec, vdir / "naive.json")
        # extract-s3's baseline is plain s3fs in a lean process (naive.py would import torch first)
        script = "s3bench.py" if spec.get("op") == "s3-cat-ranges" else "naive.py"
        argvs["naive"] = [py, str(HERE / script), str(job)]
    if verb.peer and peer_ok and "peer" in want:
        cmd = verb.peer(ctx, verb.out(ctx, "peer"))
        if cmd:
            argvs["peer"] = cmd
    return argvs


def run(sizes: list[str], verb_names: list[str], *, runs: int = 3, workdir: Path, family: str = "qwen3_next",
        shards: int = 8, peers: bool = True, retry_peers: bool = False, keep: bool = False,
        timeout: float = 900.0, contenders: set[str] | None = None, log=print, save=None,
        own_sizes: list[str] = ("1GB", "3GB")) -> dict:
    """Benchmark ``verb_names`` at each size (verbs with a family of their own at ``own_sizes``);
    ``save(results)`` is called after every round of runs, so that an interrupted benchmark still
    leaves its figures so far."""
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    verbs = [VERBS[n] for n in verb_names]
    compile_package()
    results: dict = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks " + " ".join(sys.argv[1:]),
        "runs": runs,
        "family": family,
        "verbs": verb_names,
        "machine": report.machine_info(workdir),
        "sizes": {},
        "notes": [],
    }
    want = set(contenders or ("floor", "naive", "peer"))
    peers = peers and "peer" in want
    skip: dict[str, str] = {}
    for v in verbs:
        why = availability(v)
        if why:
            skip[v.name] = why
            log(f"skip {v.name}: {why}")
    peer: Peer | None = None
    if any(v.peer for v in verbs if v.name not in skip):
        if peers:
            peer = ensure_speculators(workdir, retry=retry_peers, log=log)
            if not peer.ok:
                log(f"peer speculators unavailable: {peer.reason}")
                results["notes"].append(f"speculators peer skipped: {peer.reason}")
            else:
                results["notes"].append(f"peer: {peer.version}, in its own venv under the work directory")
        else:
            results["notes"].append("peers not run (--no-peers, or --contenders without peer)")
    for rnd in rounds(sizes, verbs, family, list(own_sizes)):
        log(f"== {rnd.label}")
        root = workdir / rnd.dirname
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        sizing = solve(rnd.family, rnd.target)
        ctx = Ctx(root, rnd.family, sizing, shards, peer, log)
        here = dict(skip)
        if any(v.tmpfs for v in rnd.verbs):
            why = tmpfs_room(sizing.total + TMPFS_SLACK)
            if why:
                here.update({v.name: why for v in rnd.verbs if v.tmpfs and v.name not in skip})
                log(f"skip the tmpfs verbs: {why}")
            else:
                ctx.tmpfs = TMPFS / f"ckpt-bench-{os.getpid()}" / rnd.dirname
        try:
            _run_round(rnd, ctx, here, results, runs=runs, want=want, peer=peer, timeout=timeout, log=log, save=save)
        finally:
            if ctx.tmpfs is not None:
                shutil.rmtree(ctx.tmpfs.parent, ignore_errors=True)  # tmpfs is memory: never left behind
            if not keep:
                shutil.rmtree(root, ignore_errors=True)
    results["machine"]["load_avg_end"] = list(os.getloadavg())
    results["finished"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    return results


def _run_round(rnd: Round, ctx: Ctx, skip: dict[str, str], results: dict, *, runs: int, want: set[str],
               peer: Peer | None, timeout: float, log, save) -> None:
    size_res: dict = {"verbs": {}}
    results["sizes"][rnd.label] = size_res
    plans: dict[str, dict[str, list[str]]] = {}
    for v in rnd.verbs:
        if v.name in skip:
            size_res["verbs"][v.name] = {"skipped": skip[v.name]}
            continue
        vdir = ctx.root / v.name
        vdir.mkdir()
        try:
            plans[v.name] = _argvs(v, ctx, vdir, peer is not None and peer.ok, want)
        except LookupError as e:
            size_res["verbs"][v.name] = {"skipped": str(e)}
            continue
        size_res["verbs"][v.name] = {
            "summary": v.summary,
            "max_floor_ratio": v.max_floor_ratio,
            "judge": v.judge,
            "peer": v.peer_label if "peer" in plans[v.name] else None,
            **({"hashing": hashing_of(v.env)} if v.tmpfs else {}),
            "contenders": {c: {"argv": a, "runs": []} for c, a in plans[v.name].items()},
        }
    if ctx.synth:
        syn = ctx.synth.get("bf16") or next(iter(ctx.synth.values()))
        size_res["checkpoint"] = {**syn.to_json(), "mtp_share": ctx.sizing.mtp_share,
                                  "variants": {k: s.total_bytes for k, s in ctx.synth.items()}}
    size_res["setup_seconds"] = ctx.setup_seconds
    verbs = {v.name: v for v in rnd.verbs}
    failed: set[tuple[str, str]] = set()
    for r in range(runs):
        for name, plan in plans.items():
            v = verbs[name]
            names = list(plan)
            k = r % len(names)
            for c in names[k:] + names[:k]:
                if (name, c) in failed:
                    continue
                out = v.out(ctx, c)
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                env = peer_env() if c == "peer" else ckpt_env(v) if c == "ckpt" else dict(os.environ, NO_COLOR="1")
                s = measure(plan[c], log=ctx.root / name / f"{c}-{r}.log", env=env, timeout=timeout)
                entry = s.to_json()
                entry["output_bytes"] = tree_bytes(out)
                size_res["verbs"][name]["contenders"][c]["runs"].append(entry)
                status = "ok" if s.returncode == 0 else f"FAILED rc={s.returncode}"
                log(f"  run {r + 1}/{runs} {name:<20} {c:<9} {s.wall:7.2f} s  cpu {s.cpu:6.2f} s  "
                    f"rss {s.maxrss / 1e6:6.0f} MB  {status}")
                if s.returncode != 0:
                    failed.add((name, c))
                    size_res["verbs"][name]["contenders"][c]["error"] = s.stderr_tail[-1500:]
                    log("    " + s.stderr_tail.strip().replace("\n", "\n    ")[-800:])
                shutil.rmtree(out, ignore_errors=True)
        _summarize(size_res)
        results["machine"]["load_avg_end"] = list(os.getloadavg())
        if save is not None:
            save(results)
    if ctx.tmpfs is not None and any(verbs[n].tmpfs for n in plans):
        size_res["rates"] = per_core_rates(ctx, log)
        if save is not None:
            save(results)


def per_core_rates(ctx: Ctx, log) -> dict:
    """Copy and hash rates of one core on this round's input (``hashrate.py`` in a child process)."""
    shards = [str(p) for p in ctx.variant("bf16").path.glob("*.safetensors")]
    r = subprocess.run([sys.executable, str(HERE / "hashrate.py"), str(ctx.tmpfs), *sorted(shards)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        log(f"  per-core rates failed: {r.stderr[-500:]}")
        return {"error": r.stderr[-1500:]}
    rates = json.loads(r.stdout)
    log("  per-core rates (GB/s): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in rates["bytes_per_s"].items()))
    return rates


def _summarize(size_res: dict) -> None:
    for vres in size_res["verbs"].values():
        if vres.get("skipped"):
            continue
        cs = vres["contenders"]
        for c in cs.values():
            c["stats"] = report.stats(c["runs"])
        vres["ratios"] = {other: report.ratio(cs.get("ckpt"), cs.get(other))
                          for other in ("floor", "floor-raw", "naive", "peer") if other in cs}


def default_verbs() -> list[str]:
    return [n for n, v in VERBS.items() if v.default]

