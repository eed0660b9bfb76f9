"""What a write keeps per tensor until its manifest: digests, not a Future each; the manifest's JSON pieces joined
as they go, not ~25 small strings per entry alive at once (a 92k-tensor release: ~1 KB per tensor is 90 MB)."""

from __future__ import annotations

import gc
import tracemalloc
from concurrent.futures import Future

import numpy as np
from safetensors.numpy import save_file

from ckpt_tools.io.safetensors_io import LocalFile, read_header, refs_from_header
from ckpt_tools.jsonutil import dumps_indented
from ckpt_tools.stream import manifest
from ckpt_tools.stream.execute import execute
from ckpt_tools.stream.plan import CopyBytes, OutputTensor, Plan

N = 2000


def test_no_future_per_written_tensor_lives_until_the_manifest(tmp_path, monkeypatch):
    src_path = tmp_path / "src.safetensors"
    save_file({f"t.{i}": np.full(4, i, dtype=np.float32) for i in range(N)}, str(src_path),
              metadata={"format": "pt"})
    alive: list[int] = []
    real = manifest.manifest_bytes

    def counting(content: dict) -> bytes:
        gc.collect()
        alive.append(sum(type(o) is Future for o in gc.get_objects()))
        return real(content)

    monkeypatch.setattr(manifest, "manifest_bytes", counting)
    src = LocalFile(src_path)
    try:
        refs = refs_from_header(src, read_header(src))
        plan = Plan("copy", [OutputTensor(k, r.dtype, r.shape, CopyBytes([r.segment()])) for k, r in refs.items()],
                    inputs=[src_path])
        execute(plan, tmp_path / "out")
    finally:
        src.close()
    assert alive and alive[0] < 50, f"{alive[0]} Futures alive for {N} tensors written"
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == src_path.read_bytes()


def test_indented_json_holds_about_its_text_not_a_string_per_token():
    doc = {"tensors": {f"model.layers.{i}.mlp.experts.{i % 64}.weight": {
        "file": f"model-{i % 163:05d}.safetensors", "dtype": "F8_E4M3", "shape": [2048, 7168],
        "blake3": f"{i:064x}"} for i in range(20_000)}}
    tracemalloc.start()
    try:
        text = dumps_indented(doc, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(text) + (1 << 20), f"{peak >> 20} MB traced for {len(text) >> 20} MB of text"
