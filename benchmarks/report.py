"""Statistics, machine description, and the results tables (rich and Markdown)."""

from __future__ import annotations

import os
import platform
import shutil
import statistics
from pathlib import Path

RSS_LIMIT = 300 * 10**6
RSS_FLAT = 1.10  # flat: the largest size's peak RSS within 10% (or 20 MB) of the smallest's
RSS_FLAT_ABS = 20 * 10**6
JUDGED_FROM = 4 * 10**9  # speed targets apply from this checkpoint size (the largest size when all are smaller)
FIELDS = ("wall", "cpu", "maxrss", "rchar", "wchar", "write_bytes")
CONTENDERS = ("ckpt", "floor", "floor-raw", "naive", "peer")


def stats(runs: list[dict]) -> dict:
    ok = [r for r in runs if r.get("returncode") == 0]
    out: dict = {"n": len(ok)}
    for f in FIELDS:
        vals = [r[f] for r in ok]
        if vals:
            out[f] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def ratio(a: dict | None, b: dict | None, field: str = "wall") -> float | None:
    try:
        return a["stats"][field]["median"] / b["stats"][field]["median"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def mount_of(path: Path) -> tuple[str, str, str]:
    """(device, mount point, filesystem type) of the mount holding ``path`` ("" when unknown)."""
    best = ("", "", "")
    try:
        target = str(Path(path).resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fs = line.split()[:3]
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fs)
    except OSError:
        pass
    return best


def machine_info(workdir: Path) -> dict:
    info: dict = {"cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["ram_bytes"] = int(line.split()[1]) * 1024
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["load_avg"] = list(os.getloadavg())
    dev, mnt, fs = mount_of(workdir)
    info["filesystem"] = fs
    info["mount"] = mnt
    info["device"] = dev
    name = Path(dev).name
    for block in (name, name.rstrip("0123456789")):
        rot = Path(f"/sys/block/{block}/queue/rotational")
        if rot.exists():
            info["disk"] = f"block device {block} (sysfs rotational={rot.read_text().strip()})"
            model = Path(f"/sys/block/{block}/device/model")
            if model.exists():
                info["disk"] += f" ({model.read_text().strip()})"
            break
    try:
        du = shutil.disk_usage(workdir)
        info["disk_size_bytes"], info["disk_free_bytes"] = du.total, du.free
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("torch", "safetensors", "numpy"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return info


def describe_machine(m: dict) -> str:
    ram = m.get("ram_bytes", 0) / 2**30
    disk = m.get("disk_size_bytes", 0) / 1e9
    return (f"{m.get('cores')} cores ({m.get('cpu', '?')}), {ram:.0f} GiB RAM, "
            f"{m.get('disk', 'disk ?')} {disk:.0f} GB, {m.get('filesystem', '?')} on {m.get('mount', '?')}, "
            f"Linux {m.get('kernel')}, Python {m.get('python')}, torch {m.get('torch', '?')}, "
            f"safetensors {m.get('safetensors', '?')}")


def merge(parts: list[dict]) -> dict:
    """Results of separate runs (one per size, or a rerun of some verbs) as one: sizes side by side,
    a verb measured in several files taken from the last."""
    out = dict(parts[0])
    out["sizes"], out["verbs"], out["notes"] = {}, [], []
    out["commands"] = []
    for p in parts:
        for label, size in p["sizes"].items():  # verbs of one size from several runs side by side
            merged = out["sizes"].setdefault(label, {**size, "verbs": {}})
            merged["verbs"] = {**merged["verbs"], **size["verbs"]}
        out["verbs"] += [v for v in p.get("verbs", []) if v not in out["verbs"]]
        out["notes"] += [n for n in p.get("notes", []) if n not in out["notes"]]
        out["commands"].append(p.get("command", ""))
    if len(parts) > 1:
        out["command"] = " ; ".join(out["commands"])
        out["finished"] = parts[-1].get("finished")
        out["machine"] = dict(parts[0].get("machine", {}), load_avg_end=parts[-1].get("machine", {}).get(
            "load_avg_end"))
    return out


# -- formatting ------------------------------------------------------------------------


def _s(c: dict | None) -> str:
    if not c or "wall" not in c.get("stats", {}):
        return "-" if not c or not c.get("error") else "failed"
    w = c["stats"]["wall"]
    return f"{w['median']:.2f} ({w['min']:.2f}-{w['max']:.2f})"


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _mb(c: dict | None, field: str) -> str:
    try:
        return f"{c['stats'][field]['median'] / 1e6:.0f}"
    except (KeyError, TypeError):
        return "-"


ROW_HEAD = ("verb", "size", "ckpt s", "floor s (fsync)", "floor s (raw)", "ckpt/floor", "naive s", "ckpt/naive",
            "peer s", "ckpt/peer", "ckpt CPU s", "peak RSS MB", "read MB", "written MB")


def rows(results: dict) -> list[tuple[str, ...]]:
    out = []
    for verb in results.get("verbs", []):
        for label, size in results["sizes"].items():
            v = size["verbs"].get(verb)
            if v is None:
                continue
            if v.get("skipped"):
                out.append((verb, label, "skipped: " + v["skipped"]) + ("",) * (len(ROW_HEAD) - 3))
                continue
            c = v["contenders"]
            ck = c.get("ckpt")
            cpu = f"{ck['stats']['cpu']['median']:.2f}" if ck and "cpu" in ck.get("stats", {}) else "-"
            out.append((verb, label, _s(ck), _s(c.get("floor")), _s(c.get("floor-raw")),
                        _x(v["ratios"].get("floor")), _s(c.get("naive")),
                        _x(v["ratios"].get("naive")), _s(c.get("peer")), _x(v["ratios"].get("peer")), cpu,
                        _mb(ck, "maxrss"), _mb(ck, "rchar"), _mb(ck, "wchar")))
    return out


TARGET_HEAD = ("verb", "ckpt/floor by size", "marginal ckpt/floor", "fixed cost s", "target", "peak RSS MB by size",
               "RSS < 300 MB and flat", "verdict")


def _median_wall(v: dict, who: str) -> float | None:
    try:
        return v["contenders"][who]["stats"]["wall"]["median"]
    except (KeyError, TypeError):
        return None


def marginal(small: dict, large: dict) -> tuple[float | None, float | None]:
    """(ratio of the extra time ckpt takes to the extra time the floor takes between two sizes,
    ckpt's size-independent cost): what the headline ratio tends to on large checkpoints,
    and the constant (start-up, planning) that dominates small ones."""
    c0, c1, f0, f1 = (_median_wall(small, "ckpt"), _median_wall(large, "ckpt"), _median_wall(small, "floor"),
                      _median_wall(large, "floor"))
    if None in (c0, c1, f0, f1) or f1 <= f0:
        return None, None
    slope = (c1 - c0) / (f1 - f0)
    return slope, c0 - slope * f0


def _size_bytes(results: dict, label: str) -> int:
    return int((results["sizes"][label].get("checkpoint") or {}).get("total_bytes") or 0)


def _verdict(limit: float | None, judge: str, judged_ratios: list, slope: float | None,
             rss_ok: bool | None) -> tuple[str, str]:
    """(target as shown, verdict): a per-byte target is judged on the marginal ratio when two sizes ran,
    else on the ratio at the sizes judged; RSS must pass in either case."""
    if limit is None:
        target, speed_ok = "-", None
    elif judge == "marginal" and slope is not None:
        target, speed_ok = f"marginal <= {limit}x", slope <= limit
    else:
        target = f"<= {limit}x" + (" (one size: ratio)" if judge == "marginal" else "")
        speed_ok = None if None in judged_ratios else all(r <= limit for r in judged_ratios)
    if speed_ok is None and rss_ok is None:
        return target, "-"
    return target, "pass" if speed_ok is not False and rss_ok is not False else "MISS"


def targets(results: dict) -> list[tuple[str, ...]]:
    out = []
    for verb in results.get("verbs", []):
        present = [(lb, s["verbs"][verb]) for lb, s in results["sizes"].items() if s["verbs"].get(verb)]
        present = [(lb, p) for lb, p in present if not p.get("skipped")]
        if not present:
            continue
        labels, per = [lb for lb, _ in present], [p for _, p in present]
        ratios = [p.get("ratios", {}).get("floor") for p in per]
        rss = [((p.get("contenders", {}).get("ckpt") or {}).get("stats", {}).get("maxrss") or {}).get("median")
               for p in per]
        limit = next((p.get("max_floor_ratio") for p in per if p.get("max_floor_ratio")), None)
        judge = next((p.get("judge") for p in per if p.get("judge")), "marginal")
        # the verb issues set their targets on checkpoints of at least 4 GB; smaller sizes show the fixed cost
        judged = [r for lb, r in zip(labels, ratios, strict=True) if _size_bytes(results, lb) >= JUDGED_FROM]
        judged = judged or ratios[-1:]
        known = [r for r in rss if r is not None]
        rss_ok = None
        if known:
            flat = max(known) <= max(min(known) * RSS_FLAT, min(known) + RSS_FLAT_ABS)
            rss_ok = max(known) < RSS_LIMIT and flat
        slope, fixed = marginal(per[0], per[-1]) if len(per) > 1 else (None, None)
        target, verdict = _verdict(limit, judge, judged, slope, rss_ok)
        out.append((verb, " / ".join(_x(r) for r in ratios), _x(slope), "-" if fixed is None else f"{fixed:.2f}",
                    target, " / ".join("-" if r is None else f"{r / 1e6:.0f}" for r in rss),
                    "-" if rss_ok is None else ("yes" if rss_ok else "no"), verdict))
    return out


# -- hashing: before and after, and the projection to more cores ------------------------

PROJECT_CORES = 16


def _median_of(c: dict | None, field: str) -> float | None:
    vals = [r[field] for r in (c or {}).get("runs", []) if r.get("returncode") == 0 and field in r]
    return statistics.median(vals) if vals else None


def per_byte(copy_s: float, hash_s: float, threads: int, cores: int) -> float:
    """Seconds the writer spends per output byte: the writing thread copies, ``threads`` hash beside it
    (0: inline, after each tensor), all on ``cores`` cores. Memory bandwidth is assumed to keep up."""
    if threads == 0:
        return copy_s + hash_s
    return max(copy_s, hash_s / min(threads, cores), (copy_s + hash_s) / cores)


def _hashing_verbs(size: dict) -> dict[str, dict]:
    """The verbs of a round that measure hashing (they record it), with their medians."""
    out = {}
    for name, v in size["verbs"].items():
        if "hashing" not in v or v.get("skipped"):
            continue
        wall, floor = _median_wall(v, "ckpt"), _median_wall(v, "floor")
        nbytes = _median_of(v["contenders"].get("floor"), "output_bytes")
        if None not in (wall, floor, nbytes):
            out[name] = {**v["hashing"], "wall": wall, "floor": floor, "bytes": nbytes}
    return out


def _shared_fixed(results: dict, label: str, size: dict, names: list[str]) -> tuple[float | None, str]:
    """The job's fixed cost, which hashing does not change: the median of the variants' intercepts between the
    round's smaller size of the same family and this one (not below 0), and where it comes from."""
    family = (size.get("checkpoint") or {}).get("family")
    small = [(lb, s) for lb, s in results["sizes"].items() if lb != label and (s.get("checkpoint") or {}).get(
        "family") == family and _size_bytes(results, lb) < _size_bytes(results, label)]
    if not small:
        return None, ""
    lb, other = small[-1]
    fixed = [f for n in names if (f := marginal(other["verbs"].get(n, {}), size["verbs"][n])[1]) is not None]
    if not fixed:
        return None, ""
    return max(0.0, statistics.median(fixed)), (f"the median of the {len(fixed)} variants' intercepts of the "
                                                 f"{lb} -> {label} line ({', '.join(f'{f:.2f}' for f in fixed)} s)")


def projection(results: dict) -> list[str]:
    """Markdown: the tmpfs verbs before/after the hashing change, and their wall time projected to 16 cores
    from the per-core rates (a model, with its arithmetic shown)."""
    sized = [(lb, s) for lb, s in results["sizes"].items() if (s.get("rates") or {}).get("bytes_per_s")]
    if not sized:
        return []
    label, size = max(sized, key=lambda x: _size_bytes(results, x[0]))
    rates = size["rates"]["bytes_per_s"]
    verbs = {n: v for n, v in _hashing_verbs(size).items() if v["algo"] in rates}
    if not verbs:
        return []
    shared, source = _shared_fixed(results, label, size, list(verbs))
    rows = []
    for name, v in verbs.items():
        c_s, h_s, t = v["bytes"] / rates["buffered_copy"], v["bytes"] / rates[v["algo"]], v["threads"]
        # one size only: the fixed cost is what the 2-core model leaves of the measured wall
        fixed = shared if shared is not None else v["wall"] - per_byte(c_s, h_s, t, 2)
        proj = fixed + per_byte(c_s, h_s, t, PROJECT_CORES)
        how = (f"{c_s:.2f} + {h_s:.2f}" if t == 0 else
               f"max({c_s:.2f}, {h_s:.2f}/{min(t, PROJECT_CORES)}, ({c_s:.2f} + {h_s:.2f})/{PROJECT_CORES})")
        rows.append((f"`{name}`", f"{v['algo']}, " + ("inline" if t == 0 else f"{t} threads"),
                     f"{v['wall']:.2f} ({v['wall'] / v['floor']:.2f}x)",
                     f"{fixed + per_byte(c_s, h_s, t, 2):.2f}", f"{fixed:.2f} + {how} = {proj:.2f}",
                     f"{proj / v['floor']:.2f}x"))
    first = next(iter(verbs.values()))
    head = ("verb", "hashing", f"measured s, {results.get('machine', {}).get('cores', '?')} cores (ratio)",
            "model s, 2 cores", f"projected s, {PROJECT_CORES} cores", "projected ratio")
    sp = size["rates"]
    gbs = {k: f"{v / 1e9:.2f}" for k, v in rates.items()}
    out = [f"Hashing at {label}: {first['bytes'] / 1e9:.2f} GB written into tmpfs; floor (sendfile) "
           f"{first['floor']:.2f} s. Per-core rates (one thread, median of {sp.get('passes')} passes over "
           f"{sp.get('bytes', 0) / 1e9:.2f} GB, GB/s): C, copy into tmpfs as ckpt does it (preadv + write) "
           f"{gbs['buffered_copy']}; sendfile {gbs['sendfile']}; H, read + hash: BLAKE3 {gbs['blake3']} (two "
           f"threads together {gbs['blake3_x2']}), sha256 {gbs['sha256']} (two threads {gbs['sha256_x2']}).",
           "",
           f"**Projection to {PROJECT_CORES} cores (a model, not a measurement):** copying B bytes takes B/C on the "
           "writing thread, hashing them B/H on a hash thread; with T hash threads on N cores the per-byte part is "
           "max(B/C, B/H / min(T, N), (B/C + B/H) / N), and B/C + B/H when hashing is inline (T = 0); wall = fixed "
           "cost + that. Fixed cost: " + (f"{shared:.2f} s, {source}" if shared is not None else
                                          "per variant, the measured wall minus the 2-core model (one size only)") +
           "; the floor stays one sendfile thread (more cores do not speed it up). Assumes memory bandwidth keeps up "
           "with three streams; the 2-core column checks the model against the measured wall.",
           "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    before, after = verbs.get("extract-drop-mtp-tmpfs-sha256-inline"), verbs.get("extract-drop-mtp-tmpfs")
    if before and after:
        out += ["", f"Before -> after the hashing change, same run: {before['wall']:.2f} s -> {after['wall']:.2f} s "
                    f"({before['wall'] / after['wall']:.2f}x faster; {before['wall'] / before['floor']:.2f}x -> "
                    f"{after['wall'] / after['floor']:.2f}x the floor)."]
    return out + [""]


def print_rich(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(260, shutil.get_terminal_size().columns))
    t = Table(title=f"ckpt benchmarks ({results.get('date', '')}); times are medians (min-max) of "
                    f"{results.get('runs')} runs, warm page cache", show_lines=False)
    for h in ROW_HEAD:
        t.add_column(h, no_wrap=h in ("verb", "size"), overflow="fold")
    for r in rows(results):
        t.add_row(*r)
    console.print(t)
    t2 = Table(title="targets")
    for h in TARGET_HEAD:
        t2.add_column(h)
    for r in targets(results):
        t2.add_row(*r)
    console.print(t2)
    for line in projection(results):
        console.print(line, markup=False, soft_wrap=True)
    console.print(describe_machine(results.get("machine", {})))


def _loads(v: list | None) -> str:
    return " / ".join(f"{x:.1f}" for x in v) if v else "?"


def markdown(results: dict) -> str:
    def table(head, body):
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in body]
        return "\n".join(lines)

    m = results.get("machine", {})
    parts = [
        ("" if results.get("finished") else "**Partial results: the run did not finish.** ") +
        f"Run {results.get('date', '?')}, `{results.get('command', '')}`, "
        f"{results.get('runs')} runs per figure (median, min-max), warm page cache.",
        "",
        f"Machine: {describe_machine(m)}. Load average (1, 5, 15 min) at start {_loads(m.get('load_avg'))}, "
        f"at end {_loads(m.get('load_avg_end'))}.",
        "",
    ]
    for label, size in results["sizes"].items():
        ck = size.get("checkpoint", {})
        done = [len(c["runs"]) for v in size["verbs"].values() for c in v.get("contenders", {}).values()]
        if ck:
            parts.append(f"- {label}: {ck.get('family')} {ck.get('total_bytes', 0) / 1e9:.2f} GB, "
                         f"{ck.get('layers')} layers + 1 MTP, {ck.get('experts')} experts, hidden "
                         f"{ck.get('hidden')}, {ck.get('shards')} shards, MTP {ck.get('mtp_share', 0):.1%} of bytes; "
                         f"{min(done, default=0)} runs per figure")
    parts += ["", table(ROW_HEAD, rows(results)), "", table(TARGET_HEAD, targets(results)), ""]
    parts += projection(results)
    skipped = {(v, s["verbs"][v]["skipped"]) for s in results["sizes"].values() for v in s["verbs"]
               if s["verbs"][v].get("skipped")}
    for v, why in sorted(skipped):
        parts.append(f"- `{v}` skipped: {why}")
    notes = results.get("notes", [])
    parts += [f"- {n}" for n in notes]
    return "\n".join(parts).rstrip() + "\n"
