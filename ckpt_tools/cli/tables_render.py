"""`ckpt tables` on the terminal: one row per family with the columns the width allows, and one family in full
(`ckpt tables FAMILY`: its templates and why a format does not apply)."""

from __future__ import annotations

from .layout import Col, print_table

# the MTP prefix templates and the longest architecture names leave first: the family view has them
COLUMNS = (Col("family", "id"), Col("kind", "id"), Col("title", drop=2), Col("formats", "ids"),
           Col("vLLM MTP class (check)", "ids", drop=1), Col("llama.cpp (check)", "ids", drop=1),
           Col("architectures / model_type", "ids", drop=3),
           Col("MTP prefix", "id", drop=4))


def _vllm_cell(r: dict) -> str:
    v = r.get("vllm")
    return f"{v['class'].rsplit('.', 1)[-1]} ({v['check']})" if v else "-"


def _llama_cpp_cell(r: dict) -> str:
    v = r.get("llama_cpp")
    return f"{v['arch']} ({v['check']})" if v else "-"


def _probe_cell(r: dict) -> str:
    ours = ("yes+ref" if r["probe_reference"] else "yes") if r["probe"] else "-"
    v = r.get("vllm")
    return f"{ours} / vllm {v['check']}" if v else ours


def render_tables(rows: list[dict], probe: bool) -> None:
    from .common import out_console

    con = out_console()
    cols = COLUMNS + ((Col("probe", "id"),) if probe else ())
    cells = []
    for r in rows:
        ok = [f for f, why in r["formats"].items() if why == "ok"]
        cells.append([r["family"], r["kind"], r["title"] or "", ", ".join(ok) or "-", _vllm_cell(r), _llama_cpp_cell(r),
                      ", ".join(r["architectures"] + r["model_types"]), r["mtp_prefix"],
                      *((_probe_cell(r),) if probe else ())])
    dropped = print_table(con, cols, cells, title="architecture tables")
    left_out = f"; left out at this width: {', '.join(dropped)}" if dropped else ""
    con.print(f"`ckpt tables FAMILY` shows one family in full{left_out}", markup=False)


def render_family(r: dict) -> None:
    """Every field of one family; a value wraps between words, never inside one."""
    from rich.table import Table
    from rich.text import Text

    from .common import out_console

    con = out_console()
    con.print(Text.assemble((r["family"], "bold"), f": {r['title']} ({r['kind']})" if r["title"] else ""))
    t = Table.grid(padding=(0, 2))
    t.add_column(no_wrap=True)
    t.add_column(overflow="fold")
    fields = [("architectures", ", ".join(r["architectures"]) or "-"),
              ("model types", ", ".join(r["model_types"]) or "-"), ("MTP prefix", r["mtp_prefix"]),
              ("norm", r["norm"]), ("fusion input", str(r["concat_order"]).replace("_", "-"))]
    fields += [("formats" if i == 0 else "", f"{name}: {why}") for i, (name, why) in enumerate(r["formats"].items())]
    v = r.get("vllm")
    if v:
        fields.append(("vLLM", f"{v['class']} ({v['architecture']}), checked: {v['check']}"
                               + (f", {v['depths']} depth(s) built" if "depths" in v else "")))
        if "note" in v:
            fields.append(("", v["note"]))
    lc = r.get("llama_cpp")
    if lc:
        lacks = [*lc.get("package_lacks", []), *lc.get("names", [])]
        source = ("the table's tensor_map" if "tensor_map" in lc else f"gguf {lc['tensor_arch']}") + (
            f"; the gguf package lacks {', '.join(lacks)}" if lacks else "")
        fields.append(("llama.cpp", f"{lc['arch']} (names from {source}), checked: {lc['check']}"))
        if "note" in lc:
            fields.append(("", lc["note"]))
    if "probe" in r:
        fields.append(("probe", (f"yes{' (checked against transformers MtpModel)' if r['probe_reference'] else ''}"
                                 if r["probe"] else f"no ({r.get('probe_reason', '')})")))
        fields += [("", f"{engine}: {what or '-'}") for engine, what in r.get("probe_engines", {}).items()]
    for name, value in fields:
        t.add_row(name, Text(value))
    con.print(t)
