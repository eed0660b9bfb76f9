"""`ckpt inspect PATH`: the MTP layers of a checkpoint - roles, experts, shards, dtypes, sizes."""

from __future__ import annotations

import re
from collections import Counter

import typer

from ..api.options import Inspect
from .common import command, emit_json, human_bytes, out_console, say_allowed
from .layout import INDENT, Col, print_fields, print_table
from .options import takes

MAX_ROWS = 20  # problem keys listed before "..."


def _b(n: int) -> str:
    """Exact bytes, with the human size alongside."""
    return f"{n:,} ({human_bytes(n)})" if n >= 1000 else f"{n} B"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "-"


def render(report) -> None:
    from rich.markup import escape

    con = out_console()
    src = "--arch" if report.table_source == "arch" else "detected"
    con.print(f"[bold]{escape(report.path)}[/]")
    con.print(f"family [bold]{report.family}[/] ({escape(report.title)}, {src}); "
              f"MTP layers: [bold]{report.mtp_layers}[/]"
              + (f" ({report.count_field})" if report.count_field else "")
              + f"; norm {report.norm}; fusion input {report.concat_order.replace('_', '-')}; dtype {report.dtype}")
    if report.reader != "safetensors":
        notes = "; ".join(report.reader_notes)
        con.print(f"read with the {report.reader} reader" + (f": {notes}" if notes else ""), markup=False)
    _render_quantization(con, report.quantization)

    whole, mtp = report.totals["checkpoint"], report.totals["mtp"]
    print_table(con, SIZE_COLUMNS, [
        ["MTP", f"{mtp['tensors']:,}", f"{mtp['params']:,}", _b(mtp["bytes"]), str(mtp["shards"])],
        ["checkpoint", f"{whole['tensors']:,}", f"{whole['params']:,}", _b(whole["bytes"]), str(whole["shards"])],
        ["MTP share", _pct(mtp["tensors"], whole["tensors"]), _pct(mtp["params"], whole["params"]),
         _pct(mtp["bytes"], whole["bytes"]), ""],
    ], title="Size")

    if report.roles:
        dtypes_of: dict[str, set[str]] = {}
        for e in report.tensors:
            dtypes_of.setdefault(e["role"], set()).add(e["dtype"])
        print_table(con, ROLE_COLUMNS, [[role, str(r["tensors"]), f"{r['params']:,}", f"{r['bytes']:,}",
                                         ", ".join(sorted(dtypes_of.get(role, ())))]
                                        for role, r in report.roles.items()], title="MTP tensors by role")

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

    rows = []
    for dt, w in report.dtypes["checkpoint"].items():
        m = report.dtypes["mtp"].get(dt, {"tensors": 0, "bytes": 0})
        rows.append([dt, f"{m['tensors']:,}", f"{m['bytes']:,}", f"{w['tensors']:,}", f"{w['bytes']:,}"])
    print_table(con, DTYPE_COLUMNS, rows, title="Dtypes")
    if report.fp8["weights"]:
        f = report.fp8
        con.print(f"FP8: {f['weights']} MTP weight(s) with {f['scales']} *{f['scale_suffix']} companion(s), "
                  f"block {f['block'][0]}x{f['block'][1]}")

    if report.mtp_quant and report.mtp_quant["modules"]:
        _render_mtp_quant(con, report.mtp_quant)
    _render_status(con, report.status, report.mtp_layers)
    _render_findings(con, report.path, report.findings, report.notes)


# prefixes, expert groups, shard names and byte counts are identifiers: never cut, never wrapped
SIZE_COLUMNS = (Col("", "id"), Col("tensors", "id", "right"), Col("parameters", "id", "right"),
                Col("bytes", "id", "right"), Col("shards", "id", "right"))
ROLE_COLUMNS = (Col("role", "id"), Col("tensors", "id", "right"), Col("parameters", "id", "right"),
                Col("bytes", "id", "right"), Col("dtypes", "ids"))
LAYER_COLUMNS = (Col("prefix", "id"), Col("depth", "id", "right"), Col("tensors", "id", "right"),
                 Col("parameters", "id", "right"), Col("bytes", "id", "right"))
EXPERT_COLUMNS = (Col("group", "id"), Col("E", "id", "right"), Col("H", "id", "right"), Col("I", "id", "right"),
                  Col("layout", "id"), Col("stored", "words"), Col("tensors", "id", "right"),
                  Col("bytes", "id", "right"))
SHARD_COLUMNS = (Col("shard", "id"), Col("MTP tensors", "id", "right"), Col("MTP bytes", "id", "right"),
                 Col("tensors", "id", "right"), Col("bytes", "id", "right"))
DTYPE_COLUMNS = (Col("dtype", "id"), Col("MTP tensors", "id", "right"), Col("MTP bytes", "id", "right"),
                 Col("tensors", "id", "right"), Col("bytes", "id", "right"))
MODULE_COLUMNS = (Col("module", "id"), Col("stored", "words"), Col("declared", "words"), Col("", "words"))


def _expert_row(g: dict) -> list[str]:
    """What is stored: the layout detected from the keys, the storage from the dtypes (not the table's)."""
    if not g["tensors"]:
        return [g["prefix"], str(g["count"]), str(g["hidden"]), str(g["inter"]), "-", "nothing stored", "0", "0"]
    return [g["prefix"], str(g["count"]), str(g["hidden"]), str(g["inter"]), g["layout"], _label(g["stored"] or "-"),
            str(g["tensors"]), f"{g['bytes']:,}"]


