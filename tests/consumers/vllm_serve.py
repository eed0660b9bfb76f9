"""Runs in the vLLM venv (make vllm-venv): `ckpt probe --engine vllm` on each job, in one process.

Usage: python vllm_serve.py JOBS.json OUT.json. JOBS: [{"name", "verifier", "drafts", "prompts", "depth",
"max_new_tokens", "dtype", "attention_backend"}]. OUT: {name: {"report": probe's JSON} or {"error": "Type: message"}};
a job whose check failed (output not preserved) still has its report. vLLM is imported once for every job.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: 2-3 s a start
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    from ckpt_tools import api
    from ckpt_tools.errors import CheckFailed, CkptError

    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    out = {}
    for job in jobs:
        try:
            report = api.probe(job["verifier"], drafts=job.get("drafts", []), prompts=job["prompts"],
                               max_new_tokens=job.get("max_new_tokens", 24), depth=job.get("depth", 1),
                               dtype=job.get("dtype", "fp32"), engine="vllm",
                               attention_backend=job.get("attention_backend"))
            out[job["name"]] = {"report": report.to_json()}
        except CheckFailed as e:
            out[job["name"]] = {"report": e.report.to_json(), "failed": str(e)}
        except CkptError as e:
            out[job["name"]] = {"error": f"{type(e).__name__}: {e}"}
        except Exception as e:  # noqa: BLE001 (a crash is recorded; the test reading it fails, naming the job)
            out[job["name"]] = {"error": f"crash: {type(e).__name__}: {e}"}
        print(f"job {job['name']}: {sorted(out[job['name']])}", file=sys.stderr, flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
