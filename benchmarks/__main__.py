"""``python -m benchmarks run [--size 1GB,4GB] [--own-sizes 1GB,3GB] [--verbs ...] [--runs 3] [--json FILE]``.

``python -m benchmarks scale [--runs 5]`` times planning on a sparse replica of the DeepSeek-V3 release.

``python -m benchmarks table FILE.json [--markdown]`` prints a saved result again.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from . import report


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="generate synthetic checkpoints and benchmark the verbs")
    r.add_argument("--size", default="1GB,4GB", help="comma-separated checkpoint sizes (default 1GB,4GB)")
    r.add_argument("--verbs", help="comma-separated (default: the default set; `python -m benchmarks list`)")
    r.add_argument("--runs", type=int, default=3, help="runs per figure (median, min, max); default 3")
    r.add_argument("--json", type=Path, help="write the results here")
    r.add_argument("--markdown", type=Path,
                   help="write the tables as Markdown here (for a dated entry in benchmarks/history/)")
    r.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ckpt-bench",
                   help="where checkpoints, outputs and the peer venv go (default: $TMPDIR/ckpt-bench)")
    r.add_argument("--family", default="qwen3_next", help="table of the synthetic checkpoints (default qwen3_next)")
    r.add_argument("--own-sizes", default="1GB,3GB",
                   help="sizes for verbs with a family of their own (the extract-drop-mtp-tmpfs* verbs: DeepSeek-V3 "
                        "layout); default 1GB,3GB")
    r.add_argument("--shards", type=int, default=8, help="shards per synthetic checkpoint (default 8)")
    r.add_argument("--no-peers", action="store_true", help="do not install or run peer tools")
    r.add_argument("--contenders", default="floor,naive,peer",
                   help="what to run beside ckpt: floor (raw and fsync'd), naive, peer (default: all)")
    r.add_argument("--retry-peers", action="store_true", help="retry a peer install that failed before")
    r.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds per child process (default 900)")
    r.add_argument("--quiet", action="store_true", help="no per-run log lines")
    sub.add_parser("list", help="list the verbs that can be benchmarked")
    sc = sub.add_parser("scale", help="planning at release scale: read-only and --dry-run commands on a sparse "
                                      "replica of the DeepSeek-V3 release (163 shards, 91,991 tensors)")
    sc.add_argument("--runs", type=int, default=5, help="runs per command (median, min, max); default 5")
    sc.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ckpt-bench-scale",
                    help="where the replica (a few MB on disk) goes (default: $TMPDIR/ckpt-bench-scale)")
    sc.add_argument("--json", type=Path, help="write the results here")
    sc.add_argument("--markdown", type=Path, help="write the table as Markdown here")
    t = sub.add_parser("table", help="print the tables of saved JSON results (several files: merged by size)")
    t.add_argument("files", type=Path, nargs="+")
    t.add_argument("--markdown", action="store_true", help="print Markdown instead of rich tables")
    t.add_argument("--json", type=Path, help="also write the merged results here")
    args = ap.parse_args(argv)

    if args.cmd == "table":  # needs nothing but the JSON (and rich)
        results = report.merge([json.loads(f.read_text()) for f in args.files])
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")
        if args.markdown:
            sys.stdout.write(report.markdown(results))
        else:
            report.print_rich(results)
        return 0

    if args.cmd == "scale":
        from . import scale

        return scale.main(args)

    from .runner import default_verbs, parse_size, run
    from .verbs import VERBS

    if args.cmd == "list":
        for name, v in VERBS.items():
            print(f"{name:<20} {'default ' if v.default else 'optional'} {v.summary}")
        return 0
    sizes = _csv(args.size)
    verbs = _csv(args.verbs) if args.verbs else default_verbs()
    unknown = [v for v in verbs if v not in VERBS]
    if unknown or args.runs < 1:
        ap.error(f"unknown verb(s) {unknown}; known: {', '.join(VERBS)}" if unknown else "--runs must be >= 1")
    own_sizes = _csv(args.own_sizes)
    try:
        for s in sizes + own_sizes:
            parse_size(s)
    except ValueError as e:
        ap.error(str(e))
    log = (lambda _msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    def save(partial: dict) -> None:
        if args.json:
            args.json.write_text(json.dumps(partial, indent=1) + "\n")
        if args.markdown:
            args.markdown.write_text(report.markdown(partial))

    results = run(sizes, verbs, runs=args.runs, workdir=args.workdir, family=args.family, shards=args.shards,
                  peers=not args.no_peers, retry_peers=args.retry_peers, keep=args.keep, timeout=args.timeout,
                  contenders=set(_csv(args.contenders)), log=log, save=save, own_sizes=own_sizes)
    save(results)
    report.print_rich(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
