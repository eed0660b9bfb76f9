"""Test-side access to real MTP implementations' logits, each run in its own virtual environment.

speculators 0.9.0 (make speculators-venv): tests/consumers/speculators_mtp_logits.py, whose
docstring gives the alignment taken from speculators' source. In short, for a draft in
speculators' format, input_ids [1, L] and the verifier's last hidden states [1, L, hidden]:
depth-d logits are [L-d, vocab] float32, row t predicting token t+d+1 from (hidden[t] for d = 1,
else the depth-(d-1) output at t) and the embedding of input_ids[t+d].

AngelSpec (Hy3's MTP module, angelspec/models/draft/mtp.py at d3412be): not on PyPI (`pip index
versions angelspec`: no distribution) and pip reaches no other source, so there is no environment to
run it in. Its code would run on CPU (flash-attn is an optional import; a dense block-0 attention
replaces flex_attention off CUDA; importing it needs numba and wandb beside torch / transformers),
but it cannot be installed. Our `--format angelspec` output is held to a hand-written contract
instead (test_angelspec_contract.py).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from consumer_venv import speculators_python, venv_env

SPEC_MTP_SCRIPT = Path(__file__).resolve().parent / "consumers" / "speculators_mtp_logits.py"


class MtpInput(NamedTuple):
    draft: Path
    input_ids: torch.Tensor  # [1, L] or [L], integer
    hidden: torch.Tensor  # [1, L, hidden] or [L, hidden]: the verifier's last hidden states
    verifier: Path | None = None  # overrides the draft config's verifier name_or_path


def speculators_mtp_outputs(jobs: list[MtpInput], *, cwd: Path | None = None,
                            attn: str = "sdpa") -> list[dict[str, torch.Tensor | dict]]:
    """Run speculators' MTPDraftModel on each job in one subprocess (its import costs ~15 s).

    Each result: "logits_depth{d}" [L-d, vocab] float32 for d = 1..num_speculative_steps, "logits"
    (= depth 1) and "meta" (versions, implementations). A relative verifier name in a draft's
    config resolves against ``cwd`` (default: this process's working directory), as it would for
    speculators run there.
    """
    python = speculators_python()
    with tempfile.TemporaryDirectory(prefix="spec-mtp-") as tmp:
        spec = []
        for i, job in enumerate(jobs):
            ids = job.input_ids.reshape(1, -1).to(torch.int64)
            hidden = job.hidden.reshape(1, ids.shape[1], -1).to(torch.float32)
            np.savez(Path(tmp, f"in{i}.npz"), input_ids=ids.numpy(), hidden=hidden.detach().numpy())
            spec.append({"draft": str(Path(job.draft).resolve()), "inputs": str(Path(tmp, f"in{i}.npz")),
                         "output": str(Path(tmp, f"out{i}.npz")),
                         **({"verifier": str(Path(job.verifier).resolve())} if job.verifier else {})})
        Path(tmp, "jobs.json").write_text(json.dumps(spec))
        r = subprocess.run([str(python), str(SPEC_MTP_SCRIPT), "--jobs", str(Path(tmp, "jobs.json")), "--attn", attn],
                           cwd=cwd or Path.cwd(), env=venv_env(), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{SPEC_MTP_SCRIPT.name} exit {r.returncode}: {r.stderr[-3000:]}"
        out = []
        for job in spec:
            with np.load(job["output"]) as data:
                res: dict[str, torch.Tensor | dict] = {k: torch.from_numpy(data[k].copy()) for k in data if k != "meta"}
                res["meta"] = json.loads(str(data["meta"]))
            out.append(res)
    return out


def speculators_logits(draft_dir: Path, input_ids: torch.Tensor, hidden: torch.Tensor, *, depth: int = 1,
                       verifier: Path | None = None, cwd: Path | None = None, attn: str = "sdpa") -> torch.Tensor:
    """speculators' MTP logits, [L-depth, vocab] float32: row t predicts token t+depth+1 (depth 1: t+2)."""
    (res,) = speculators_mtp_outputs([MtpInput(Path(draft_dir), input_ids, hidden, verifier)], cwd=cwd, attn=attn)
    key = f"logits_depth{depth}"
    if key not in res:
        raise ValueError(f"{draft_dir}: depth {depth} beyond the draft's num_speculative_steps ({res['meta']})")
    return res[key]
