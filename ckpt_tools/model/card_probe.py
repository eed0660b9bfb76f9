"""The measured acceptance a model card carries: a ``ckpt probe`` report matched to the pushed files.

The report's MTPs whose tensors' digest equals the pushed checkpoint's are this checkpoint's: their numbers go
into the card's metadata as huggingface_hub ``EvalResult`` entries (model-index, which the Hub shows), one per
metric: acceptance per depth, KL per depth (the transformers engine), mean acceptance length (vLLM) or expected
accepted tokens per verification step, and the positions scored. Every MTP of the report is in the readable table,
the one of this checkpoint marked, since the others (the verifier's own MTP, other drafts) are its comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

TASK_TYPE = "text-generation"
TASK_NAME = "MTP speculative decoding (draft acceptance)"
DATASET_TYPE = "prompts"


@dataclass
class ProbeEvidence:
    """A probe report that names the pushed files' tensors, and where the report and its plot are in the repo."""

    report: dict
    report_path: str  # in the repository
    digest: str  # sha256 of the pushed checkpoint's tensors (ops.shared.tensors_digest)
    matched: list[int] = field(default_factory=list)  # indices of report["drafts"] that measured these tensors
    plot_path: str | None = None  # in the repository
    # what ``digest`` is: "tensors" (tensors_digest, recorded in the report) or "gguf-file" (the sha256 of the
    # pushed GGUF file that the report's MTP named, as llama.cpp reports no tensor digest)
    basis: str = "tensors"

    @property
    def digest_key(self) -> str:
        return "tensors_sha256" if self.basis == "tensors" else "gguf_sha256"

    @property
    def depth(self) -> int:
        """The depth measured for this checkpoint's MTP (the N of the serving commands)."""
        return len(self.report["drafts"][self.matched[0]]["agreement"])


def display_name(entry: dict) -> str:
    """How the card names an MTP: a local path is reduced to its last part (the card is public)."""
    name = str(entry.get("name", "?"))
    return "the verifier's own MTP" if name == "verifier" else PurePath(name).name or name


def conditions(report: dict) -> dict[str, Any]:
    engine = report.get("engine") or {}
    return {"engine": engine.get("name"), "engine_version": engine.get("version"), "dtype": report.get("dtype"),
            "device": report.get("device"), "chain": report.get("chain")}


def metrics(entry: dict) -> list[tuple[str, str, float | int]]:
    """(metric_type, metric_name, value) of one MTP, in the report's numbers."""
    out: list[tuple[str, str, float | int]] = [
        (f"acceptance@{k}", f"acceptance at depth {k}", float(a)) for k, a in enumerate(entry["agreement"], 1)]
    out += [(f"kl@{k}", f"KL(verifier || draft) at depth {k}", float(v))
            for k, v in enumerate(entry.get("kl") or [], 1)]
    if entry.get("mean_acceptance_length") is not None:
        out.append(("mean_acceptance_length", "mean acceptance length (tokens per verifier step)",
                    float(entry["mean_acceptance_length"])))
    else:
        out.append(("expected_accepted_tokens", "expected accepted draft tokens per verification step",
                    float(entry["expected_accepted"])))
    out.append(("positions", "positions scored", int(entry["positions"])))
    return out


def eval_results(evidence: ProbeEvidence) -> list:
    """huggingface_hub ``EvalResult`` entries of the MTPs that measured the pushed tensors."""
    from huggingface_hub import EvalResult

    report = evidence.report
    digest = report.get("prompts_sha256")
    dataset_args = {"prompts": report.get("prompts"), "max_new_tokens": report.get("max_new_tokens")}
    out = []
    for i in evidence.matched:
        entry = report["drafts"][i]
        args = {**conditions(report), evidence.digest_key: evidence.digest}
        for metric_type, metric_name, value in metrics(entry):
            out.append(EvalResult(
                task_type=TASK_TYPE, task_name=TASK_NAME, dataset_type=DATASET_TYPE,
                dataset_name=f"prompts sha256:{str(digest)[:12]}", dataset_revision=digest, dataset_args=dataset_args,
                metric_type=metric_type, metric_name=metric_name, metric_value=value, metric_args=args))
    return out


