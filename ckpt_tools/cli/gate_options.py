"""What ``--allow-invalid RULE`` (api/options.py) let through, said once (see consistency.py)."""

from __future__ import annotations


def say_allowed(problems: list[dict] | None) -> None:
    """One line on stderr for what --allow-invalid let through (``Problem.to_json`` dicts): never silent."""
    if not problems:
        return
    from rich.markup import escape

    from .common import err_console

    rules = sorted({p["rule"] for p in problems})
    first = problems[0]
    where = f"{first['path']}: " if first.get("path") else ""
    key = f"{first['key']}: " if first.get("key") else ""
    err_console().print(f"[yellow]note:[/] proceeding despite {len(problems)} problem(s) allowed by --allow-invalid "
                        f"({', '.join(rules)}); first: {escape(where + key + first['message'])}", soft_wrap=True)
