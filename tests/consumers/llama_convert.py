"""llama.cpp's own converter, convert_hf_to_gguf.py, as a user runs it, for the tiny test checkpoints.

    python llama_convert.py LLAMA_CPP_SRC -- [convert_hf_to_gguf.py's arguments]

One change, at run time and in this process only: the converter's pre-tokenizer check (``get_vocab_base_pre``,
a table of hashes of known tokenizers' output) answers "default" (llama.cpp's generic BPE pre-tokenizer) for the
test tokenizer (ckpt_tools/testing/tokenizer.py), which no such table knows. Everything else is the converter's
own code, with its own gguf-py (the tree's, newer than PyPI's gguf) first on the path.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    src = Path(sys.argv[1]).resolve()
    if sys.argv[2] != "--":
        raise SystemExit("usage: llama_convert.py LLAMA_CPP_SRC -- ARGS")
    sys.path[:0] = [str(src / "gguf-py"), str(src)]
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    sys.argv = [str(src / "convert_hf_to_gguf.py"), *sys.argv[3:]]
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
