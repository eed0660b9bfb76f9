"""Planning at release scale: the read-only and ``--dry-run`` commands on the sparse DeepSeek-V3 replica.

``python -m benchmarks scale [--runs 5] [--workdir DIR] [--json FILE] [--markdown FILE]`` builds the replica
(``benchmarks/release.py``: 163 shards, 91,991 tensors, a few MB on disk) and a copy without its MTP layer
(graft's target), then runs each command ``--runs`` times, alternating, each a child process measured by
``launch.py`` (wall, CPU, peak RSS), and reports medians with min-max against the issue-34 targets.
A command that exits non-zero is reported as failed with its output's tail.
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from . import release
from .measure import Sample, run

MIB = 1 << 20


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]  # after `ckpt`; {src}, {nomtp}, {out} filled in
    max_wall: float  # seconds (the target)
    max_rss: int | None = None  # bytes
    # CPU seconds measured with every rule in force (issue 32's scale values and trunk quant config read ~190 MB of
    # scales and audit 46,000 modules), medians of 6 alternating runs on 2026-12-05 (benchmarks/history/2026-12-05.md):
    # tests/test_release_scale.py holds each command within twice this, so that a regression shows whether or not
    # the target is met
    measured: float | None = None


def _zero_scales() -> tuple[str, ...]:
    """The replica's scales are holes (zeros): where a rule reads every scale's values (quant-scale-value) it finds
    them all wrong, so the verbs that refuse on it are let through (the reading is still done, and timed)."""
    from ckpt_tools.model.rules import known_rules

    return ("--allow-invalid", "quant-scale-value") if "quant-scale-value" in known_rules() else ()


# Issue 34, item 1: inspect / validate / extract --dry-run <= 1 s; dequant / graft --dry-run <= 2 s, < 200 MiB.
_Z = _zero_scales()
CASES = (
    Case("inspect", ("inspect", "{src}"), 1.0, measured=1.31),
    Case("validate", ("validate", "{src}"), 1.0, measured=1.13),
    Case("extract --dry-run", ("extract", "{src}", "-o", "{out}", "--dry-run", *_Z), 1.0, measured=1.32),
    Case("dequant --dry-run", ("dequant", "{src}", "-o", "{out}", "--dry-run", *_Z), 2.0, 200 * MIB, 1.91),
    Case("dequant --only-mtp --dry-run", ("dequant", "{src}", "-o", "{out}", "--only-mtp", "--dry-run", *_Z), 2.0,
         200 * MIB, 1.98),
    Case("graft --dry-run", ("graft", "{src}", "{nomtp}", "-o", "{out}", "--dry-run", *_Z), 2.0, 200 * MIB, 2.18),
)


# The fixed cost of each verb (issue 34, item 2: <= 0.30 s; `ckpt inspect` <= 0.25 s): the same commands on the
# tiny DeepSeek-V3 fixture checkpoints (bf16, and block FP8 for dequant), where nothing but start-up is left.
FIXED = (  # measured: CPU s, `python -m benchmarks scale --runs 3`, 2026-12-06 06:40 UTC, load 0.7 (history)
    Case("--help", ("--help",), 0.30, measured=0.09),
    Case("inspect", ("inspect", "{tiny}"), 0.25, measured=0.21),
    Case("validate", ("validate", "{tiny}"), 0.30, measured=0.19),
    Case("diff", ("diff", "{tiny}", "{tiny}"), 0.30, measured=0.18),
    Case("extract --dry-run", ("extract", "{tiny}", "-o", "{out}", "--dry-run"), 0.30, measured=0.21),
    Case("dequant --dry-run", ("dequant", "{tiny_fp8}", "-o", "{out}", "--dry-run"), 0.30, measured=0.19),
    Case("graft --dry-run", ("graft", "{tiny}", "{tiny_nomtp}", "-o", "{out}", "--dry-run"), 0.30, measured=0.21),
)


def ckpt_argv() -> list[str]:
    exe = Path(sys.executable).parent / "ckpt"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ckpt_tools"]


def build_inputs(workdir: Path) -> tuple[Path, Path]:
    src, nomtp = workdir / "deepseek-v3", workdir / "deepseek-v3-nomtp"
    for path, drop in ((src, False), (nomtp, True)):
        if not (path / release.INDEX).exists():
            release.build(path, nomtp=drop)
    return src, nomtp


def tiny_inputs(workdir: Path) -> dict[str, Path]:
    """The tiny fixture checkpoints of the fixed-cost cases (made with the test suite's generator)."""
    from ckpt_tools.testing.fixtures import FixtureOptions, make_checkpoint

    out = {}
    for name, opts in (("tiny", FixtureOptions()), ("tiny_fp8", FixtureOptions(fp8=True)),
                       ("tiny_nomtp", FixtureOptions(drop_mtp=True))):
        d = workdir / name
        if not (d / "config.json").exists():
            make_checkpoint("deepseek_v3", d, opts)
        out[name] = d
    return out


def compiled() -> None:
    """Byte-compile the package first, as a wheel install ships it: a checkout run with PYTHONDONTWRITEBYTECODE
    would otherwise compile its modules again in every measured run (0.1 s of a fixed cost of 0.15 s)."""
    import compileall

    import ckpt_tools

    compileall.compile_dir(Path(ckpt_tools.__file__).parent, quiet=1)


def measure(workdir: Path, runs: int = 5, cases: tuple[Case, ...] = CASES,
            log=lambda _m: None) -> dict[str, list[Sample]]:
    """Every case ``runs`` times, alternating; samples per case."""
    compiled()
    src, nomtp = build_inputs(workdir)
    paths = {"src": src, "nomtp": nomtp, "out": workdir / "out"}
    if any("{tiny" in a for c in cases for a in c.argv):
        paths.update(tiny_inputs(workdir))
    samples: dict[str, list[Sample]] = {c.name: [] for c in cases}
    for r in range(runs):
        for c in cases:
            argv = [a.format(**paths) for a in c.argv]
            s = run(ckpt_argv() + argv, log=workdir / "logs" / f"{c.name.replace(' ', '_')}.{r}.log",
                    timeout=300.0)
            samples[c.name].append(s)
            log(f"  run {r + 1}: {c.name}: {s.wall:.2f} s, {s.maxrss / MIB:.0f} MiB, rc={s.returncode}")
    return samples


def summary(samples: dict[str, list[Sample]], cases: tuple[Case, ...] = CASES) -> list[dict]:
    """Medians (min-max) per case, against its target."""
    rows = []
    for c in cases:
        ss = samples[c.name]
        ok = [s for s in ss if s.returncode in (0, 1) and not s.timed_out]  # validate: 1 = findings
        walls = [s.wall for s in ok]
        rss = [s.maxrss for s in ok]
        row = {"command": c.name, "runs": len(ss), "failed": len(ss) - len(ok),
               "target_wall": c.max_wall, "target_rss_mib": c.max_rss and c.max_rss // MIB}
        if ok:
            row.update(wall=statistics.median(walls), wall_min=min(walls), wall_max=max(walls),
                       cpu=statistics.median(s.cpu for s in ok), rss_mib=statistics.median(rss) / MIB)
            row["meets"] = row["wall"] <= c.max_wall and (c.max_rss is None or max(rss) < c.max_rss)
        else:
            row.update(meets=False, error=ss[-1].stderr_tail[-400:] if ss else "")
        rows.append(row)
    return rows


def markdown(rows: list[dict], load: str, title: str = "release scale") -> str:
    lines = [f"{title}; load average (1, 5, 15 min) at start: {load}", "",
             "| command | wall s, median (min-max) | CPU s | peak RSS MiB | target | meets |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        target = f"<= {r['target_wall']:g} s" + (f", < {r['target_rss_mib']} MiB" if r["target_rss_mib"] else "")
        if "wall" in r:
            lines.append(f"| `ckpt {r['command']}` | {r['wall']:.2f} ({r['wall_min']:.2f}-{r['wall_max']:.2f}) | "
                         f"{r['cpu']:.2f} | {r['rss_mib']:.0f} | {target} | {'yes' if r['meets'] else 'MISS'} |")
        else:
            lines.append(f"| `ckpt {r['command']}` | failed | - | - | {target} | MISS |")
    return "\n".join(lines) + "\n"


def main(args) -> int:
    import json

    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    args.workdir.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = summary(measure(args.workdir, args.runs, log=log))
    md = markdown(rows, load, "Planning at release scale (sparse DeepSeek-V3 replica: 163 shards, 91,991 tensors)")
    fixed = summary(measure(args.workdir, args.runs, FIXED, log=log), FIXED)
    md += "\n" + markdown(fixed, " / ".join(f"{x:.2f}" for x in os.getloadavg()),
                          "Fixed cost (tiny DeepSeek-V3 fixture checkpoints)")
    rows += fixed
    sys.stdout.write(md)
    if args.markdown:
        args.markdown.write_text(md)
    if args.json:
        args.json.write_text(json.dumps({"load": load, "rows": rows}, indent=1) + "\n")
    return 0 if all(r["meets"] for r in rows) else 1
