"""`ckpt probe VERIFIER [--draft DRAFT ...]`: per-depth agreement, KL and the greedy-loop check of MTP drafts."""

from __future__ import annotations

import sys
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
        arch: str = typer.Option(None, "--arch", help="The drafts' family when their files do not prove it "
                                                      "(a trainer's output without config.json), as stitch's --arch."),
        engine: str = typer.Option(
            "transformers", "--engine",
            help="transformers (our table engine around transformers' model: agreement, KL, per prompt), vllm "
                 "(vLLM serves each MTP and counts its own acceptance; needs the extra ckpt-tools[vllm]) or "
                 "llama.cpp (VERIFIER a GGUF file, each --draft an MTP sidecar GGUF; llama.cpp's "
                 "llama-speculative-simple counts its own acceptance)."),
        llama_cpp: Path = typer.Option(None, "--llama-cpp", metavar="DIR",
                                       help="--engine llama.cpp: a llama.cpp build holding llama-speculative-simple "
                                            "(in DIR, DIR/bin or DIR/build/bin; default: PATH)."),
        threads: int = typer.Option(1, "--threads", help="--engine llama.cpp: llama.cpp's threads (-t)."),
        tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="--engine vllm: GPUs per stage."),
        pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size",
                                                   help="--engine vllm: pipeline stages (e.g. nodes)."),
        distributed_executor_backend: str = typer.Option(
            None, "--distributed-executor-backend", help="--engine vllm: mp (one node) or ray (several nodes)."),
        work_dir: Path = typer.Option(
            None, "--work-dir", help="--engine vllm: where each --draft is stitched into a hard-linked copy of the "
                                     "verifier (default: the system temp directory; same filesystem as the verifier)."),
        max_model_len: int = typer.Option(None, "--max-model-len",
                                          help="--engine vllm: vLLM's context length (default: the config's)."),
        attention_backend: str = typer.Option(None, "--attention-backend",
                                              help="--engine vllm: vLLM's attention backend (e.g. CPU_MLA)."),
        json_output: bool = json_option(),
        report_file: Path = report_option(),
        plot: Path = typer.Option(None, "--plot", metavar="FILE.png",
                                  help="Draw acceptance per depth of every MTP measured (and KL) into this PNG; "
                                       "needs the extra ckpt-tools[plot]."),
    ) -> None:
        """Measure that the MTP layers draft: teacher-forced agreement with the verifier's greedy tokens per depth,
        KL to its distribution, and that generate(use_mtp=True) equals plain greedy. Exit 1 on a greedy mismatch
        or when --min-acceptance is not met."""
        from .. import api
        from ..api.measure import displaying
        from ..errors import CheckFailed

        bar = PromptBar(enabled=not json_output and sys.stderr.isatty())
        try:
            with bar, displaying(bar, None if json_output else _announce(dtype)):
                report = api.probe(verifier, drafts=drafts, prompts=prompts, max_new_tokens=max_new_tokens,
                                   depth=depth, device=device, dtype=dtype, chain=chain,
                                   min_acceptance=min_acceptance, report=report_file, arch=arch,
                                   progress=not json_output, engine=engine,
                                   tensor_parallel_size=tensor_parallel_size,
                                   pipeline_parallel_size=pipeline_parallel_size,
                                   distributed_executor_backend=distributed_executor_backend, work_dir=work_dir,
                                   max_model_len=max_model_len, attention_backend=attention_backend, plot=plot,
                                   llama_cpp=llama_cpp, threads=threads)
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
    loaded = result.loaded if result.loaded == result.mtp_loaded else f"{result.loaded}; MTP {result.mtp_loaded}"
    out_console().print(f"verifier loaded {loaded}", markup=False, soft_wrap=True)
    for d in result.drafts:
        if d.mean_acceptance_length is not None:
            out_console().print(f"{d.name}: mean acceptance length {d.mean_acceptance_length:.3f} over {d.num_drafts} "
                                f"draft(s) ({result.engine.get('name')} {result.engine.get('version')})",
                                markup=False, soft_wrap=True)