def markdown(evidence: ProbeEvidence) -> list[str]:
    """The card's section: conditions, a table of every MTP measured, the plot."""
    report = evidence.report
    c = conditions(report)
    drafts = report["drafts"]
    depth = max(len(d["agreement"]) for d in drafts)
    with_kl = any(d.get("kl") for d in drafts)
    vllm = any(d.get("mean_acceptance_length") is not None for d in drafts)
    # llama.cpp's report has no dtype (the GGUF's types are the file's) and chains as it drafts: not said then
    setting = (f"{c['dtype']} on {c['device']}, depth chained as {c['chain']}" if c["dtype"] is not None
               else f"on {c['device']}")
    lines = ["## Measured acceptance", "",
             f"Measured with `ckpt probe` ({c['engine']} {c['engine_version']}, {setting}) "
             f"on {report.get('prompts')} prompt(s) x {report.get('max_new_tokens')} "
             f"generated tokens (prompts file sha256 `{report.get('prompts_sha256')}`); the report is "
             f"[`{evidence.report_path}`]({evidence.report_path}).", ""]
    if vllm:
        counted = "vLLM" if c["engine"] in (None, "vllm") else c["engine"]
        lines += [f"Acceptance at depth k is {counted}'s own count: the share of drafts whose first k tokens were "
                  "accepted.", ""]
    else:
        lines += ["Acceptance at depth k is the share of generated positions where the depth-k draft token equals "
                  "the verifier's greedy token; KL is from the verifier's next-token distribution to the draft's.", ""]
    head = ["MTP", *(f"acceptance@{k}" for k in range(1, depth + 1))]
    head += [f"KL@{k}" for k in range(1, depth + 1)] if with_kl else []
    head += ["mean acceptance length" if vllm else "E[accepted]/step", "positions", "greedy equal", "tensors sha256"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for i, d in enumerate(drafts):
        name = display_name(d) + (" (this checkpoint)" if i in evidence.matched else "")
        cells = [name, *(f"{a:.4f}" for a in d["agreement"]), *["-"] * (depth - len(d["agreement"]))]
        if with_kl:
            kls = d.get("kl") or []
            cells += [f"{v:.4f}" for v in kls] + ["-"] * (depth - len(kls))
        mean = d.get("mean_acceptance_length")
        cells.append(f"{mean:.4f}" if mean is not None else f"{d['expected_accepted']:.4f}")
        greedy = d.get("greedy_equal")
        cells += [str(d["positions"]), "-" if greedy is None else ("yes" if greedy else "NO"),
                  f"`{str((d.get('tensors') or {}).get('sha256') or '-')[:12]}`"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += quant_markdown(report.get("mtp_quant") or [], depth)
    if evidence.basis == "gguf-file":
        named = ", ".join(f"`{display_name(drafts[i])}`" for i in evidence.matched)
        lines += ["", f"llama.cpp reports no tensor digest (it reads the GGUF file itself): {named} was matched to "
                      f"the pushed file by its bytes (sha256 `{evidence.digest}`), unchanged since the report was "
                      "written."]
    if evidence.plot_path:
        lines += ["", f"![acceptance per depth]({evidence.plot_path})"]
    return lines


def quant_markdown(rows: list[dict], depth: int) -> list[str]:
    """``ckpt probe --mtp-quant``: the verifier's own MTP per storage scheme (empty without the section)."""
    if not rows:
        return []
    head = ["scheme", "MTP bytes", *(f"acceptance@{k}" for k in range(1, depth + 1)),
            *(f"KL@{k}" for k in range(1, depth + 1)), "E[accepted]/step", "change@1", "note"]
    lines = ["", "### The MTP per storage scheme", "",
             "The verifier's own MTP encoded into each scheme as `ckpt graft --mtp-quant` writes it, decoded as "
             "`ckpt dequant` reads it, and measured on the same prompts and greedy path; change@1 is the depth-1 "
             "acceptance minus the MTP's as stored.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        agreement, kl = r.get("agreement") or [], r.get("kl") or []
        pad = ["-"] * (depth - len(agreement))
        change = r.get("agreement_change") or []
        cells = [str(r.get("scheme")), "-" if r.get("bytes") is None else str(r["bytes"]),
                 *(f"{a:.4f}" for a in agreement), *pad, *(f"{v:.4f}" for v in kl), *["-"] * (depth - len(kl)),
                 f"{r['expected_accepted']:.4f}" if "expected_accepted" in r else "-",
                 f"{change[0]:+.4f}" if change else "-",
                 r["status"] + (f": {r['reason']}" if r.get("reason") else "")]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def auto_markdown(choice: dict) -> list[str]:
    """``--mtp-quant auto`` / ``--gguf-type auto``: the storage the writer chose by measuring, why, and the table."""
    m = choice.get("measured") or {}
    rows = choice.get("rows") or []
    depth = max((len(r.get("agreement") or []) for r in rows), default=1)
    return ["## MTP precision chosen by measurement", "",
            f"`{choice.get('option')}` chose **{choice.get('chosen')}**: {choice.get('why')}. Measured with "
            f"`ckpt probe --mtp-quant` ({m.get('dtype')} on {m.get('device')}) on {m.get('prompts')} prompt(s) x "
            f"{m.get('max_new_tokens')} generated tokens (prompts file sha256 `{m.get('prompts_sha256')}`), "
            f"candidates {', '.join(choice.get('candidates') or []) or 'none'}, accepted drop "
            f"{choice.get('max_drop')}.",
            *quant_markdown(rows, depth)]
