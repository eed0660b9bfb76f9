"""The README is a landing page; the reference lives in docs/. Links resolve and every verb is documented."""

from __future__ import annotations

import re
from pathlib import Path

from ckpt_tools.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 300
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # '#' in code is not a heading
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _verbs() -> list[str]:
    return [c.name for c in app.registered_commands if c.name]


def test_readme_is_a_landing_page():
    n = len(README.read_text().splitlines())
    assert n < MAX_README_LINES, f"README.md has {n} lines (a landing page has fewer than {MAX_README_LINES})"


def test_every_local_link_resolves():
    bad = []
    for page in [README, *DOCS]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    assert not bad, "\n".join(bad)


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    assert {p.resolve() for p in DOCS} <= linked, sorted(p.name for p in DOCS if p.resolve() not in linked)


def test_every_verb_has_a_readme_line_and_a_reference_row():
    verbs = _verbs()
    assert "dequant" in verbs and len(verbs) >= 10  # the list is the CLI's own, not a copy of it
    readme, reference = README.read_text(), (ROOT / "docs" / "verbs.md").read_text()
    for verb in verbs:
        assert re.search(rf"^\| `ckpt {verb}[ `]", readme, flags=re.M), f"README's verb table misses {verb}"
        assert re.search(rf"^\| `ckpt {verb}[ `]", reference, flags=re.M), f"docs/verbs.md misses {verb}"
