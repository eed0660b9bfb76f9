"""Where the lines of ``ckpt_tools/`` come from since a base commit, by ``git blame`` (moves and copies followed).

Each line is attributed to the commit that wrote it; a commit belongs to the branch whose merge brought it onto the
first-parent history (its name from the merge message), or to main itself. Lines older than the base are "base".
Branch names carry their issue (``h42-...``: issue 42), so the sum of base lines and one issue's lines is what the
package would hold had only that issue's work landed: a refactor's acceptance ("fewer lines than before, not counting
new features") is that sum against the base's total.

``python -m tools.line_account BASE [--json]`` prints the lines per branch and per issue prefix.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMIT_LINE = re.compile(r"^([0-9a-f]{40}) \d+ \d+")


def git(*args: str) -> str:
    cmd = ["git", "-C", str(ROOT), *args]  # this repository's own history
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout  # noqa: S603, S607


def owners(base: str) -> dict[str, str]:
    """Each commit since ``base`` -> the branch that merged it (``main`` for commits made on main itself)."""
    owner: dict[str, str] = {}
    for line in git("log", "--first-parent", "--merges", "--format=%H %s", f"{base}..HEAD").splitlines():
        merge, subject = line.split(" ", 1)
        found = re.search(r"Merge branch '([^']+)'", subject)
        branch = found.group(1) if found else "main"
        for commit in [merge, *git("rev-list", f"{merge}^1..{merge}^2").split()]:
            owner.setdefault(commit, branch)
    for commit in git("rev-list", "--first-parent", "--no-merges", f"{base}..HEAD").split():
        owner.setdefault(commit, "main")
    return owner


def account(base: str) -> Counter:
    owner = owners(base)
    old = set(git("rev-list", base).split())
    lines: Counter = Counter()
    files = [f for f in git("ls-tree", "-r", "--name-only", "HEAD", "ckpt_tools").split() if f.endswith(".py")]
    for name in files:
        for line in git("blame", "--line-porcelain", "-w", "-M", "-C", "HEAD", "--", name).splitlines():
            if found := COMMIT_LINE.match(line):
                commit = found.group(1)
                lines["base" if commit in old else owner.get(commit, "main")] += 1
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    lines = account(args.base)
    issues = Counter({re.sub(r"^h(\d+)-.*", r"issue \1", k): 0 for k in lines})
    for branch, n in lines.items():
        issues[re.sub(r"^h(\d+)-.*", r"issue \1", branch)] += n
    if args.json:
        print(json.dumps({"branches": lines, "issues": issues, "total": sum(lines.values())}, indent=1))
        return
    base_total = sum(len(git("show", f"{args.base}:{f}").splitlines())
                     for f in git("ls-tree", "-r", "--name-only", args.base, "ckpt_tools").split() if f.endswith(".py"))
    print(f"ckpt_tools/ at {args.base}: {base_total} lines; now {sum(lines.values())}")
    for name, n in issues.most_common():
        print(f"{n:7d}  {name}")


if __name__ == "__main__":
    main()
