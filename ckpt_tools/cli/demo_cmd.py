"""`ckpt demo`: the tool end to end on a tiny checkpoint generated on the spot."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import typer

from ..api.options import Demo
from .common import command, err_console, out_console
from .options import takes


def _demo_family() -> str:
    """The table marked ``demo: true`` (family knowledge lives in the tables), else the first with MTP."""
    from ..model.tables.loader import all_tables

    tables = sorted(all_tables().values(), key=lambda t: t.family)
    marked = [t.family for t in tables if t.demo]
    return (marked or [t.family for t in tables if t.kind == "mtp" and t.fixture])[0]


def register(app: typer.Typer) -> None:
    @app.command("demo")
    @command
    @takes(Demo)
    def demo(**o) -> None:
        """Build a tiny checkpoint, then inspect, validate, extract, perturb, stitch and diff it."""
        import click

        from ..testing import make_checkpoint

        family, keep = o["family"], o["keep"]
        if family is None:
            family = _demo_family()
        console = out_console()
        root = Path(tempfile.mkdtemp(prefix="ckpt-demo-")) if keep is None else keep
        root.mkdir(parents=True, exist_ok=True)
        cli = typer.main.get_command(app)

        def step(title: str, *args: str, ok=(0,)) -> None:
            console.rule(f"[bold]{title}[/]  ckpt {' '.join(args)}")
            try:  # without standalone mode click returns an Exit's code instead of raising it
                code = cli.main(list(args), standalone_mode=False)
            except (click.exceptions.Exit, SystemExit) as e:
                code = e.exit_code if isinstance(e, click.exceptions.Exit) else e.code
            code = code or 0  # a command that returns normally gives None
            if code not in ok:
                err_console().print(f"demo stopped: step {title!r} (ckpt {' '.join(args)}) exited {code}",
                                    markup=False, soft_wrap=True)
                raise typer.Exit(code if isinstance(code, int) else 1)

        try:
            verifier = make_checkpoint(family, root / "verifier")
            console.print(f"a tiny {family} checkpoint (real key names, 4 shards, MTP split across two) in {verifier}")
            step("what is in it", "inspect", str(verifier))
            step("is it sound", "validate", str(verifier))
            step("MTP layer -> native draft", "extract", str(verifier), "-o", str(root / "draft"))
            step("trunk without MTP", "extract", str(verifier), "-o", str(root / "trunk"), "--drop-mtp")
            step("draft back into the verifier", "stitch", str(root / "draft"), str(verifier), "-o",
                 str(root / "stitched"))
            step("byte-identical?", "diff", str(verifier), str(root / "stitched"))
            step("draft added to the trunk", "stitch", str(root / "draft"), str(root / "trunk"), "-o",
                 str(root / "restored"))
            step("same as the original?", "diff", str(verifier), str(root / "restored"))
        finally:
            if keep is None:
                shutil.rmtree(root, ignore_errors=True)
        console.rule("[bold green]demo finished[/]")
