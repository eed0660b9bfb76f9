"""`ckpt probe VERIFIER [--draft DRAFT ...]`: per-depth agreement, KL and the greedy-loop check of MTP drafts."""

from __future__ import annotations

import typer

from .common import command, emit_json, err_console, human_bytes, out_console
from .write_options import json_option


def register(app: typer.Typer) -> None:
    @app.command("probe")
    @command
    def probe_cmd(
        verifier: str = typer.Argument(..., help="The verifier checkpoint (a local directory transformers loads)."),
        drafts: list[str] = typer.Option([], "--draft", help="A draft in any format stitch accepts; repeatable."),
        prompts: str = typer.Option(None, "--prompts", help='FILE.jsonl ({"prompt": ...} or {"input_ids": [...]} '
                                                            "per line) or a text file, one prompt a line."),
        max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens the verifier generates per prompt."),
        depth: int = typer.Option(1, "--depth", help="Chain depth K: agreement is measured for depths 1..K."),
        device: str = typer.Option("cpu", "--device", help="torch device for the verifier and the drafts."),
        dtype: str = typer.Option("fp32", "--dtype", help="bf16 or fp32."),
        json_output: bool = json_option(),
    ) -> None:
        """Measure that the MTP layers draft: teacher-forced agreement with the verifier's greedy tokens per depth,
        KL to its distribution, and that generate(use_mtp=True) equals plain greedy. Exit 1 on a greedy mismatch."""
        from ..ops.probe import ProbeRequest, probe

        req = ProbeRequest(verifier, list(drafts), prompts, max_new_tokens, depth, device, dtype)
        result = probe(req, None if json_output else _progress)
        if json_output:
            emit_json(result.to_json())
        else:
            _render(result, depth)
        bad = [d for d in result.drafts if not d.greedy_equal]
        for d in bad:
            err_console().print(f"{d.name}: generate(use_mtp=True) differs from greedy at prompt "
                                f"{d.mismatch['prompt']}, generated position {d.mismatch['position']}",
                                markup=False, soft_wrap=True)
        raise typer.Exit(1 if bad else 0)


def _progress(done: int, total: int) -> None:
    err_console().print(f"prompt {done}/{total}", markup=False)


def _render(result, depth: int) -> None:
    from rich.table import Table

    t = Table(title=f"probe: {result.prompts} prompt(s), verifier needs {human_bytes(result.needed_bytes)}")
    t.add_column("draft", overflow="fold")
    for k in range(1, depth + 1):
        t.add_column(f"agree@{k}")
        t.add_column(f"KL@{k}")
    for col in ("E[accepted]/step", "positions", "greedy equal"):
        t.add_column(col)
    for d in result.drafts:
        cells = [c for a, kl in zip(d.agreement, d.kl, strict=True) for c in (f"{a:.3f}", f"{kl:.4f}")]
        t.add_row(d.name, *cells, f"{d.expected_accepted():.3f}", str(d.positions), "yes" if d.greedy_equal else "NO")
    out_console().print(t)
