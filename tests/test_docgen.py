"""Each option declared once (ckpt_tools/api/options.py): the typer options, the API's keywords and defaults, and
docs/verbs.md's option tables all come from that declaration; the committed tables are the generated ones."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import typer.main

from ckpt_tools import api
from ckpt_tools.api import options
from ckpt_tools.cli import app
from tools import docgen

VERBS_MD = Path(__file__).resolve().parent.parent / "docs" / "verbs.md"
# verb -> its declarations, and those the API function does not take (the CLI's own, or another function's)
DECLARED = {
    "inspect": (options.Inspect, {"json"}),
    "validate": (options.Validate, {"json", "gguf_trunk"}),
    # extract_gguf's: the sidecar's trunk and type, and how --gguf-type auto measures
    "extract": (options.Extract, {"json", "gguf_trunk", "gguf_type", "prompts", "max_drop", "depth", "max_new_tokens"}),
    "fuse_experts": (options.FuseExperts, {"json"}),
    "unfuse_experts": (options.UnfuseExperts, {"json"}),
    "dequant": (options.Dequant, {"json"}),
    "stitch": (options.Stitch, {"json", "all"}),
    "graft": (options.Graft, {"json", "all"}),
    "diff": (options.Diff, {"json"}),
    "probe": (options.Probe, {"json"}),
    "init_draft": (options.InitDraft, {"json"}),
    "push": (options.Push, {"json"}),
}


def test_docs_verbs_md_option_tables_are_the_generated_ones():
    text = VERBS_MD.read_text()
    assert docgen.BEGIN in text and docgen.END in text, "docs/verbs.md lost the markers of its generated tables"
    assert docgen.render(text) == text, f"docs/verbs.md's option tables are stale: run `{docgen.REGENERATE}`"


def test_every_option_of_every_verb_is_in_its_table():
    text = VERBS_MD.read_text()
    commands = typer.main.get_command(app).commands
    assert len(commands) >= 15
    for name, command in commands.items():
        section = text.partition(f"### `ckpt {name}`\n")[2].partition("\n### ")[0]
        rows = [line for line in section.splitlines() if line.startswith("| `")]
        assert len(rows) == len(command.params), name
        for p in (p for p in command.params if p.opts[0].startswith("-")):
            assert any(f"`{opt}" in row.split(" | ")[0] or f" {opt}" in row.split(" | ")[0]
                       for row in rows for opt in p.opts), (name, p.opts)
    # options no page documented before the tables were generated
    for verb, flag in [("push", "--force"), ("push", "--private"), ("push", "--revision"), ("push", "-m"),
                       ("extract", "--verifier-name"), ("extract", "--no-embed"), ("stitch", "--format"),
                       ("stitch", "--layers"), ("stitch", "--update-copies")]:
        section = text.partition(f"### `ckpt {verb}`\n")[2].partition("\n### ")[0]
        assert f"{flag}" in section, (verb, flag)


@pytest.mark.parametrize("verb", sorted(DECLARED))
def test_the_api_keywords_and_their_defaults_are_the_declared_ones(verb):
    declared, not_api = DECLARED[verb]
    params = inspect.signature(getattr(api, verb)).parameters
    keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - {"progress"}
    names = {o.name for o in options.declared(declared)}
    assert keywords <= names - not_api, sorted(keywords - names)
    assert names - not_api <= set(params), sorted(names - not_api - set(params))
    for o in options.declared(declared):
        if o.name in params and params[o.name].default is not inspect.Parameter.empty:
            assert params[o.name].default == o.default, (verb, o.name)
    if verb == "extract":  # --format gguf's function
        gguf = inspect.signature(api.extract_gguf).parameters
        for name in ("gguf_type", "prompts", "max_drop", "depth", "max_new_tokens"):
            assert gguf[name].default == getattr(options.Extract, name), name


def test_no_command_declares_an_option_of_its_own():
    """Every option comes from api/options.py (--max-shard-size, --dry-run, --arch were inline in 6-9 commands)."""
    inline = [p.name for p in (VERBS_MD.parent.parent / "ckpt_tools" / "cli").glob("*.py") if "typer.Option(" in
              p.read_text() and p.name != "options.py" and p.name != "__init__.py"]  # __init__: the global --debug
    assert not inline, inline
