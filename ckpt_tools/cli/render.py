"""Rendering shared by the writing commands: plans for --dry-run."""

from __future__ import annotations

from ..stream.plan import Plan
from .common import human_bytes


def render_plan(plan: Plan, console) -> None:
    """One row per planned tensor; the shard column only when the plan writes more than one."""
    from .layout import Col, print_table

    shards = plan.shards()
    where = {t.key: name for name, ts in shards.items() for t in ts}
    cols = [Col("tensor", "id"), Col("dtype", "id"), Col("shape", "id"), Col("bytes", "id", "right"),
            Col("recipe")] + ([Col("shard", "id")] if len(shards) > 1 else [])
    rows = []
    for t in plan.tensors:
        d = t.recipe.describe()
        recipe = d["op"] + (f" ({len(d['ranges'])} ranges)" if "ranges" in d and len(d["ranges"]) > 1 else "")
        rows.append([t.key, t.dtype, str(list(t.shape)), human_bytes(t.nbytes), recipe, where[t.key]][:len(cols)])
    print_table(console, cols, rows, title=f"plan: {plan.command}")
    console.print(f"{len(plan.tensors)} tensors, {human_bytes(plan.total_bytes)} in {len(shards)} shard(s)"
                  + (f" ({next(iter(shards))})" if len(shards) == 1 else "")
                  + f"; files: {', '.join(f.name for f in plan.files) or '-'}", markup=False)
