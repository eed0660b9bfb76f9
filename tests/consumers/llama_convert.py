"""llama.cpp's own converter, convert_hf_to_gguf.py, as a user runs it, for the tiny test checkpoints.

    python llama_convert.py LLAMA_CPP_SRC JOBS.json

JOBS.json: a list of argument lists, each one run of convert_hf_to_gguf.py, in a child forked from this process
once torch, transformers and the converter's modules are imported (each run starts from the same state: the
converter sets class attributes for --mtp / --no-mtp). One change, at run time and in this process only: the converter's
pre-tokenizer check (``get_vocab_base_pre``, a table of hashes of known tokenizers' output) answers "default"
(llama.cpp's generic BPE pre-tokenizer) for the test tokenizer (ckpt_tools/testing/tokenizer.py), which no such
table knows. Everything else is the converter's own code, with its own gguf-py (the tree's, newer than PyPI's
gguf) first on the path.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path


def main() -> None:
    src = Path(sys.argv[1]).resolve()
    jobs = json.loads(Path(sys.argv[2]).read_text())
    sys.path[:0] = [str(src / "gguf-py"), str(src)]
    import torch  # noqa: F401 (imported once, before the forks)
    import transformers  # noqa: F401
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    for args in jobs:
        pid = os.fork()
        if pid == 0:
            sys.argv = [str(src / "convert_hf_to_gguf.py"), *args]
            try:
                runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")
            except SystemExit as e:
                os._exit(e.code if isinstance(e.code, int) else 1)
            except BaseException:
                import traceback

                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"convert_hf_to_gguf.py {' '.join(args)} failed")


if __name__ == "__main__":
    main()
