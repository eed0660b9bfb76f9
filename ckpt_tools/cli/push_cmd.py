"""`ckpt push DIR REPO_ID`: validate, write a model card, upload only what the Hub does not have."""

from __future__ import annotations

from pathlib import Path

import typer

from ..api.options import Push
from .common import command, emit_json, err_console, human_bytes, out_console
from .options import takes


def render(plan, result) -> None:
    from rich.markup import escape

    from .layout import print_fields

    con = out_console()
    req = plan.request
    styles = {"add": "yellow", "copy": "cyan", "delete": "red", "unchanged": "dim"}
    for o in plan.ops:  # a path and its source are never broken: the source goes below when both do not fit
        src = o.to_json(req.base).get("from")
        if src and src.endswith(f":{o.path}"):
            src = src[: -len(o.path) - 1]  # the same path in the base repository: its name is said once
        elif o.local is not None and o.local == req.folder / o.path:
            src = None  # the upload of DIR's own file: nothing to add
        print_fields(con, [f"{o.kind:<9}", f"{human_bytes(o.size):>10} ", o.path, *([f"<- {src}"] if src else [])],
                     styles=(styles[o.kind], "", "", "dim"))
    where = f"{req.repo_id}@{req.revision or 'main'}" + (" (new pull request)" if req.create_pr else "")
    if not plan.repo_exists:
        where += " (repository will be created" + (", private)" if req.private else ")")
    v = plan.validation
    if v is not None:
        con.print("validation: " + ("[green]ok[/]" if v.ok else f"[red]{len(v.problems)} problem(s)[/] (--force)"))
    con.print(f"model card: {plan.card_action}")
    probe = plan.to_json()["probe"]
    if probe is not None:
        con.print(f"probe report: {escape(probe['report'])} (measured these tensors as "
                  f"{escape(', '.join(map(str, probe['measured'])))})" + (f", plot {escape(probe['plot'])}"
                                                                        if probe["plot"] else ""), soft_wrap=True)
    for note in plan.notes:
        con.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    con.print(
        f"{'would push' if req.dry_run else 'pushed'} to {escape(where)}: "
        f"{plan.count('add')} upload(s), {human_bytes(plan.upload_bytes)} ({plan.upload_bytes} bytes); "
        f"{plan.count('copy')} server-side cop(ies), {human_bytes(plan.copy_bytes)} not uploaded; "
        f"{plan.count('delete')} delete(s); {plan.count('unchanged')} unchanged", soft_wrap=True,
    )
    if result is not None:
        if result.method == "nothing":
            con.print("nothing to commit: the repository already holds these files")
        elif result.pr_url:
            con.print(f"pull request: {result.pr_url}", soft_wrap=True)
        elif result.commit_url:
            con.print(f"commit: {result.commit_url}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("push")
    @command
    @takes(Push)
    def push_cmd(
        folder: Path = typer.Argument(..., metavar="DIR",
                                      help="Checkpoint directory to publish (a ckpt output or any checkpoint)."),
        repo_id: str = typer.Argument(..., metavar="REPO_ID", help="Target repository, ORG/NAME."),
        **o,
    ) -> None:
        """Validate DIR, generate its model card and publish it to the Hub (token from HF_TOKEN / hf auth login)."""
        from .. import api
        from .write_options import invoked

        json_output = o.pop("json")
        if not json_output and not o["dry_run"]:
            err_console().print(f"pushing {folder} to {repo_id} ...")
        with invoked():
            report = api.push(folder, repo_id, progress=not json_output, **o)
        if json_output:
            emit_json(report.to_json())
        else:
            render(report.plan, report.result)
