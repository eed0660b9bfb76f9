"""The tiny checkpoints llama.cpp b11434's converter and runtime take, and that converter run as a user runs it
(tests/consumers/llama_convert.py), for tests/test_gguf_converter.py and tests/test_consumer_llama_cpp.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from consumer_venv import convert_python

from ckpt_tools.testing import make_checkpoint, tokenizer
from ckpt_tools.testing.fixtures import FixtureOptions
from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

CONVERT = Path(__file__).resolve().parent / "consumers" / "llama_convert.py"
# Hy3 releases ship no per-layer head copy; llama.cpp's Hy3 and BailingMoeV3 converters map none (nor does
# DeepSeek-V4's: its release has no per-layer embedding or head)
FIXTURE_OPTIONS = {"hy_v3": {"with_optional": False}, "bailing_moe_v3": {"with_optional": False},
                   "deepseek_v4": {"with_optional": False}}
# what llama.cpp b11434 needs of a fixture beyond the table's: the smallest DSA indexer head its lightning indexer
# runs (a Hadamard rotation of n_rot_k >= 64 columns, llama-kv-cache.cpp; ggml_can_mul_mat needs the head that
# wide); Nemotron-H's MoE releases' layer kinds only (the converter's nemotron_h_moe counts no dense MLP layer, '-');
# the release config fields the converters read: DeepSeek-V3.2's router (scoring_func, else no
# deepseek32.expert_gating_func and llama.cpp refuses the trunk), Step-3.5's attention_other_setting (the sliding
# layers' heads) and partial_rotary_factors (asserted against layer_types)
DSA = {"index_head_dim": 64}
# DeepSeek-V4: llama.cpp's graph asserts 4 hyper-connection streams (deepseek4.cpp build_hc_pre, GGML_ASSERT hc == 4)
# and rotates the lightning indexer's keys by a Hadamard matrix of at least 64 columns; the release config lists
# the MTP layer in compress_ratios and gives the router and hyper-connection fields the converter reads
DSV4 = {**DSA, "hc_mult": 4, "compress_ratios": [0, 4, 128, 4, 0], "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0, "hc_sinkhorn_iters": 20, "hc_eps": 1.0e-6}
LLAMA_FIXTURE = {"glm_moe_dsa": DSA, "nemotron_h": {"hybrid_override_pattern": "ME*E"},
                 "deepseek_v32": {**DSA, "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
                 "step3p5": {"attention_other_setting": {"num_attention_heads": 6, "num_attention_groups": 2},
                             "partial_rotary_factors": [0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5]},
                 "deepseek_v4": DSV4}
# stored as the release is: llama.cpp's DeepSeek-V4 converter repacks the routed experts' FP4 codes and E8M0 scales
# into MXFP4 and refuses experts without scales (conversion/deepseek.py _write_mxfp4_expert_tensor)
QUANTIZED = {"deepseek_v4": "fp8-ue8m0-fp4-experts"}
# MiMo-V2.5 / Pro: the fused qkv_proj layout (the table's fixture is Flash's, split q / k / v)
MIMO_PRO = {"architectures": ["MiMoV2ForCausalLM"], "model_type": "mimo_v2", "attention_projection_layout": "fused_qkv"}
# DeepSeek's tokenizer_config says add_bos_token, and llama.cpp's DeepSeek-V3.2 converter asserts it
ADD_BOS = {"deepseek_v32", "deepseek_v4"}
# the families whose converter fails under this project's transformers 5 (it rewrites their configs: MiMo-V2's
# partial_rotary_factor, Step-3.5's num_attention_groups; it reads no add_bos_token for DeepSeek-V3.2): converted
# under the converter's own pin, transformers 4.57.6 (make llama-convert-venv). The others stay in this venv, where
# they were checked (Nemotron-H fails under 4.57.6, whose NemotronHConfig gives no n_shared_experts).
PINNED = {"mimo_v2", "step3p5", "deepseek_v32"}


def llama_source(family: str, dest: Path, vocab: int = 128, more: dict | None = None) -> Path:
    """The family's table fixture as llama.cpp takes it (and ``more`` config fields), with the test tokenizer."""
    overrides = {"vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2, **LLAMA_FIXTURE.get(family, {}),
                 **(more or {})}
    options = FixtureOptions(num_shards=1, **FIXTURE_OPTIONS.get(family, {}), config_overrides=overrides)
    src = (make_quantized_checkpoint(family, dest, QuantOptions(QUANTIZED[family]), options) if family in QUANTIZED
           else make_checkpoint(family, dest, options))
    tokenizer.write_tokenizer(src, vocab, add_bos=family in ADD_BOS)
    return src


def convert(jobs: list[list], cwd: Path, tree: Path, pinned: bool = False) -> None:
    """llama.cpp's converter (from the source ``tree``) on each job (its arguments), with its own gguf-py, in this
    project's venv, or ``pinned``: under its requirements' transformers 4.57.6."""
    if not jobs:
        return
    (cwd / "convert-jobs.json").write_text(json.dumps([[str(a) for a in j] for j in jobs]))
    python = convert_python() if pinned else sys.executable
    r = subprocess.run([str(python), str(CONVERT), str(tree), str(cwd / "convert-jobs.json")], cwd=cwd,
                       capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
