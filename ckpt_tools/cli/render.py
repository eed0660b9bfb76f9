"""Rendering shared by the writing commands: plans for --dry-run, reports after a write."""

from __future__ import annotations

from ..plan import Plan
from ..writer import WriteResult
from .common import emit_json, human_bytes, out_console


def render_plan(plan: Plan, console) -> None:
    from rich.table import Table

    shards = plan.shards()
    where = {t.key: name for name, ts in shards.items() for t in ts}
    table = Table(title=f"plan: {plan.command}", show_lines=False)
    for col in ("tensor", "dtype", "shape", "bytes", "recipe", "shard"):
        table.add_column(col, overflow="fold")
    for t in plan.tensors:
        d = t.recipe.describe()
        recipe = d["op"] + (f" ({len(d['ranges'])} ranges)" if "ranges" in d and len(d["ranges"]) > 1 else "")
        table.add_row(t.key, t.dtype, str(list(t.shape)), human_bytes(t.nbytes), recipe, where[t.key])
    console.print(table)
    console.print(f"{len(plan.tensors)} tensors, {human_bytes(plan.total_bytes)} in {len(shards)} shard(s); "
                  f"files: {', '.join(f.name for f in plan.files) or '-'}")


def report_write(plan: Plan, result: WriteResult, json_output: bool, *, bytes_read: int, extra: dict | None = None,
                 validation=None) -> None:
    report = {
        "output": str(result.out_dir),
        "tensors": len(plan.tensors),
        "tensor_bytes": plan.total_bytes,
        "bytes_written": result.bytes_written,
        "bytes_read": bytes_read,
        "files": result.files,
        "seconds": round(result.seconds, 3),
        **(extra or {}),
    }
    if validation is not None:
        report["validation"] = validation
    if json_output:
        emit_json(report)
        return
    c = out_console()
    c.print(f"wrote {report['tensors']} tensors ({human_bytes(plan.total_bytes)}) to {result.out_dir} "
            f"in {report['seconds']} s; read {human_bytes(bytes_read)} from the source")
