"""Extract's job through the library alone: open, classify MTP, plan byte copies, write.

``python lib_extract.py SRC OUT``. Separates what the writer costs from what the CLI
adds (typer, rich, validation of the output, reports), and works before the verb lands.
"""

from __future__ import annotations

import sys

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.mtp import open_mtp
from ckpt_tools.stream.execute import execute
from ckpt_tools.stream.plan import CopyBytes, OutputFile, OutputTensor, Plan


def main(src: str, out: str) -> int:
    ckpt = Checkpoint.open(src)
    view = open_mtp(ckpt)
    view.require_complete()
    tensors = []
    for key in [s.key for s in view.present]:
        ref = ckpt.tensors[key]
        tensors.append(OutputTensor(key, ref.dtype, tuple(ref.shape), CopyBytes([ref.segment()])))
    files = [OutputFile("config.json", content=ckpt.config.to_bytes())]
    execute(Plan("lib-extract", tensors, files=files, inputs=[ckpt.local_dir]), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
