"""GGUF files on the terminal: `ckpt inspect X.gguf` and `ckpt validate X.gguf [--gguf-trunk TRUNK.gguf]`."""

from __future__ import annotations

from .common import emit_json, out_console

KINDS = {"trunk": "a trunk (no MTP layers)", "mtp-sidecar": "an MTP sidecar (llama.cpp -md)",
         "trunk+mtp": "a trunk with its MTP layers", "no-blocks": "no layer tensors"}


def render_summary(s) -> None:
    from rich.markup import escape

    con = out_console()
    con.print(f"[bold]{escape(s.path)}[/]: {KINDS.get(s.kind, s.kind)}")
    fam = s.family or (", ".join(s.families) if s.families else "no table")
    con.print(f"llama.cpp architecture [bold]{s.arch}[/] (family {fam}); block_count {s.block_count}, "
              f"nextn_predict_layers {s.nextn_predict_layers}, trunk layers {s.trunk_layers}", soft_wrap=True)
    types = ", ".join(f"{k} {v}" for k, v in s.types.items())
    con.print(f"{s.tensors} tensors ({types}); shared: {', '.join(s.shared) or '-'}", soft_wrap=True)
    for bid, m in s.mtp.items():
        con.print(f"MTP block {bid}: {len(m['present'])} tensors; missing {len(m['missing'])}, unexpected "
                  f"{len(m['unexpected'])}")
        for k in m["missing"]:
            con.print(f"    missing    {k}", markup=False)
        for k in m["unexpected"]:
            con.print(f"    unexpected {k}", markup=False)


def show_inspect(report, json_output: bool) -> None:
    if json_output:
        emit_json(report.to_json())
        return
    render_summary(report.summary)
    for p in report.summary.problems:
        out_console().print(f"{p.rule} {p.key or ''}: {p.message}", markup=False, soft_wrap=True)


def show_validate(report, json_output: bool) -> None:
    if json_output:
        emit_json(report.to_json())
        return
    con = out_console()
    render_summary(report.summary)
    for p in report.problems:
        con.print(f"[bold red]{p.rule}[/] {p.key or ''}", soft_wrap=True)
        con.print(f"    {p.message}", markup=False, soft_wrap=True)
    pair = f" with trunk {report.trunk}" if report.trunk else ""
    if report.ok:
        con.print(f"[green]valid[/]: {report.summary.path}{pair}")
    else:
        con.print(f"[red]invalid[/]: {len(report.problems)} problem(s){pair}")
