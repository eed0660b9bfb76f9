"""Runs INSIDE the speculators 0.9.0 virtual environment (see Makefile: speculators-venv).

    python speculators_check.py VERIFIER OURS WORK
    python speculators_check.py --jobs '[{"cwd": DIR, "verifier": V, "ours": O, "work": W}, ...]'

VERIFIER is a verifier checkpoint, OURS our `ckpt extract --format speculators` output of it
(its config names the verifier as a path relative to the working directory). Writes into WORK:
  theirs/            speculators' own MTPConverter output for VERIFIER
  ours-trained/      OURS loaded with speculators, every MTP weight moved by the same
  theirs-trained/    deterministic step, saved with save_pretrained (a training epoch folder)
and prints one JSON line: what loaded, the forward pass, and the converter's config. With --jobs: each
job in turn, in its working directory, one line each.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from speculators import SpeculatorModel
from speculators.convert.mtp.converter import MTPConverter
from speculators.models.mtp import MTPDraftModel


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def loaded_exactly(model: torch.nn.Module, path: Path) -> list[str]:
    """Keys of the checkpoint whose values the model does not hold bit for bit."""
    state = model.state_dict()
    bad = []
    for key, t in file_tensors(path).items():
        if key == "verifier_lm_head.weight":
            continue  # speculators' NaN placeholder: deleted by load_verifier_weights
        have = state.get(key)
        if have is None or have.shape != t.shape or not torch.equal(have.to(t.dtype), t):
            bad.append(key)
    return bad


def forward(model: MTPDraftModel) -> dict:
    torch.manual_seed(0)
    hidden = model.config.transformer_layer_config.hidden_size
    vocab = model.config.transformer_layer_config.vocab_size
    ids = torch.randint(0, vocab, (1, 12))
    dtype = next(model.parameters()).dtype
    states = torch.randn(1, 12, hidden, dtype=dtype)
    with torch.no_grad():
        logits, loss, _ = model(input_ids=ids, hidden_states=states)
    return {"steps": len(logits), "logits_shape": list(logits[0].shape), "loss": float(loss),
            "finite": bool(torch.isfinite(loss)) and all(bool(torch.isfinite(x).all()) for x in logits)}


def trained(src: Path, out: Path) -> None:
    """What a training run leaves: the draft loaded, its MTP weights moved, saved by speculators."""
    model = MTPDraftModel.from_pretrained(str(src))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.startswith("mtp_layers."):
                step = torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape)
                p.add_(step.to(p.dtype))
    model.save_pretrained(str(out))


def main() -> None:
    if sys.argv[1] == "--jobs":  # several checks in one process: importing speculators takes 10-20 s
        for job in json.loads(sys.argv[2]):
            os.chdir(job["cwd"])
            check(Path(job["verifier"]), Path(job["ours"]), Path(job["work"]))
    else:
        check(*(Path(a) for a in sys.argv[1:4]))


def check(verifier: Path, ours: Path, work: Path) -> None:
    theirs = work / "theirs"
    MTPConverter().convert(str(verifier), str(theirs), base_model=str(verifier), num_speculative_steps=3)
    model = SpeculatorModel.from_pretrained(str(ours))  # generic entry point: resolved from the config
    report = {
        "class": type(model).__name__,
        "not_loaded": loaded_exactly(model, ours),
        "forward": forward(model),
        "theirs_config": json.loads((theirs / "config.json").read_text()),
    }
    trained(ours, work / "ours-trained")
    trained(theirs, work / "theirs-trained")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
