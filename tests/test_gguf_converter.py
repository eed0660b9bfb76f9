"""Our GGUF sidecar is llama.cpp b11434's own: for the families whose converter writes one (``--mtp``), every tensor
(name, type, shape, bytes) and every key-value but ``general.size_label`` (a parameter count of the file) equal
convert_hf_to_gguf.py's, for each output type; Q8_0 bytes from the PyPI gguf package's quantizer equal those of
the converter's gguf-py. The converter (Python only; no llama.cpp binary) runs from llama.cpp b11434's source
tree: ``LLAMA_CPP_SRC``, else ``.llama-cpp/src`` as ``make llama-cpp`` unpacks it; with its test tokenizer
(ckpt_tools/testing/tokenizer.py) and runner (tests/consumers/llama_convert.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from ckpt_tools.api.writing import extract_gguf
from ckpt_tools.testing import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SRC = Path(os.environ.get("LLAMA_CPP_SRC") or ROOT / ".llama-cpp" / "src")
CONVERT = ROOT / "tests" / "consumers" / "llama_convert.py"
VOCAB = 128
# family -> the output types compared (every type for one family; f16, the default, for the others)
CASES = {"glm4_moe": ("f32", "f16", "bf16", "q8_0"), "glm4_moe_lite": ("f16",), "glm_moe_dsa": ("f16",),
         "qwen3_next": ("f16",), "qwen3_5": ("f16",), "qwen3_5_moe": ("f16",), "hy_v3": ("f16",),
         "nemotron_h": ("f16",), "bailing_moe_v3": ("f16",)}
# fixture options per family: Hy3 releases ship no per-layer head copy, and llama.cpp's Hy3 and BailingMoeV3
# converters map none
OPTIONS = {"hy_v3": {"with_optional": False}, "bailing_moe_v3": {"with_optional": False}}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (SRC / "convert_hf_to_gguf.py").is_file(), reason=f"no llama.cpp source tree at {SRC}"),
    pytest.mark.skipif(not CONVERT.is_file(), reason="tests/consumers/llama_convert.py absent"),
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    tokenizer = pytest.importorskip("ckpt_tools.testing.tokenizer")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("converter")
    jobs, out = [], {}
    for family, types in CASES.items():
        src = make_checkpoint(family, root / family, num_shards=1, **OPTIONS.get(family, {}),
                              config_overrides={"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2})
        tokenizer.write_tokenizer(src, VOCAB)
        trunk = root / f"{family}-trunk.gguf"
        jobs.append([src, "--outfile", trunk, "--outtype", "f16", "--no-mtp"])
        for t in types:
            jobs.append([src, "--outfile", root / f"{family}-{t}.gguf", "--outtype", t, "--mtp"])
            out[(family, t)] = (src, trunk, root / f"{family}-{t}.gguf")
    (root / "jobs.json").write_text(json.dumps([[str(a) for a in j] for j in jobs]))
    r = subprocess.run([sys.executable, str(CONVERT), str(SRC), str(root / "jobs.json")], cwd=root,
                       capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return {k: (*v, root) for k, v in out.items()}


def _fields(r) -> dict:
    return {k: (f.types, f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("family,gguf_type", [(f, t) for f, ts in CASES.items() for t in ts])
def test_our_sidecar_is_the_converters(converted, family, gguf_type):
    from ckpt_tools.api.validating import validate_gguf

    src, trunk, theirs_path, root = converted[(family, gguf_type)]
    ours_path = Path(extract_gguf(src, root / f"ours-{family}-{gguf_type}", trunk, gguf_type=gguf_type).path)
    assert validate_gguf(ours_path, trunk=trunk, arch=family).ok  # and the pair check agrees
    assert validate_gguf(theirs_path, trunk=trunk, arch=family).ok
    ours, theirs = gguf.GGUFReader(ours_path), gguf.GGUFReader(theirs_path)
    a, b = _fields(ours), _fields(theirs)
    a.pop("general.size_label", None)
    b.pop("general.size_label", None)
    assert a == b
    ta, tb = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert sorted(ta) == sorted(tb)
    for name, t in tb.items():
        mine = ta[name]
        assert (mine.tensor_type, list(mine.shape)) == (t.tensor_type, list(t.shape)), name
        assert np.asarray(mine.data).tobytes() == np.asarray(t.data).tobytes(), name