def _label(stored: str) -> str:
    """A storage label for a table cell: a block size as one word (``block 128x128``, as the FP8 line says)."""
    return re.sub(r"\[(\d+), (\d+)\]", r"\1x\2", stored)


def _render_quantization(con, q: dict | None) -> None:
    """The scheme the tables detect (not config.json's fields, which mean nothing for most schemes)."""
    if not q:
        return
    if q.get("unknown"):
        words = ["quantization:", "not", "described", "by", "any", "scheme", "table:", *q["unknown"].split()]
    elif q.get("scheme"):
        titles = "; ".join(s["title"] for s in q["schemes"])
        words = ["quantization:", q["scheme"], *f"({titles}),".split(), "declared", "in",
                 *", ".join(q["declared_in"]).split()]
    else:
        words = ["quantization:", str(q["quant_method"]), "(no", "scheme", "table", "matches)"]
    print_fields(con, words)


def _render_mtp_quant(con, quant: dict) -> None:
    """Per MTP module: stored as what versus what the config declares; routed experts that agree share a row.
    Its problems are listed with the other findings (rule mtp-quant-config)."""
    from ..model.quant.report import collapsed, declared_text

    rows = []
    for name, m, n in collapsed(quant["modules"]):
        label = f"{name} (x{n})" if n > 1 else name
        mark = ("ok" + (" (release convention)" if m["exempt"] else "")) if m["ok"] else "problem"
        rows.append([label, _label(m["stored"]["label"]), declared_text(m["declared"]), mark])
    print_table(con, MODULE_COLUMNS, rows, title="MTP modules: stored vs declared (quantization config)")


def _render_status(con, status: dict, count: int) -> None:
    """What of the declared MTP set is there: complete, or how much is missing, per role."""
    if status["complete"] and not (status["extra"] or status["beyond"]):
        note = f"; optional absent: {len(status['optional_absent'])}" if status["optional_absent"] else ""
        con.print(f"[green]MTP set complete[/] ({count} layer(s)){note}")
        return
    parts = []
    if status["missing"]:
        by_role = Counter(m["role"] for m in status["missing"])
        parts.append(f"{len(status['missing'])} declared tensor(s) missing ("
                     + ", ".join(f"{role} {n}" for role, n in by_role.items()) + ")")
    for what, name in (("misshaped", "mis-shaped"), ("missing_scales", "without their scale"),
                       ("extra", "not in the table"), ("beyond", "past the declared count")):
        if status[what]:
            parts.append(f"{len(status[what])} {name}")
    con.print(f"[yellow]MTP set incomplete[/] ({count} layer(s) declared): " + "; ".join(parts))


def _file(where: str | None, root: str) -> list[str]:
    """The file a finding is in, relative to the checkpoint (as validate names it)."""
    return [where[len(root) + 1:] if where.startswith(root.rstrip("/") + "/") else where] if where else []


# rules whose findings repeat one message per key: the first in full, the other keys below it
KEYED_RULES = frozenset({"mtp-missing", "trunk-missing", "mtp-beyond", "mtp-extra", "fp8-scale-missing"})


def _render_findings(con, path: str, findings: list[dict], notes: list[dict]) -> None:
    """Every problem other verbs refuse the checkpoint for, per rule (a rule of ``KEYED_RULES``: its first
    finding in full, then only the keys); notes without a key (e.g. mtp-none) in full; keyed notes are
    counted above (optional absent)."""
    for n in notes:
        if n["key"] is None:
            print_fields(con, ["note:", n["rule"], *n["message"].split()], styles=["yellow", "bold"])
    if not findings:
        return
    by_rule: dict[str, list[dict]] = {}
    for f in findings:
        by_rule.setdefault(f["rule"], []).append(f)
    counts = ", ".join(f"{rule} x{len(fs)}" if len(fs) > 1 else rule for rule, fs in by_rule.items())
    con.print(f"[bold red]{len(findings)} finding(s)[/] ({counts}): other verbs refuse this checkpoint until "
              "they are fixed (or `--allow-invalid RULE`)")
    shown = 0
    for rule, fs in by_rule.items():
        for i, f in enumerate(fs):
            if shown >= MAX_ROWS:
                con.print(f"    ... and {len(fs) - i} more {rule} (all of them with --json)")
                break
            key = [f"{f['key']}:"] if f["key"] else []
            if i and rule in KEYED_RULES:
                print_fields(con, [" " * (INDENT - 1), f["key"] or f["message"]])
            else:
                print_fields(con, [rule, *_file(f["path"], path), *key, *f["message"].split()], styles=["bold"])
            shown += 1
    con.print(f"`ckpt validate {path}` lists them with their files", markup=False, highlight=False)


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


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    @command
    @takes(Inspect)
    def inspect_cmd(path: str = typer.Argument(..., metavar="PATH", help=PATH_HELP), **o) -> None:
        """Show a checkpoint's MTP layers: roles, experts, shards, dtypes, parameters and bytes, and what other
        verbs would refuse it for (exit 0 whenever it can be read: `ckpt validate` is the check)."""
        from .. import api

        json_output, discover, write, arch = o.pop("json"), o.pop("discover"), o["write"], o["arch"]
        if path.endswith(".gguf") and not (discover or write):  # llama.cpp's format: metadata, against the tables
            from .gguf_render import show_inspect

            show_inspect(api.inspect_gguf(path, arch=arch), json_output)
            return
        report = api.inspect(path, **o, discover=discover or write is not None, progress=not json_output)
        say_allowed(report.allowed_invalid)
        if json_output:
            emit_json(report.to_json())
        elif discover or write is not None:
            _render_discovery(report)
        else:
            render(report)
