"""The sidecar writer's bytes are gguf.GGUFWriter's, the trunk's key-values copied as their bytes: a trunk with a
real-size vocabulary (152k tokens, scores, types, merges) and a key of every value type."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from ckpt_tools.io.gguf_file import read_gguf
from ckpt_tools.ops.draft.gguf_sidecar import _kv
from ckpt_tools.stream.gguf_out import GgufTensorOut, write_gguf

T = gguf.GGUFValueType
VOCAB = 152_064


def _trunk(path: Path, arch: str) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, arch)
    w.add_key_value("general.alignment", 64, T.UINT32)
    w.add_key_value(f"{arch}.block_count", 4, T.UINT32)
    w.add_key_value(f"{arch}.nextn_predict_layers", 0, T.UINT32)
    w.add_key_value("general.file_type", 0, T.UINT32)
    for i, (vtype, value) in enumerate([(T.UINT8, 200), (T.INT8, -5), (T.UINT16, 60000), (T.INT16, -300),
                                        (T.INT32, -7), (T.FLOAT32, 0.1), (T.UINT64, 2**63 + 5), (T.INT64, -2**40),
                                        (T.FLOAT64, 1e-300), (T.BOOL, True), (T.STRING, "ünïcode ✓")]):
        w.add_key_value(f"{arch}.demo{i}", value, vtype)
        w.add_key_value(f"{arch}.demo_array{i}", [value] * 3, T.ARRAY, sub_type=vtype)
    w.add_key_value(f"{arch}.per_layer", [1, 2, 3, 4], T.ARRAY, sub_type=T.INT32)
    w.add_key_value("tokenizer.ggml.model", "gpt2", T.STRING)
    w.add_key_value("tokenizer.ggml.tokens", [f"tok{i}-ü" for i in range(VOCAB)], T.ARRAY, sub_type=T.STRING)
    w.add_key_value("tokenizer.ggml.scores", rng.standard_normal(VOCAB).astype(np.float32).tolist(), T.ARRAY,
                    sub_type=T.FLOAT32)
    w.add_key_value("tokenizer.ggml.token_type", [1] * VOCAB, T.ARRAY, sub_type=T.INT32)
    w.add_key_value("tokenizer.ggml.merges", [f"t{i} k{i}" for i in range(VOCAB - 256)], T.ARRAY,
                    sub_type=T.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tensors() -> list[GgufTensorOut]:
    rng = np.random.default_rng(1)
    out = []
    for name, shape, qtype in [("token_embd.weight", (64, 96), gguf.GGMLQuantizationType.F16),
                               ("blk.4.nextn.enorm.weight", (96,), gguf.GGMLQuantizationType.F32),
                               ("blk.4.attn_q.weight", (3, 64, 96), gguf.GGMLQuantizationType.Q8_0)]:
        t = GgufTensorOut(name, shape, qtype, lambda: [], {})
        data = rng.integers(0, 256, t.nbytes, dtype=np.uint8).tobytes()
        t.chunks = lambda data=data: [data[:7], memoryview(data)[7:]]
        out.append(t)
    return out


def _with_gguf_writer(path: Path, arch: str, kv, tensors: list[GgufTensorOut]) -> bytes:
    """The sidecar as the writer before this one wrote it: every key-value packed by GGUFWriter."""
    w = gguf.GGUFWriter(path, arch)
    for e in kv:
        if e.key == "general.alignment":
            w.data_alignment = int(e.value)
        if e.key != "general.architecture":
            w.add_key_value(e.key, e.value, e.vtype, sub_type=e.sub_type)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    for t in tensors:
        w.write_padding(fout, fout.tell())
        for chunk in t.chunks():
            fout.write(chunk)
        w.write_padding(fout, t.nbytes)
    w.close()
    return path.read_bytes()


def test_sidecar_bytes_are_gguf_writers_with_a_real_size_vocabulary(tmp_path):
    arch = "glm4moe"
    trunk = read_gguf(_trunk(tmp_path / "trunk.gguf", arch))
    assert len(trunk.kv["tokenizer.ggml.tokens"].value) == VOCAB
    kv = _kv(trunk, 5, 1, "f16", {f"{arch}.per_layer": [1, 2, 3, 4, 9]})
    assert sum(e.raw is not None for e in kv) == len(trunk.kv) - 4  # the four values the sidecar sets
    tensors = _tensors()
    size, digests = write_gguf(tmp_path / "ours.gguf", arch, kv, tensors)
    ours = (tmp_path / "ours.gguf").read_bytes()
    assert ours == _with_gguf_writer(tmp_path / "theirs.gguf", arch, kv, tensors)
    assert size == len(ours) and set(digests) == {t.name for t in tensors}
    back = read_gguf(tmp_path / "ours.gguf")
    assert back.kv[f"{arch}.block_count"].value == 5 and back.kv[f"{arch}.nextn_predict_layers"].value == 1
    assert back.kv["tokenizer.ggml.merges"].value == trunk.kv["tokenizer.ggml.merges"].value
