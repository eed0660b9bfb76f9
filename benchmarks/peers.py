"""Peer tools in their own virtual environment under the work directory.

speculators 0.9.0 pins transformers < 5.20 and pulls torch, torchvision, torchaudio,
datasets, openai and more: it must never touch the project's environment. The venv is
made once per work directory and reused; a failed install is remembered (with its
reason) until ``--retry-peers``.

torch is pinned to the project's own torch version: where that is a CPU build (as on
our machines) pip takes it from the local wheel instead of downloading a multi-GB CUDA
build. PyPI's torchvision / torchaudio are built against the CUDA torch and fail to
import next to a CPU torch (``operator torchvision::nms does not exist``), which breaks
``import transformers``; speculators' MTP convert and stitch use neither, so they are
removed when they do not import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SPECULATORS = "speculators==0.9.0"


@dataclass
class Peer:
    name: str
    venv: Path | None
    reason: str = ""  # why it is unavailable
    version: str = ""

    @property
    def ok(self) -> bool:
        return self.venv is not None

    def exe(self, tool: str) -> str:
        assert self.venv is not None
        return str(self.venv / "bin" / tool)


def peer_env() -> dict:
    """Environment for peer runs: offline (no hub lookups), no colour or progress bars to a file."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", NO_COLOR="1",
               TERM="dumb", COLUMNS="120")
    env.pop("VIRTUAL_ENV", None)
    return env


def _torch_pin() -> list[str]:
    try:
        import torch

        return [f"torch=={torch.__version__}"]
    except ImportError:
        return []


def ensure_speculators(workdir: Path, *, retry: bool = False, timeout: float = 900.0, log=print) -> Peer:
    venv = workdir / "peer-venv"
    state = workdir / "peer-venv.json"
    if state.exists() and not retry:
        info = json.loads(state.read_text())
        if info.get("ok") and (venv / "bin" / "speculators").exists():
            return Peer("speculators", venv, version=info.get("version", ""))
        if not info.get("ok"):
            return Peer("speculators", None, reason=info.get("reason", "install failed earlier"))

    def fail(reason: str) -> Peer:
        state.write_text(json.dumps({"ok": False, "reason": reason}) + "\n")
        return Peer("speculators", None, reason=reason)

    log(f"installing {SPECULATORS} into {venv} (once; up to {timeout:.0f} s)")
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True,
                       timeout=120)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        r = subprocess.run(pip + [SPECULATORS, *_torch_pin()], capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            # the pinned torch may not exist for this platform: try speculators' own choice
            r = subprocess.run(pip + [SPECULATORS], capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            return fail(f"pip install {SPECULATORS} failed: {(r.stderr or r.stdout).strip()[-300:]}")
        py = str(venv / "bin" / "python")
        for mod, dist in (("torchvision", "torchvision"), ("torchaudio", "torchaudio")):
            if subprocess.run([py, "-c", f"import {mod}"], capture_output=True, timeout=300).returncode != 0:
                subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", dist], capture_output=True, timeout=300)
        r = subprocess.run([str(venv / "bin" / "speculators"), "--help"], capture_output=True, text=True,
                           timeout=600, env=peer_env())
        if r.returncode != 0:
            return fail(f"`speculators --help` fails after install: {(r.stderr or r.stdout).strip()[-300:]}")
        v = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('speculators'), "
                            "m.version('transformers'), m.version('torch'))"], capture_output=True, text=True,
                           timeout=300).stdout.split()
    except subprocess.TimeoutExpired as e:
        return fail(f"timed out after {e.timeout:.0f} s: {' '.join(map(str, e.cmd))[:200]}")
    except (OSError, subprocess.CalledProcessError) as e:
        return fail(f"cannot create the venv: {e}")
    version = f"speculators {v[0]} (transformers {v[1]}, torch {v[2]})" if len(v) == 3 else "speculators"
    state.write_text(json.dumps({"ok": True, "version": version}) + "\n")
    return Peer("speculators", venv, version=version)
