"""`ckpt probe --plot FILE.png`: acceptance per depth of every MTP measured, and KL per depth beside it.

Drawn from the report's JSON (``ProbeResult.to_json``), so a report file can be plotted again. One line per MTP
(the verifier's own, then each draft). The acceptance panel plots ``agreement[k]``: with the transformers engine
the depth-k agreement with the verifier's greedy token, with vLLM the share of drafts whose first k tokens were
accepted (its own counter), so the axis says which. The KL panel is left out when no MTP has a KL (vLLM).
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import OutputError, extra_module

EXTRA = "ckpt-tools[plot]"
SIZE = (9.0, 4.0)  # inches, two panels side by side
DPI = 100


def matplotlib_pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or a UsageError (exit 2) naming the extra."""
    matplotlib = extra_module("matplotlib", "--plot", "matplotlib", EXTRA)
    matplotlib.use("Agg")  # no display: a file is all that is drawn
    import matplotlib.pyplot as plt

    return plt


def acceptance_label(report: dict) -> str:
    if (report.get("engine") or {}).get("name") == "vllm":
        return "drafts with the first k tokens accepted (vLLM)"
    return "agreement with the verifier's greedy token at depth k"


def draw(report: dict, path: str | os.PathLike[str]) -> None:
    """Writes the PNG at ``path`` from a probe report's JSON."""
    plt = matplotlib_pyplot()
    drafts = (report.get("drafts") or []) + quant_series(report)
    with_kl = any(d.get("kl") for d in drafts)
    fig, axes = plt.subplots(1, 2 if with_kl else 1, figsize=SIZE if with_kl else (SIZE[0] / 2 + 1, SIZE[1]),
                             squeeze=False)
    acc = axes[0][0]
    depth = max((len(d.get("agreement") or []) for d in drafts), default=1)
    for d in drafts:
        ks = range(1, len(d["agreement"]) + 1)
        acc.plot(ks, d["agreement"], marker="o", label=_short(d["name"]))
    acc.set(xlabel="depth k", ylabel="acceptance", ylim=(0, 1.02), xticks=range(1, depth + 1),
            title=acceptance_label(report))
    acc.title.set_fontsize(9)
    acc.grid(alpha=0.3)
    acc.legend(fontsize=8)
    if with_kl:
        kl = axes[0][1]
        for d in drafts:
            if d.get("kl"):
                kl.plot(range(1, len(d["kl"]) + 1), d["kl"], marker="o", label=_short(d["name"]))
        kl.set(xlabel="depth k", ylabel="KL(verifier || draft), nats", xticks=range(1, depth + 1),
               title="KL from the verifier's next-token distribution")
        kl.title.set_fontsize(9)
        kl.set_ylim(bottom=0)
        kl.grid(alpha=0.3)
        kl.legend(fontsize=8)
    engine = report.get("engine") or {}
    fig.suptitle(f"ckpt probe: {report.get('prompts')} prompt(s), {engine.get('name')} {engine.get('version') or ''}"
                 f", {report.get('dtype') or ''} on {report.get('device') or ''}".replace(" ,", ","), fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(os.fspath(path), dpi=DPI, format="png")
    except OSError as e:
        raise OutputError(f"cannot write the plot: {e.strerror or e}", path=os.fspath(path)) from None
    finally:
        plt.close(fig)


def quant_series(report: dict) -> list[dict]:
    """--mtp-quant: each measured scheme's row as one more line (the row as stored is the verifier's own MTP)."""
    return [{"name": f"mtp-quant {r['scheme']}", "agreement": r["agreement"], "kl": r.get("kl")}
            for r in report.get("mtp_quant") or [] if r.get("agreement") and r.get("scheme") != "as stored"]


def _short(name: str, width: int = 40) -> str:
    """A legend label: a long path keeps its end (the directory names that tell drafts apart)."""
    return name if len(name) <= width else "..." + name[-(width - 3):]
