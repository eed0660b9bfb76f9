"""`ckpt inspect PATH`: the MTP layers of a checkpoint - roles, experts, shards, dtypes, sizes."""

from __future__ import annotations

import typer

from .common import command, emit_json, human_bytes, out_console
from .gate_options import allow_invalid_option, say_allowed
from .layout import Col, print_table

MAX_ROWS = 20  # problem keys listed before "..."


def _b(n: int) -> str:
    """Exact bytes, with the human size alongside."""
    return f"{n:,} ({human_bytes(n)})" if n >= 1000 else f"{n} B"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "-"


def render(report) -> None:
    from rich.table import Table

    con = out_console()
    src = "--arch" if report.table_source == "arch" else "detected"
    con.print(f"[bold]{report.path}[/]")
    con.print(f"family [bold]{report.family}[/] ({report.title}, {src}); "
              f"MTP layers: [bold]{report.mtp_layers}[/]"
              + (f" ({report.count_field})" if report.count_field else "")
              + f"; norm {report.norm}; fusion input {report.concat_order.replace('_', '-')}; dtype {report.dtype}")
    if report.reader != "safetensors":
        notes = "; ".join(report.reader_notes)
        con.print(f"read with the {report.reader} reader" + (f": {notes}" if notes else ""), markup=False)
    _render_quantization(con, report.quantization)

    whole, mtp = report.totals["checkpoint"], report.totals["mtp"]
    t = Table(title="Size", title_justify="left")
    for col in ("", "tensors", "parameters", "bytes", "shards"):
        t.add_column(col, justify="left" if not col else "right")
    t.add_row("MTP", f"{mtp['tensors']:,}", f"{mtp['params']:,}", _b(mtp["bytes"]), str(mtp["shards"]))
    t.add_row("checkpoint", f"{whole['tensors']:,}", f"{whole['params']:,}", _b(whole["bytes"]), str(whole["shards"]))
    t.add_row("MTP share", _pct(mtp["tensors"], whole["tensors"]), _pct(mtp["params"], whole["params"]),
              _pct(mtp["bytes"], whole["bytes"]), "")
    con.print(t)

    if report.roles:
        dtypes_of: dict[str, set[str]] = {}
        for e in report.tensors:
            dtypes_of.setdefault(e["role"], set()).add(e["dtype"])
        t = Table(title="MTP tensors by role", title_justify="left")
        for col in ("role", "tensors", "parameters", "bytes", "dtypes"):
            t.add_column(col, justify="right" if col in ("tensors", "parameters", "bytes") else "left")
        for role, r in report.roles.items():
            t.add_row(role, str(r["tensors"]), f"{r['params']:,}", f"{r['bytes']:,}",
                      ", ".join(sorted(dtypes_of.get(role, ()))))
        con.print(t)

    if len(report.layers) > 1:
        print_table(con, LAYER_COLUMNS, [[layer["prefix"] or "-", "shared" if layer["depth"] is None else
                                          str(layer["depth"]), str(layer["tensors"]), f"{layer['params']:,}",
                                          f"{layer['bytes']:,}"] for layer in report.layers], title="MTP layers")
    if report.experts:
        print_table(con, EXPERT_COLUMNS, [_expert_row(g) for g in report.experts], title="Routed experts")
    if report.shards:
        print_table(con, SHARD_COLUMNS, [[s["name"], str(s["mtp_tensors"]), f"{s['mtp_bytes']:,}", str(s["tensors"]),
                                          f"{s['bytes']:,}"] for s in report.shards],
                    title="Shards holding MTP tensors")

    t = Table(title="Dtypes", title_justify="left")
    for col in ("dtype", "MTP tensors", "MTP bytes", "tensors", "bytes"):
        t.add_column(col, justify="left" if col == "dtype" else "right")
    for dt, w in report.dtypes["checkpoint"].items():
        m = report.dtypes["mtp"].get(dt, {"tensors": 0, "bytes": 0})
        t.add_row(dt, str(m["tensors"]), f"{m['bytes']:,}", str(w["tensors"]), f"{w['bytes']:,}")
    con.print(t)
    if report.fp8["weights"]:
        f = report.fp8
        con.print(f"FP8: {f['weights']} MTP weight(s) with {f['scales']} *{f['scale_suffix']} companion(s), "
                  f"block {f['block'][0]}x{f['block'][1]}")

    if report.mtp_quant and report.mtp_quant["modules"]:
        _render_mtp_quant(con, report.mtp_quant)
    _render_status(con, report.status, report.mtp_layers)


# prefixes, expert groups and shard names are identifiers: the key of their row, never cut
LAYER_COLUMNS = (Col("prefix", "id"), Col("depth", "id", "right"), Col("tensors", "id", "right"),
                 Col("parameters", "id", "right"), Col("bytes", "id", "right"))
EXPERT_COLUMNS = (Col("group", "id"), Col("E", "id", "right"), Col("H", "id", "right"), Col("I", "id", "right"),
                  Col("layout"), Col("quant", "id", "right"), Col("tensors", "id", "right"),
                  Col("bytes", "id", "right"))
SHARD_COLUMNS = (Col("shard", "id"), Col("MTP tensors", "id", "right"), Col("MTP bytes", "id", "right"),
                 Col("tensors", "id", "right"), Col("bytes", "id", "right"))


def _expert_row(g: dict) -> list[str]:
    layout = g["layout"] + (f" (shipped {g['layout_shipped']})" if g["layout"] != g["layout_shipped"] else "")
    return [g["prefix"], str(g["count"]), str(g["hidden"]), str(g["inter"]), layout, "fp8" if g["quant"] else "-",
            str(g["tensors"]), f"{g['bytes']:,}"]


