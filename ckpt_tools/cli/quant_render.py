"""One line per quantization-config change a verb made (stitch, graft, validate --fix-quant-config)."""

from __future__ import annotations

from .common import out_console


def say_config_changes(repair: dict | None, shown: int = 4) -> None:
    """``repair``: ``quant.repair.Repair.to_json()``; nothing is printed when the config is unchanged."""
    if not repair:
        return
    for ch in repair.get("changes", []):
        where = f"{ch['file']}:{'.'.join(p for p in (ch.get('section'), ch.get('field')) if p)}"
        for verb, entries in (("added", ch.get("add") or []), ("removed", ch.get("remove") or [])):
            if entries:
                more = f", ... (+{len(entries) - shown})" if len(entries) > shown else ""
                out_console().print(f"quantization config: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} "
                                    f"{verb} in {where}: {', '.join(entries[:shown])}{more}",
                                    markup=False, soft_wrap=True)
