"""`ckpt probe VERIFIER [--draft DRAFT ...]`: per-depth agreement, KL and the greedy-loop check of MTP drafts."""

from __future__ import annotations

import sys

import typer

from ..api.options import Probe
from .common import command, emit_json, err_console, human_bytes, out_console
from .options import takes


def register(app: typer.Typer) -> None:
    @app.command("probe")
    @command
    @takes(Probe)
    def probe_cmd(
        verifier: str = typer.Argument(..., help="The verifier checkpoint (a local directory transformers loads)."),
        **o,
    ) -> None:
        """Measure that the MTP layers draft: teacher-forced agreement with the verifier's greedy tokens per depth,
        KL to its distribution, and that generate(use_mtp=True) equals plain greedy. Exit 1 on a greedy mismatch
        or when --min-acceptance is not met."""
        from .. import api
        from ..api.measure import displaying
        from ..errors import CheckFailed

        json_output, depth = o.pop("json"), o["depth"]
        bar = PromptBar(enabled=not json_output and sys.stderr.isatty())
        try:
            with bar, displaying(bar, None if json_output else _announce(o["dtype"])):
                report = api.probe(verifier, progress=not json_output, **o)
        except CheckFailed as e:  # measured, and a check failed: the report as for a pass, each failure, exit 1
            _show(e.report, json_output, depth)
            for line in e.report.failures():
                err_console().print(line, markup=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        _show(report, json_output, depth)


def _show(report, json_output: bool, depth: int) -> None:
    if json_output:
        emit_json(report.to_json())
    else:
        _render(report, depth)


def _announce(dtype: str):
    """Before loading: how much memory the weights need (stderr; the table and --json repeat the number)."""
    def say(need: int, available: int) -> None:
        free = f", {human_bytes(available)} available" if available else ""
        err_console().print(f"loading the verifier: its weights need {human_bytes(need)} in {dtype}{free}",
                            markup=False, soft_wrap=True)

    return say


class PromptBar:
    """A rich progress bar over prompts on stderr (nothing when disabled: --json, or stderr not a terminal).

    ``probe`` calls it with (0, total) before the first prompt and (i, total) after each."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._p = None
        self._task = None

    def __enter__(self) -> PromptBar:
        return self

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._p is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

            self._p = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), TimeRemainingColumn(), console=err_console(), transient=True)
            self._p.start()
            self._task = self._p.add_task("prompts", total=total)
        self._p.update(self._task, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


def _render(result, depth: int) -> None:
    from rich.table import Table

    t = Table(title=f"probe: {result.prompts} prompt(s), verifier needs {human_bytes(result.needed_bytes)}, "
                    f"depth chained as {result.chain}")
    t.add_column("draft", overflow="fold")
    for k in range(1, depth + 1):
        t.add_column(f"agree@{k}")
        t.add_column(f"KL@{k}")
    for col in ("E[accepted]/step", "positions", "greedy equal"):
        t.add_column(col)
    for d in result.drafts:
        kls = d.kl or [None] * len(d.agreement)  # vLLM measures no distribution
        cells = [c for a, kl in zip(d.agreement, kls, strict=True)
                 for c in (f"{a:.3f}", "-" if kl is None else f"{kl:.4f}")]
        t.add_row(d.name, *cells, f"{d.expected_accepted():.3f}", str(d.positions), "yes" if d.greedy_equal else "NO")
    out_console().print(t)
    if getattr(result, "mtp_quant", None):
        _render_mtp_quant(result.mtp_quant, depth)
    loaded = result.loaded if result.loaded == result.mtp_loaded else f"{result.loaded}; MTP {result.mtp_loaded}"
    out_console().print(f"verifier loaded {loaded}", markup=False, soft_wrap=True)
    for d in result.drafts:
        if d.mean_acceptance_length is not None:
            out_console().print(f"{d.name}: mean acceptance length {d.mean_acceptance_length:.3f} over {d.num_drafts} "
                                f"draft(s) ({result.engine.get('name')} {result.engine.get('version')})",
                                markup=False, soft_wrap=True)


def _render_mtp_quant(rows: list[dict], depth: int) -> None:
    """--mtp-quant: one row per scheme (measured, or the reason it is not)."""
    from rich.table import Table

    t = Table(title="the verifier's MTP per scheme (encoded as graft writes it, decoded as the engine reads it)")
    t.add_column("scheme")
    t.add_column("MTP bytes")
    for k in range(1, depth + 1):
        t.add_column(f"agree@{k}")
        t.add_column(f"KL@{k}")
    t.add_column("E[accepted]/step")
    t.add_column("change@1")
    for r in rows:
        if "agreement" not in r:
            t.add_row(r["scheme"], "-", *["-"] * (2 * depth), "-", r["status"])
            continue
        cells = [c for a, kl in zip(r["agreement"], r["kl"], strict=True) for c in (f"{a:.3f}", f"{kl:.4f}")]
        change = r.get("agreement_change") or [0.0]
        t.add_row(r["scheme"], human_bytes(r["bytes"]), *cells, f"{r['expected_accepted']:.3f}", f"{change[0]:+.3f}")
    out_console().print(t)
    for r in rows:
        if r.get("reason"):
            out_console().print(f"{r['scheme']} ({r['status']}): {r['reason']}", markup=False, soft_wrap=True)