def _render_quantization(con, q: dict | None) -> None:
    """The scheme the tables detect (not config.json's fields, which mean nothing for most schemes)."""
    from rich.markup import escape

    if not q:
        return
    if q.get("unknown"):
        con.print(f"quantization: [yellow]not described by any scheme table[/]: {escape(q['unknown'])}")
    elif q.get("scheme"):
        titles = "; ".join(s["title"] for s in q["schemes"])
        con.print(f"quantization: [bold]{escape(q['scheme'])}[/] ({escape(titles)}), declared in "
                  f"{escape(', '.join(q['declared_in']))}", soft_wrap=True)
    else:
        con.print(f"quantization: {escape(str(q['quant_method']))} (no scheme table matches)")


def _render_mtp_quant(con, quant: dict) -> None:
    """Per MTP module: stored as what versus what the config declares; routed experts that agree share a row."""
    from rich.markup import escape
    from rich.table import Table

    from ..model.quant.report import collapsed, declared_text

    t = Table(title="MTP modules: stored vs declared (quantization config)", title_justify="left")
    for col in ("module", "stored", "declared", ""):
        t.add_column(col, justify="left", overflow="fold")
    problems = []
    for name, m, n in collapsed(quant["modules"]):
        label = f"{name} (x{n})" if n > 1 else name
        if m["ok"]:
            mark = "[green]ok[/]" + (" (release convention)" if m["exempt"] else "")
        else:
            mark = "[bold red]problem[/]"
            problems.append((label, m["problem"]))
        t.add_row(escape(label), escape(m["stored"]["label"]), escape(declared_text(m["declared"])), mark)
    con.print(t)
    others = [f for f in quant["findings"] if f["key"] not in {m["module"] for m in quant["modules"]}]
    problems += [(f["key"], f["message"]) for f in others]  # fused engine layers
    if not problems:
        return
    con.print(f"[bold red]mtp-quant-config[/]: {len(quant['findings'])} finding(s) "
              "(`ckpt validate --fix-quant-config PATH -o OUT` repairs what a config change can):")
    for key, msg in problems[:MAX_ROWS]:
        con.print(f"  {key}: {msg}", markup=False, soft_wrap=True)
    if len(problems) > MAX_ROWS:
        con.print(f"  ... and {len(problems) - MAX_ROWS} more (all of them with --json)")


def _render_status(con, status: dict, count: int) -> None:
    if status["complete"] and not (status["extra"] or status["beyond"]):
        note = f"; optional absent: {len(status['optional_absent'])}" if status["optional_absent"] else ""
        con.print(f"[green]MTP set complete[/] ({count} layer(s)){note}")
        return
    lines = [f"missing {m['key']} {m['shape']}" for m in status["missing"]]
    lines += [f"{m['key']} has shape {m['actual']}, expected {m['expected']}" for m in status["misshaped"]]
    lines += [f"FP8 weight {k} has no scale" for k in status["missing_scales"]]
    lines += [f"extra tensor in the MTP namespace: {k}" for k in status["extra"]]
    lines += [f"MTP tensor past the declared count: {k}" for k in status["beyond"]]
    con.print(f"[yellow]MTP set has {len(lines)} problem(s)[/] (`ckpt validate` reports them with rules):")
    for line in lines[:MAX_ROWS]:
        con.print(f"  {line}", markup=False)
    if len(lines) > MAX_ROWS:
        con.print(f"  ... and {len(lines) - MAX_ROWS} more")


def _render_discovery(report) -> None:
    """`--discover`: the draft table on stdout (unless written to a file), a summary on stderr."""
    from .common import err_console

    found = report.discovery
    con = err_console()
    depths = sorted({d for d in found.depth_of.values() if d is not None})
    con.print(f"discovered {len(found.keys)} MTP tensor(s) in {len(depths) or 1} depth(s)"
              + (f", {found.sub_blocks} sub-layers each" if found.sub_blocks > 1 else "")
              + (f" ({found.count_key} = {found.count})" if found.count_key else ""))
    if report.written:
        con.print(f"wrote {report.written}; refine it, then put it in mappings/architectures/ or a CKPT_TABLES "
                  "directory")
    else:
        out_console().print(report.yaml, markup=False, highlight=False, soft_wrap=True, end="")


PATH_HELP = "Checkpoint directory, one .safetensors file, or hf://org/repo@rev."
ARCH_HELP = "Use this family's table instead of detecting it."


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    @command
    def inspect_cmd(
        path: str = typer.Argument(..., metavar="PATH", help=PATH_HELP),
        arch: str | None = typer.Option(None, "--arch", metavar="NAME", help=ARCH_HELP),
        json_output: bool = typer.Option(False, "--json", help="Print the report as JSON (keys documented in "
                                                                "ckpt_tools.ops.inspect)."),
        discover: bool = typer.Option(False, "--discover", help="Find the MTP tensors from their names and print a "
                                                                "draft architecture table (YAML) to refine."),
        write: str | None = typer.Option(None, "--write", metavar="FILE", help="With --discover: write the draft "
                                         "table to FILE (its name, without .yaml, becomes the family)."),
        allow_invalid: list[str] = allow_invalid_option(),
    ) -> None:
        """Show a checkpoint's MTP layers: roles, experts, shards, dtypes, parameters and bytes."""
        from .. import api

        report = api.inspect(path, arch=arch, discover=discover or write is not None, write=write,
                             allow_invalid=allow_invalid or (), progress=not json_output)
        say_allowed(report.allowed_invalid)
        if json_output:
            emit_json(report.to_json())
        elif discover or write is not None:
            _render_discovery(report)
        else:
            render(report)
