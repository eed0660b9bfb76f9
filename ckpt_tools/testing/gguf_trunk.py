"""A trunk GGUF (no MTP) for a tiny fixture checkpoint, written with gguf.GGUFWriter: the key-values llama.cpp's
converter writes for the family's architecture (dimensions, a stand-in vocabulary), and the trunk tensors whose
names map one to one (F32, or F16 matrices as the converter's ``--outtype f16`` writes them; the shared norm
with the table's ``norm_offset`` added, as the converter adds it).
For tests of sidecars' metadata and pairing; llama.cpp's own converter (``--no-mtp``)
makes the trunks llama.cpp serves.
"""

from __future__ import annotations

from pathlib import Path


def write_trunk_gguf(ckpt_dir: str | Path, path: str | Path, *, overrides: dict | None = None,
                     drop: tuple[str, ...] = (), tensors: bool = True, allow: tuple[str, ...] = (),
                     gguf_type: str = "f32") -> Path:
    """Write ``path`` for the checkpoint at ``ckpt_dir``; ``overrides``: key -> value replacing a key-value,
    ``drop``: keys left out; ``tensors`` False: the key-values only (a trunk for a release-scale source, whose
    trunk is never read by a sidecar); ``allow``: rules the source is let through (a sparse replica's zero
    scales); ``gguf_type`` f16: matrices F16 (1-D tensors stay F32)."""
    import gguf
    import numpy as np

    from ..arrays import decode_floats
    from ..dtypes import FLOAT_DTYPES
    from ..io.checkpoint import Checkpoint
    from ..model.expr import evaluate, render
    from ..model.gate import require_consistent
    from ..model.gguf_names import TensorNames

    path = Path(path)
    with Checkpoint.open(ckpt_dir) as ckpt:
        gate = require_consistent(ckpt, allow=allow)
        table, env = gate.table, gate.view.resolved.env
        lc = table.llama_cpp
        layers = int(evaluate(table.trunk.count, env))
        arch = lc.arch
        kv: dict[str, tuple] = {
            "general.architecture": (arch, gguf.GGUFValueType.STRING),
            "general.name": (f"Tiny-{table.family}", gguf.GGUFValueType.STRING),
            f"{arch}.block_count": (layers, gguf.GGUFValueType.UINT32),
            f"{arch}.context_length": (int(ckpt.config.get("max_position_embeddings") or 512),
                                       gguf.GGUFValueType.UINT32),
            f"{arch}.embedding_length": (env["hidden"], gguf.GGUFValueType.UINT32),
            f"{arch}.attention.head_count": (env["heads"], gguf.GGUFValueType.UINT32),
            f"{arch}.vocab_size": (env["vocab"], gguf.GGUFValueType.UINT32),
            "general.file_type": (int(gguf.LlamaFileType.MOSTLY_F16 if gguf_type == "f16"
                                      else gguf.LlamaFileType.ALL_F32), gguf.GGUFValueType.UINT32),
            "tokenizer.ggml.model": ("gpt2", gguf.GGUFValueType.STRING),
            "tokenizer.ggml.pre": ("default", gguf.GGUFValueType.STRING),
            "tokenizer.ggml.tokens": ([f"<t{i}>" for i in range(env["vocab"])], gguf.GGUFValueType.ARRAY),
            "tokenizer.ggml.token_type": ([1] * env["vocab"], gguf.GGUFValueType.ARRAY),
            "tokenizer.ggml.eos_token_id": (0, gguf.GGUFValueType.UINT32),
        }
        if "experts" in env:
            kv[f"{arch}.expert_count"] = (env["experts"], gguf.GGUFValueType.UINT32)
        for k, v in (overrides or {}).items():
            kv[k] = (v, gguf.GGUFValueType.ARRAY if isinstance(v, list)
                     else kv[k][1] if k in kv else gguf.GGUFValueType.UINT32)
        names = TensorNames(lc, layers, table.family)
        w = gguf.GGUFWriter(path, arch)
        for k, (v, t) in kv.items():
            if k in drop or k == "general.architecture":  # the writer sets the architecture itself
                continue
            sub = None
            if t == gguf.GGUFValueType.ARRAY:
                sub = gguf.GGUFValueType.STRING if isinstance(v[0], str) else gguf.GGUFValueType.INT32
            w.add_key_value(k, v, t, sub_type=sub)
        shared = {s.key: s for s in gate.view.resolved.shared.values()}
        keys = list(shared) if tensors else []
        if tensors:
            keys += [k for k in ckpt.tensors if any(k.startswith(render(table.trunk.prefix, {**env, "l": j}))
                                                    for j in range(layers))]
        for k in keys:
            found = names.lookup(k)
            ref = ckpt.tensors.get(k)
            if found is None or ref is None or ref.dtype not in FLOAT_DTYPES:
                continue

            values = decode_floats(bytearray(ref.read()), ref.dtype).astype(np.float32).reshape(ref.shape)
            if k in shared and shared[k].kind == "norm" and lc.norm_offset:
                values = values + np.float32(lc.norm_offset)
            if gguf_type == "f16" and values.ndim > 1:
                values = values.astype(np.float16)
            w.add_tensor(found[1], values)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path
