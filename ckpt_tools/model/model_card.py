"""A model card for a pushed checkpoint, written from what the tool knows about it.

Sources: ``ckpt_manifest.json`` (written by every ckpt output: command, tool version, sources
with revisions, family, format), ``stitch-report.json`` when present, ``config.json`` (family
and MTP depth through the tables) and the ``ckpt validate`` report. The metadata block uses
huggingface_hub's ``ModelCardData`` (``base_model``, ``base_model_relation``, tags), so the Hub
links the card into the base model's tree.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..io.config import ConfigView
from .card_probe import ProbeEvidence, auto_markdown, eval_results, markdown

REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DRAFT_KINDS = ("mtp-draft", "draft")
GGUF_KIND = "mtp-gguf-sidecar"  # ckpt extract --format gguf's manifest kind


@dataclass
class CardFacts:
    """Everything the card says, gathered before rendering (tests and --json read it too)."""

    repo_id: str
    kind: str  # mtp-draft | stitched | trunk | experts | checkpoint
    family: str | None
    mtp_count: int
    base_model: list[str] = field(default_factory=list)
    base_model_relation: str | None = None
    tags: list[str] = field(default_factory=list)
    command: str | None = None
    tool_version: str | None = None
    sources: list[dict] = field(default_factory=list)  # {"role", "path", "revision"}
    draft_format: str | None = None
    validation_ok: bool | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # validate's notes (e.g. per-layer copies left out)
    stitch_summary: dict | None = None
    engines: dict[str, str] = field(default_factory=dict)  # the family table's serving engines (``engines:``)
    probe: ProbeEvidence | None = None  # a probe report of these tensors (ops.publish.probe_evidence)
    vllm_method: str | None = None  # vLLM's speculative method, as ckpt probe --engine vllm passes it (ops sets it)
    # a GGUF directory (ops.publish.gguf_publish.gguf_facts): files, trunk, llama_cpp_arch, nextn_predict_layers ...
    gguf: dict | None = None
    mtp_quant_auto: dict | None = None  # the manifest's: the MTP's storage chosen by measuring (--mtp-quant auto)


def _sources(manifest: dict) -> list[dict]:
    """Every ``{"path", "revision"}`` the manifest names: ``source``, ``sources``, ``verifier``, ``draft``..."""
    out: list[dict] = []

    def add(role: str, v) -> None:
        if isinstance(v, dict) and isinstance(v.get("path"), str):
            out.append({"role": role, "path": v["path"], "revision": v.get("revision")})
        elif isinstance(v, str) and v:
            out.append({"role": role, "path": v, "revision": None})

    for key, value in manifest.items():
        if key in ("tensors", "expert_groups"):
            continue
        if key == "sources" and isinstance(value, list):
            for v in value:
                add(v.get("role", "source") if isinstance(v, dict) else "source", v)
        elif key == "sources" and isinstance(value, dict):
            for role, v in value.items():
                add(role, v)
        elif isinstance(value, dict) and "path" in value:
            add(key, value)
    return out


def _mtp_facts(config: ConfigView | None) -> tuple[str | None, int, dict[str, str]]:
    """(family, MTP depth, the table's serving engines) from the tables; (model_type, 1, {}) when no table
    matches."""
    if config is None or not config.raw:
        return None, 1, {}
    try:
        from .tables.loader import detect_table
        from .tables.resolve import resolve

        table = detect_table(config)
        return table.family, max(resolve(table, config).mtp_count, 1), dict(table.engines)
    except Exception:  # an unknown family still gets a card
        types = config.model_types() if hasattr(config, "model_types") else []
        return (types[0] if types else None), 1, {}


def gather(repo_id: str, folder: Path, *, manifest: dict | None, stitch_report: dict | None,
           validation=None, base: str | None = None, probe: ProbeEvidence | None = None) -> CardFacts:
    manifest = manifest or {}
    config = None
    if (folder / "config.json").is_file():
        try:
            config = ConfigView.from_bytes((folder / "config.json").read_bytes(), str(folder / "config.json"))
        except Exception:
            config = None
    family, depth, engines = _mtp_facts(config)
    family = manifest.get("family") or family
    kind = str(manifest.get("kind") or ("stitched" if stitch_report is not None else "checkpoint"))
    if stitch_report is not None and kind == "checkpoint":
        kind = "stitched"
    sources = _sources(manifest)
    if base:
        bases = [base]
    else:
        hub = [s["path"] for s in sources if REPO_ID_RE.match(s["path"])]
        roles = [s for s in sources if REPO_ID_RE.match(s["path"]) and s["role"] in ("verifier", "base")]
        bases = [roles[0]["path"]] if roles else list(dict.fromkeys(hub))
    relation = None
    if bases:
        if "stitch" in kind:
            relation = "finetune"  # a verifier whose MTP layers were retrained
        elif manifest.get("quantized_to"):
            relation = "quantized"
    tags = ["mtp", "speculative-decoding", "ckpt-tools"]
    if family:
        tags.append(family.replace("_", "-"))
    if kind in DRAFT_KINDS or kind == GGUF_KIND:
        tags.append("mtp-draft")
    if kind == GGUF_KIND:
        tags += ["gguf", "llama.cpp"]
    elif "stitch" in kind:
        tags.append("stitched")
    fmt = manifest.get("format")
    if isinstance(fmt, str) and kind in DRAFT_KINDS:
        tags.append(fmt)
    facts = CardFacts(repo_id, kind, family, depth, bases, relation, list(dict.fromkeys(tags)),
                      manifest.get("command"), manifest.get("version") or manifest.get("tool_version"),
                      sources, fmt if kind in DRAFT_KINDS else None)
    if validation is not None:
        facts.validation_ok = bool(validation.ok)
        facts.problems = [str(p) for p in validation.problems]
        facts.notes = [f"`{n.key}`: {n.message}" for n in getattr(validation, "notes", [])]
    if stitch_report is not None:
        facts.stitch_summary = _stitch_summary(stitch_report)
    facts.engines = engines
    facts.probe = probe
    auto = manifest.get("mtp_quant_auto")
    facts.mtp_quant_auto = auto if isinstance(auto, dict) else None
    return facts


def _stitch_summary(report: dict) -> dict:
    """Counts per change kind (unchanged / replaced / added / removed ...) from a stitch report."""
    for key in ("totals", "summary"):
        if isinstance(report.get(key), dict):
            return {k: v for k, v in report[key].items() if isinstance(v, (int, float, str))}
    entries = report.get("tensors") or report.get("keys") or {}
    items = entries.values() if isinstance(entries, dict) else entries
    return dict(Counter(str(e.get("status") or e.get("change") or "other") for e in items if isinstance(e, dict)))


# The family table's ``engines:`` keys (mtp-layouts.md 1.9) that say an engine has a draft class for the family's
# own MTP layers; SGLang selects those classes with the NEXTN algorithm (for NextN and MTP classes alike).
VLLM_KEYS = ("vllm_mtp",)
SGLANG_KEYS = ("sglang_nextn", "sglang_mtp")
SGLANG_ALGORITHM = "NEXTN"


def speculative_tokens(f: CardFacts) -> int:
    """N of the serving commands: the depth the probe report measured for these tensors, else the config's MTP
    count."""
    return f.probe.depth if f.probe is not None and f.probe.matched else f.mtp_count


SPEC_TYPE = "draft-mtp"  # llama.cpp's speculative type for a model's own MTP layers (ops.probe.llama_cpp)


def llama_cpp_snippets(f: CardFacts) -> list[tuple[str, str]]:
    """llama.cpp's commands for a GGUF sidecar: the trunk (``-m``, named by the manifest) with the sidecar (``-md``)."""
    g = f.gguf or {}
    k = speculative_tokens(f)
    trunk = g.get("trunk") or "TRUNK.gguf"
    out: list[tuple[str, str]] = []
    for name in g.get("files") or []:
        spec = f"--spec-type {SPEC_TYPE} --spec-draft-n-max {k}"
        out += [(f"llama.cpp server (`{name}` beside the trunk `{trunk}`)",
                 f"hf download {f.repo_id} {name} --local-dir .\nllama-server -m {trunk} -md {name} {spec}"),
                ("llama.cpp, one prompt", f"llama-speculative-simple -m {trunk} -md {name} {spec} -p \"Hello\" -n 64")]
    return out


def serving_snippets(f: CardFacts) -> list[tuple[str, str]]:
    """(title, shell command) pairs to serve the pushed checkpoint with MTP speculative decoding, for the engines
    the family table lists (``engines:``); ``f.vllm_method`` is the method ``ckpt probe --engine vllm`` passes."""
    if f.gguf is not None:
        return llama_cpp_snippets(f)
    k = speculative_tokens(f)
    vllm = f.vllm_method is not None and any(key in f.engines for key in VLLM_KEYS)
    sglang = any(key in f.engines for key in SGLANG_KEYS)
    steps = (f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
    out: list[tuple[str, str]] = []
    if f.kind in DRAFT_KINDS:
        verifier = f.base_model[0] if f.base_model else "<verifier-repo>"
        if vllm:
            draft_spec = json.dumps({"method": f.vllm_method, "model": f.repo_id, "num_speculative_tokens": k})
            out.append(("vLLM (this draft next to its verifier)",
                        f"vllm serve {verifier} \\\n  --speculative-config '{draft_spec}'"))
        if sglang:
            out.append(("SGLang (this draft as the NextN draft model)",
                        f"python -m sglang.launch_server --model-path {verifier} \\\n"
                        f"  --speculative-algorithm {SGLANG_ALGORITHM} --speculative-draft-model-path {f.repo_id} "
                        f"\\\n  {steps}"))
        if vllm:
            spec = json.dumps({"method": f.vllm_method, "num_speculative_tokens": k})
            out.append(("vLLM, after stitching the draft back into the verifier (`ckpt stitch`)",
                        f"vllm serve ./stitched --speculative-config '{spec}'"))
        return out
    if vllm:
        spec = json.dumps({"method": f.vllm_method, "num_speculative_tokens": k})
        out.append(("vLLM", f"vllm serve {f.repo_id} \\\n  --speculative-config '{spec}'"))
    if sglang:
        out.append(("SGLang", f"python -m sglang.launch_server --model-path {f.repo_id} \\\n"
                              f"  --speculative-algorithm {SGLANG_ALGORITHM} {steps}"))
    return out


_DESCRIPTIONS = {
    "mtp-draft": "The multi-token-prediction (MTP) layers of {base}, extracted as a standalone draft model for "
                 "speculative decoding.",
    "stitched": "{base} with its multi-token-prediction (MTP) layers replaced by a finetuned draft, for "
                "speculative decoding.",
    "trunk": "{base} without its multi-token-prediction (MTP) layers.",
    "experts": "{base} with its expert weights re-laid out (same values, another tensor layout).",
    GGUF_KIND: "The multi-token-prediction (MTP) layers of {base} as a GGUF MTP sidecar for llama.cpp: loaded beside "
               "a trunk GGUF (`-md`), it drafts with llama.cpp's `--spec-type draft-mtp`.",
}


def render(f: CardFacts) -> str:
    """The README.md text: YAML metadata (ModelCardData), description, provenance, validation, serving."""
    from huggingface_hub import ModelCard, ModelCardData

    extra: dict = {"base_model_relation": f.base_model_relation} if f.base_model_relation else {}
    if f.probe is not None:  # model-index needs a model name
        extra.update(model_name=f.repo_id.split("/")[-1], eval_results=eval_results(f.probe))
    data = ModelCardData(
        base_model=(f.base_model[0] if len(f.base_model) == 1 else f.base_model) or None,
        library_name="gguf" if f.gguf is not None else None if f.kind in DRAFT_KINDS else "transformers",
        pipeline_tag=None if f.kind in DRAFT_KINDS or f.gguf is not None else "text-generation",
        tags=f.tags,
        **extra,
    )
    base = ", ".join(f"[{b}](https://huggingface.co/{b})" for b in f.base_model) or "a checkpoint"
    desc = _DESCRIPTIONS.get(f.kind, "A checkpoint with multi-token-prediction (MTP) layers for speculative "
                                     "decoding ({base}).").format(base=base)
    lines = [f"# {f.repo_id.split('/')[-1]}", "", desc, ""]
    lines += ["## How it was made", ""]
    lines.append(f"- Tool: ckpt-tools {f.tool_version or __version__}")
    if f.family:
        lines.append(f"- Model family: `{f.family}`; MTP layers: {f.mtp_count}")
    if f.draft_format:
        lines.append(f"- Draft format: `{f.draft_format}`")
    lines += gguf_lines(f)
    if f.command:
        lines += ["- Command:", "", "```bash", f.command, "```"]
    if f.sources:
        lines += ["", "| role | source | revision |", "| --- | --- | --- |"]
        lines += [f"| {s['role']} | `{s['path']}` | `{s.get('revision') or '-'}` |" for s in f.sources]
    if f.stitch_summary:
        lines += ["", "Stitch report (tensors per change):", ""]
        lines += [f"- {k}: {v}" for k, v in f.stitch_summary.items()]
    lines += ["", "## Validation", ""]
    if f.validation_ok is None:
        lines.append("Not validated.")
    elif f.validation_ok and f.gguf is not None:
        pair = (f" and each sidecar against the trunk `{f.gguf['trunk']}` (architecture, block count, architecture "
                "and tokenizer keys, shared tensor shapes)" if f.gguf.get("trunk_checked") else
                "; the trunk was not at hand, so the pair was not checked")
        lines.append(f"`ckpt validate` found no problems (GGUF: the MTP tensors against the family's table{pair}).")
    elif f.validation_ok:
        lines.append("`ckpt validate` found no problems (safetensors format, index, MTP tensors against the "
                     "config, FP8 scales).")
    else:
        lines.append(f"`ckpt validate` reported {len(f.problems)} problem(s); this checkpoint was pushed with "
                     "`--force`:")
        lines.append("")
        lines += [f"- {p}" for p in f.problems[:20]]
        if len(f.problems) > 20:
            lines.append(f"- ... and {len(f.problems) - 20} more")
    if f.notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in f.notes]
    if f.mtp_quant_auto is not None:
        lines += [""] + auto_markdown(f.mtp_quant_auto)
    if f.probe is not None:
        lines += [""] + markdown(f.probe)
    lines += ["", "## Serving with MTP speculative decoding", ""]
    snippets = serving_snippets(f)
    for title, cmd in snippets:
        lines += [f"{title}:", "", "```bash", cmd, "```", ""]
    if not snippets:
        lines.append("The family's table lists no serving engine with a draft class for its MTP layers.")
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines).rstrip() + "\n"
    return str(ModelCard(content))


def gguf_lines(f: CardFacts) -> list[str]:
    """The card's GGUF facts: llama.cpp's architecture, the MTP layers, the files and the trunk they go with."""
    g = f.gguf
    if g is None:
        return []
    nextn, blocks = g.get("nextn_predict_layers"), g.get("block_count")
    trunk_layers = blocks - nextn if isinstance(blocks, int) and isinstance(nextn, int) else "?"
    out = [f"- llama.cpp architecture: `{g.get('llama_cpp_arch') or '?'}`; MTP layers (`nextn_predict_layers`): "
           f"{nextn if nextn is not None else '?'} after {trunk_layers} trunk layers; type {g.get('gguf_type') or '?'}"]
    out.append(f"- Files: {', '.join(f'`{n}`' for n in g.get('files') or [])}; trunk (not in this repository): "
               f"`{g.get('trunk') or 'TRUNK.gguf'}`")
    return out


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
