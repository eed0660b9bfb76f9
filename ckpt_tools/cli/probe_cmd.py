"""`ckpt probe VERIFIER [--draft DRAFT ...]`: per-depth agreement, KL and the greedy-loop check of MTP drafts."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import typer

from .common import command, emit_json, err_console, human_bytes, out_console
from .write_options import json_option, report_option


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
        device: str = typer.Option("cpu", "--device", help="cpu, cuda or auto (cuda when torch sees a GPU)."),
        dtype: str = typer.Option("fp32", "--dtype", help="bf16 or fp32."),
        chain: str = typer.Option(
            "sglang", "--chain",
            help="How depth k > 1 is chained: sglang (the post-norm hidden state feeds the next step, as SGLang and "
                 "transformers do) or vllm (the state before the MTP's final norm, as vLLM does)."),
        min_acceptance: float = typer.Option(
            None, "--min-acceptance",
            help="Exit 1 when the depth-1 agreement of a draft (of the verifier's own MTP when no --draft) is below."),
        json_output: bool = json_option(),
        report_file: Path = report_option(),
    ) -> None:
        """Measure that the MTP layers draft: teacher-forced agreement with the verifier's greedy tokens per depth,
        KL to its distribution, and that generate(use_mtp=True) equals plain greedy. Exit 1 on a greedy mismatch
        or when --min-acceptance is not met."""
        from ..errors import UsageError
        from ..jsonutil import write_json_file
        from ..ops.probe import ProbeRequest, probe, resolve_device, transformers_module

        if min_acceptance is not None and not 0 <= min_acceptance <= 1:  # nan fails both comparisons
            raise UsageError(f"--min-acceptance {min_acceptance!r}: expected a number from 0 to 1")
        inputs = [verifier, *drafts]
        if report_file is not None:
            from ..options import outside_inputs

            outside_inputs("--report", report_file, inputs)  # before anything is loaded
        device = resolve_device(device)
        transformers_module()  # a missing extra is one line, before anything else
        req = ProbeRequest(verifier, list(drafts), prompts, max_new_tokens, depth, device, dtype, chain)
        with PromptBar(enabled=not json_output and sys.stderr.isatty()) as bar, _quiet_transformers(json_output):
            result = probe(req, bar, None if json_output else _announce(dtype))
        data = result.to_json()
        if report_file is not None:
            write_json_file(report_file, data, "--report", inputs)
        if json_output:
            emit_json(data)
        else:
            _render(result, depth)
        bad = [d for d in result.drafts if not d.greedy_equal]
        for d in bad:
            err_console().print(f"{d.name}: generate(use_mtp=True) differs from greedy at prompt "
                                f"{d.mismatch['prompt']}, generated position {d.mismatch['position']}",
                                markup=False, soft_wrap=True)
        low = below_min_acceptance(result, min_acceptance)
        for d in low:
            err_console().print(f"{d.name}: depth-1 agreement {d.agreement[0]:.4f} is below --min-acceptance "
                                f"{min_acceptance}", markup=False, soft_wrap=True)
        raise typer.Exit(1 if bad or low else 0)


def _announce(dtype: str):
    """Before loading: how much memory the weights need (stderr; the table and --json repeat the number)."""
    def say(need: int, available: int) -> None:
        free = f", {human_bytes(available)} available" if available else ""
        err_console().print(f"loading the verifier: its weights need {human_bytes(need)} in {dtype}{free}",
                            markup=False, soft_wrap=True)

    return say


def below_min_acceptance(result, minimum: float | None) -> list:
    """The compared drafts (the verifier's own MTP when there is no --draft) whose depth-1 agreement < minimum."""
    if minimum is None:
        return []
    checked = result.drafts[1:] or result.drafts[:1]
    return [d for d in checked if d.agreement[0] < minimum]


@contextlib.contextmanager
def _quiet_transformers(quiet: bool) -> Iterator[None]:
    """With --json, transformers' own progress bars (loading weights) stay off stderr too."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as tf_logging

    was = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tf_logging.enable_progress_bar()


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
        cells = [c for a, kl in zip(d.agreement, d.kl, strict=True) for c in (f"{a:.3f}", f"{kl:.4f}")]
        t.add_row(d.name, *cells, f"{d.expected_accepted():.3f}", str(d.positions), "yes" if d.greedy_equal else "NO")
    out_console().print(t)
