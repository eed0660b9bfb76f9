"""Issue 14, drafts: a draft that does not belong, has the wrong dtypes or diverges is refused before
anything is written; accepted drafts give outputs that validate and say what they are. Also the
numerics of `diff --stats` (inf / NaN counted, strict JSON) and torch's thread count (never set by
a worker thread)."""

from __future__ import annotations

import json
import shutil
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools.io.checkpoint import Checkpoint

from conftest import run_ckpt as ckpt

FP8_DIMS = {"hidden_size": 160, "moe_intermediate_size": 136, "q_lora_rank": 136, "kv_lora_rank": 24}
MTP = "model.layers.3."  # the DeepSeek-V3 fixture's MTP layer
Q_B = MTP + "self_attn.q_b_proj.weight"


def edit(draft: Path, fn) -> None:
    """Change the tensors of every safetensors file of ``draft`` in place (``fn`` edits the dict)."""
    for f in draft.glob("*.safetensors"):
        tensors = load_file(str(f))
        fn(tensors)
        save_file(tensors, str(f), metadata={"format": "pt"})


def refused(draft, verifier, tmp_path, rule: str, *extra, named: tuple[str, ...] = ()) -> str:
    """The stitch exits 3 naming the rule (and keys), without a traceback and without a complete output."""
    out = tmp_path / f"out-{rule}"
    r = ckpt("stitch", draft, verifier, "-o", out, *extra, code=3)
    assert f"[{rule}]" in r.output, r.output
    for key in named:
        assert key in r.output, (key, r.output)
    assert not (out / "model.safetensors.index.json").exists() and not (out / "ckpt_manifest.json").exists()
    return r.output


def report(out: Path) -> dict:
    return json.loads((out / "stitch-report.json").read_text())


@pytest.fixture
def ds(make_fixture, tmp_path):
    verifier = make_fixture("deepseek_v3")
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft)
    return verifier, draft


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """An FP8 DeepSeek-V3 verifier with partial edge tiles, and its FP8 draft (extracted as stored)."""
    from ckpt_tools.testing import FixtureOptions, make_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    verifier = make_checkpoint("deepseek_v3", root / "v", FixtureOptions(fp8=True, config_overrides=FP8_DIMS))
    ckpt("extract", verifier, "-o", root / "draft8")
    ckpt("extract", verifier, "-o", root / "draft16", "--dequant", "bf16")
    return verifier, root / "draft8", root / "draft16"


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------
# dtype policy


@pytest.mark.parametrize(("key", "dtype"), [
    (MTP + "enorm.weight", torch.bool),  # a norm
    (MTP + "mlp.gate.e_score_correction_bias", torch.int32),  # a float bias
    (MTP + "mlp.gate.e_score_correction_bias", torch.int16),
])
@pytest.mark.parametrize("dtype_opt", ["verifier", "draft"])
def test_non_float_draft_tensors_are_refused(ds, tmp_path, key, dtype, dtype_opt):
    verifier, draft = ds
    edit(draft, lambda t: t.__setitem__(key, t[key].to(dtype)))
    refused(draft, verifier, tmp_path, "draft-dtype", "--dtype", dtype_opt, named=(key,))


def test_a_non_float_verifier_tensor_takes_only_its_own_dtype(make_fixture, tmp_path):
    bias = MTP + "mlp.gate.e_score_correction_bias"
    verifier = copy(make_fixture("deepseek_v3"), tmp_path / "v")
    edit(verifier, lambda t: bias in t and t.__setitem__(bias, (t[bias] * 1000).to(torch.int32)))  # same size
    draft = tmp_path / "draft"
    ckpt("extract", verifier, "-o", draft)
    edit(draft, lambda t: t.__setitem__(bias, t[bias] + 1))  # still I32: replaces it
    out = tmp_path / "out"
    ckpt("stitch", draft, verifier, "-o", out)
    assert _tensor(out, bias).dtype == torch.int32 and torch.equal(_tensor(out, bias), _tensor(draft, bias))
    edit(draft, lambda t: t.__setitem__(bias, t[bias].float()))
    refused(draft, verifier, tmp_path, "draft-dtype", named=(bias, "I32"))


def _tensor(path: Path, key: str) -> torch.Tensor:
    return Checkpoint.open(path).tensors[key].torch()


def test_e5m2_weight_is_requantized_into_the_verifiers_e4m3(fp8, tmp_path):
    from quant_helpers import fp8_dequant as dequantize
    from quant_helpers import quantize

    verifier, draft8, _ = fp8
    draft = copy(draft8, tmp_path / "d")
    edit(draft, lambda t: t.__setitem__(Q_B, t[Q_B].float().to(torch.float8_e5m2)))  # same scale, coarser codes
    out = tmp_path / "out"
    ckpt("stitch", draft, verifier, "-o", out)
    c, d = Checkpoint.open(out), Checkpoint.open(draft)
    assert c.tensors[Q_B].dtype == "F8_E4M3" and c.tensors[Q_B + "_scale_inv"].dtype == "F32"
    q, s = quantize(dequantize(d.tensors[Q_B].torch(), d.tensors[Q_B + "_scale_inv"].torch()))
    assert torch.equal(c.tensors[Q_B].torch().view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(c.tensors[Q_B + "_scale_inv"].torch(), s)
    entry = {t["key"]: t for t in report(out)["tensors"]}[Q_B]
    assert entry["status"] == "replaced" and entry["cosine"] > 0.99  # compared by value, not by FP8 bytes
    ckpt("validate", out)


def test_e5m2_experts_are_requantized_too(fp8, tmp_path):
    verifier, draft8, _ = fp8
    draft = copy(draft8, tmp_path / "d")

    def to_e5m2(t):
        for k in list(t):
            if ".mlp.experts." in k and t[k].dtype == torch.float8_e4m3fn:
                t[k] = t[k].float().to(torch.float8_e5m2)

    edit(draft, to_e5m2)
    out = tmp_path / "out"
    ckpt("stitch", draft, verifier, "-o", out)
    experts = {k: r.dtype for k, r in Checkpoint.open(out).tensors.items() if ".mlp.experts." in k}
    assert experts and set(experts.values()) == {"F8_E4M3", "F32"}
    ckpt("validate", out)


@pytest.mark.parametrize(("change", "rule"), [
    (lambda s: s.to(torch.int32), "fp8-scale-dtype"),
    (lambda s: s[:, :1].contiguous(), "fp8-scale-shape"),  # was written, then failed validation silently
    (lambda s: torch.cat([s, s], 0), "fp8-scale-shape"),
])
def test_bad_draft_scales_are_refused(fp8, tmp_path, change, rule):
    verifier, draft8, _ = fp8
    draft = copy(draft8, tmp_path / "d")
    edit(draft, lambda t: t.__setitem__(Q_B + "_scale_inv", change(t[Q_B + "_scale_inv"])))
    refused(draft, verifier, tmp_path, rule, named=(Q_B + "_scale_inv",))


def test_a_bf16_draft_scale_is_widened_exactly(fp8, tmp_path):
    verifier, draft8, _ = fp8
    draft = copy(draft8, tmp_path / "d")
    edit(draft, lambda t: t.__setitem__(Q_B + "_scale_inv", t[Q_B + "_scale_inv"].to(torch.bfloat16)))
    out = tmp_path / "out"
    ckpt("stitch", draft, verifier, "-o", out)
    got = Checkpoint.open(out).tensors[Q_B + "_scale_inv"]
    assert got.dtype == "F32" and torch.equal(got.torch(), _tensor(draft, Q_B + "_scale_inv").float())
    assert torch.equal(_tensor(out, Q_B).view(torch.uint8), _tensor(draft, Q_B).view(torch.uint8))
    ckpt("validate", out)


def test_a_draft_in_the_verifiers_own_fp8_format_keeps_its_bytes(fp8, tmp_path):
    """Codes halved under the same scales: no block's scale is amax / 448 of its codes any more, so encoding the
    values again would write other bytes (scale halved, codes doubled). The draft's bytes and scale go in as they
    are, and the decision says so."""
    verifier, draft8, _ = fp8
    draft = copy(draft8, tmp_path / "d")
    edit(draft, lambda t: t.__setitem__(Q_B, (t[Q_B].float() / 2).to(torch.float8_e4m3fn)))
    out = tmp_path / "out"
    from ckpt_tools.api import stitch

    ckpt("stitch", draft, verifier, "-o", out, "--accept-divergent")
    assert torch.equal(_tensor(out, Q_B).view(torch.uint8), _tensor(draft, Q_B).view(torch.uint8))
    assert torch.equal(_tensor(out, Q_B + "_scale_inv"), _tensor(draft, Q_B + "_scale_inv"))
    assert not torch.equal(_tensor(out, Q_B).view(torch.uint8), _tensor(verifier, Q_B).view(torch.uint8))
    planned = stitch(draft, verifier, tmp_path / "dry", dry_run=True, accept_divergent=True).details.decisions
    reason = next(d.reason for d in planned if d.key == Q_B)
    assert "bytes and scale as they are" in reason, reason
    ckpt("validate", out)


def test_dtype_draft_into_an_fp8_verifier_is_coherent(fp8, tmp_path):
    verifier, _, draft16 = fp8
    out = tmp_path / "out"
    ckpt("stitch", draft16, verifier, "-o", out, "--dtype", "draft")  # no --allow-partial, no scale "missing"
    c, v = Checkpoint.open(out), Checkpoint.open(verifier)
    bf16 = [k for k, ref in c.tensors.items() if k.startswith(MTP) and ref.dtype == "BF16" and
            v.tensors[k].dtype == "F8_E4M3"]
    assert bf16 and not [k for k in bf16 if k + "_scale_inv" in c.tensors]  # no leftover scale
    assert not [k for k in c.tensors if k.startswith(MTP) and k.endswith("_scale_inv")]
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    from transformers.quantizers.quantizers_utils import should_convert_module  # the consumer's matcher

    assert q["quant_method"] == "fp8"
    assert not [k for k in bf16 if should_convert_module(k.removesuffix(".weight"), q["modules_to_not_convert"])]
    assert json.loads(ckpt("validate", out, "--json").output)["ok"] is True
    rep = report(out)
    assert {t["key"] for t in rep["tensors"] if t["status"] == "removed"} == {k + "_scale_inv" for k in bf16}


def test_dtype_draft_keeps_an_fp8_drafts_own_format(fp8, tmp_path):
    verifier, draft8, _ = fp8
    out = tmp_path / "out"
    ckpt("stitch", draft8, verifier, "-o", out, "--dtype", "draft")
    assert (out / "config.json").read_bytes() == (verifier / "config.json").read_bytes()  # nothing unquantized
    assert json.loads(ckpt("diff", verifier, out, "--json").output)["identical"] is True


# ---------------------------------------------------------------------------
# drafts prove they belong


@pytest.fixture
def spec_draft(make_fixture, tmp_path):
    """A speculators draft as trainers save it: no ckpt_manifest.json, the speculators config."""
    verifier = make_fixture("qwen3_next")
    draft = tmp_path / "spec"
    ckpt("extract", verifier, "-o", draft, "--format", "speculators")
    (draft / "ckpt_manifest.json").unlink()
    return verifier, draft


def test_speculators_draft_without_manifest_proves_itself_by_its_config(spec_draft, tmp_path):
    verifier, draft = spec_draft
    r = json.loads(ckpt("stitch", draft, verifier, "-o", tmp_path / "out", "--json").output)
    assert "transformer_layer_config.model_type = qwen3_next" in r["provenance"]


@pytest.mark.parametrize("field", ["model_type", "verifier"])
def test_speculators_draft_of_another_family_is_refused(spec_draft, tmp_path, field):
    verifier, draft = spec_draft
    cfg = json.loads((draft / "config.json").read_text())
    if field == "model_type":
        cfg["transformer_layer_config"]["model_type"] = "deepseek_v3"
    else:
        cfg["speculators_config"]["verifier"]["architectures"] = ["Glm4MoeForCausalLM"]
    (draft / "config.json").write_text(json.dumps(cfg))
    text = refused(draft, verifier, tmp_path, "wrong-family", named=("--arch",))
    assert ("deepseek_v3" if field == "model_type" else "Glm4MoeForCausalLM") in text


def test_a_draft_without_evidence_is_refused_and_arch_overrides(ds, tmp_path):
    verifier, draft = ds
    (draft / "ckpt_manifest.json").unlink()
    cfg = json.loads((draft / "config.json").read_text())
    for k in ("model_type", "architectures"):
        cfg.pop(k)
    (draft / "config.json").write_text(json.dumps(cfg))
    refused(draft, verifier, tmp_path, "draft-unproven", named=("--arch",))
    r = json.loads(ckpt("stitch", draft, verifier, "-o", tmp_path / "ok", "--arch", "deepseek_v3", "--json").output)
    assert r["provenance"] == "asserted with --arch deepseek_v3"


def test_a_manifest_of_another_family_is_refused_unless_arch(ds, tmp_path):
    verifier, draft = ds
    m = json.loads((draft / "ckpt_manifest.json").read_text())
    m["family"] = "glm4_moe"
    (draft / "ckpt_manifest.json").write_text(json.dumps(m))
    refused(draft, verifier, tmp_path, "wrong-family", named=("glm4_moe", "--arch"))
    ckpt("stitch", draft, verifier, "-o", tmp_path / "ok", "--arch", "deepseek_v3")


# ---------------------------------------------------------------------------
# divergence


def test_swapped_gate_up_halves_are_divergent(spec_draft, tmp_path):
    verifier, draft = spec_draft
    key = "mtp_layers.0.mlp.experts.gate_up_proj"

    def swap(t):
        half = t[key].shape[1] // 2
        t[key] = torch.cat([t[key][:, half:], t[key][:, :half]], 1).contiguous()

    edit(draft, swap)
    text = refused(draft, verifier, tmp_path, "divergent", named=("mtp.layers.0.mlp.experts.0.gate_proj.weight",
                                                                  "cosine", "--accept-divergent"))
    assert "Nothing was written" in text
    out = tmp_path / "accepted"
    r = ckpt("stitch", draft, verifier, "-o", out, "--accept-divergent")
    assert "divergent, stitched with --accept-divergent" in r.output
    rep = report(out)
    gate = {t["key"]: t for t in rep["tensors"]}["mtp.layers.0.mlp.experts.0.gate_proj.weight"]
    assert gate["cosine"] < 0.2 and "cosine" in gate["divergent"]
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in rep["divergence"]["divergent"]


def test_a_realistically_finetuned_draft_is_accepted_and_every_cosine_reported(ds, tmp_path):
    verifier, draft = ds
    rng = np.random.default_rng(0)

    def finetune(t):  # every MTP weight moved by as much as its own RMS: cosine ~0.7 (lr 3e-4 territory)
        for k, v in t.items():
            if v.is_floating_point() and v.dim() == 2 and "embed" not in k and "head" not in k:
                noise = torch.from_numpy(rng.standard_normal(tuple(v.shape)).astype(np.float32))
                t[k] = (v.float() + noise * v.float().pow(2).mean().sqrt()).to(v.dtype)

    edit(draft, finetune)
    out = tmp_path / "out"
    ckpt("stitch", draft, verifier, "-o", out)
    rep = report(out)
    replaced = [t for t in rep["tensors"] if t["status"] == "replaced"]
    assert len(replaced) > 10 and not rep["divergence"]["divergent"]
    assert all(0.5 < t["cosine"] < 0.9 and "norm_a" in t for t in replaced)


def test_a_norm_ratio_beyond_4x_is_divergent(ds, tmp_path):
    verifier, draft = ds
    key = MTP + "eh_proj.weight"
    edit(draft, lambda t: t.__setitem__(key, t[key] * 5))  # cosine 1, but five times the verifier's norm
    refused(draft, verifier, tmp_path, "divergent", named=(key, "norm ratio"))


def test_an_init_draft_is_exempt(make_fixture, tmp_path):
    verifier = make_fixture("qwen3_next")
    draft = tmp_path / "init"
    ckpt("init-draft", verifier, "-o", draft)  # random values: cosine ~0 with the verifier's MTP
    rep = json.loads(ckpt("stitch", draft, verifier, "-o", tmp_path / "out", "--json").output)
    assert "from scratch" in rep["divergence"]["exempt"] and not rep["divergence"]["divergent"]
    assert all("cosine" in t for t in rep["tensors"] if t["status"] == "replaced")


PRODUCED = Path(__file__).resolve().parents[1] / "fixtures" / "producers" / "transformers-deepseek_v3"
PRODUCED_MTP = "model.layers.2."  # its MTP layer


def _swapped_halves_with_an_init_manifest(tmp_path: Path) -> Path:
    """A draft of transformers' own DeepSeek-V3 checkpoint with every expert's gate and up halves exchanged, and
    beside it the manifest init-draft wrote for another draft (issue 40: verify-manifest finds most digests wrong)."""
    init, draft = tmp_path / "init", tmp_path / "draft"
    ckpt("init-draft", PRODUCED, "-o", init)
    ckpt("extract", PRODUCED, "-o", draft)

    def swap(t):
        for e in range(4):
            g, u = f"{PRODUCED_MTP}mlp.experts.{e}.gate_proj.weight", f"{PRODUCED_MTP}mlp.experts.{e}.up_proj.weight"
            t[g], t[u] = t[u], t[g]

    edit(draft, swap)
    shutil.copy(init / "ckpt_manifest.json", draft / "ckpt_manifest.json")
    return draft


def test_an_init_manifest_beside_other_bytes_is_not_evidence(tmp_path):
    draft = _swapped_halves_with_an_init_manifest(tmp_path)
    assert ckpt("verify-manifest", draft, code=1)
    text = refused(draft, PRODUCED, tmp_path, "divergent", named=(f"{PRODUCED_MTP}mlp.experts.0.gate_proj.weight",))
    assert "[manifest-mismatch]" in text and f"{draft}/ckpt_manifest.json" in text  # the file, the key, the rule
    assert "exempt" in text  # says why the init claim did not exempt it
    rep = json.loads(ckpt("stitch", draft, PRODUCED, "-o", tmp_path / "out", "--accept-divergent", "--json").output)
    assert "exempt" not in rep["divergence"] and len(rep["divergence"]["divergent"]) == 8
    assert "[manifest-mismatch]" in rep["manifest_mismatch"] and rep["provenance"].startswith("config.json")


def _name_no_model(draft: Path) -> None:
    """The draft's config.json without the fields that name its model: only its manifest could say."""
    config = json.loads((draft / "config.json").read_text())
    for field in ("model_type", "architectures"):
        config.pop(field, None)
    (draft / "config.json").write_text(json.dumps(config))


def test_a_trained_init_draft_keeps_its_family_but_is_judged_as_a_finetune(tmp_path):
    """Training changes values, not names, dtypes or shapes: the manifest's family claim stands (the config here
    names no model), its init claim does not (its digests are of the untrained bytes), so the draft is judged as
    a finetune of the verifier's MTP, which it is not."""
    draft = tmp_path / "init"
    ckpt("init-draft", PRODUCED, "-o", draft)

    def train(t):
        for k, v in t.items():
            t[k] = (v.float() * 1.01).to(v.dtype)

    edit(draft, train)
    _name_no_model(draft)
    text = refused(draft, PRODUCED, tmp_path, "divergent")
    assert "[manifest-mismatch]" in text and "exempt" in text
    rep = json.loads(ckpt("stitch", draft, PRODUCED, "-o", tmp_path / "out", "--accept-divergent", "--json").output)
    assert rep["provenance"].startswith("ckpt_manifest.json") and "[manifest-mismatch]" in rep["manifest_mismatch"]


def test_a_manifest_of_other_tensors_proves_no_family(tmp_path):
    """The init manifest lists the draft's router in another dtype: it describes another draft, so its family claim
    is not evidence, and a draft whose config names no model is unproven."""
    draft = _swapped_halves_with_an_init_manifest(tmp_path)
    _name_no_model(draft)
    text = refused(draft, PRODUCED, tmp_path, "draft-unproven")
    assert "[manifest-mismatch]" in text and "lists no tensor of this name" in text


def test_an_untouched_init_draft_of_a_real_checkpoint_stays_exempt(tmp_path):
    draft = tmp_path / "init"
    ckpt("init-draft", PRODUCED, "-o", draft)
    rep = json.loads(ckpt("stitch", draft, PRODUCED, "-o", tmp_path / "out", "--json").output)
    assert "from scratch" in rep["divergence"]["exempt"] and "manifest_mismatch" not in rep
    assert rep["provenance"].startswith("ckpt_manifest.json")


def test_the_gate_pool_stops_on_error():
    from ckpt_tools.ops.stitch.compare import _in_parallel

    started = threading.Event()

    def work(item, stop):
        if item == 0:
            started.wait(5)
            raise ValueError("read error")
        started.set()
        assert stop.wait(5), "never told to stop"
        return item

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="read error"):
        _in_parallel(work, [0, 1, 2, 3])
    assert not {t.name for t in threading.enumerate() if t.name.startswith("ckpt-gate")} - before


# ---------------------------------------------------------------------------
# diff --stats numerics


@pytest.fixture
def extremes(tmp_path):
    a = {"x": [1e300, 1.0], "y": [float("nan"), 2.0], "z": [1e300, -1e300], "w": [float("inf"), 5.0]}
    b = {"x": [float("inf"), 1.0], "y": [3.5, 2.0], "z": [-1e300, 1e300], "w": [float("inf"), 6.0]}
    for name, values in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        save_file({k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()},
                  str(tmp_path / name / "model.safetensors"))
    return tmp_path / "a", tmp_path / "b"


def _strict(text: str) -> dict:
    def bare(c):
        raise ValueError(f"not JSON: {c}")

    return json.loads(text, parse_constant=bare)


def test_diff_stats_count_inf_and_nan_and_emit_strict_json(extremes):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy RuntimeWarning would be an exit-5 failure here
        r = ckpt("diff", *extremes, "--stats", "--json", code=1)
    t = {d["key"]: d for d in _strict(r.output)["tensors"]}
    assert t["x"]["max_abs"] == "inf" and t["x"]["inf_count"] == 1  # 1e300 vs +inf: inf, never 1e300
    assert t["y"]["max_abs"] is None and t["y"]["nan_count"] == 1  # NaN vs 3.5: never 3.5
    assert t["y"]["cosine"] == 1.0 and t["y"]["rel_l2"] == 0.0  # over the finite pairs
    assert t["z"]["max_abs"] == pytest.approx(2e300) and t["z"]["cosine"] == -1.0  # no overflow to NaN
    assert t["w"]["max_abs"] == 1.0 and t["w"]["inf_count"] == 1  # the same infinity on both sides: no difference
    human = ckpt("diff", *extremes, "--stats", code=1).output
    assert "inf (1 Inf)" in human and "nan (1 NaN)" in human and "both sides are finite" in human


def test_float32_overflowing_squares_stay_finite(tmp_path):
    for name, v in (("a", [3e38, 1.0, 2e19]), ("b", [-3e38, 1.0, -2e19])):
        (tmp_path / name).mkdir()
        save_file({"t": torch.tensor(v, dtype=torch.float32)}, str(tmp_path / name / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = ckpt("diff", tmp_path / "a", tmp_path / "b", "--stats", "--json", code=1)
    t = _strict(r.output)["tensors"][0]
    assert t["max_abs"] == pytest.approx(6e38, rel=1e-6) and t["cosine"] == pytest.approx(-1.0)
    assert "nan_count" not in t and "inf_count" not in t


# ---------------------------------------------------------------------------
# threads


def test_no_worker_thread_sets_torchs_thread_count(fp8, tmp_path, monkeypatch):
    from ckpt_tools.model.quant import encode_block
    from ckpt_tools.stream.plan import CopyBytes, OutputTensor

    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads",
                        lambda n: (calls.append(threading.current_thread().name), real(n)))
    verifier, _, draft16 = fp8
    w = Checkpoint.open(draft16).tensors[Q_B]  # torch work: re-quantizing the draft's values
    recipe = encode_block.requantize(OutputTensor(Q_B, w.dtype, w.shape, CopyBytes([w.segment()])), (128, 128),
                                   Q_B + "_scale_inv")[0].recipe
    real(2)  # a count to switch from
    try:
        done = []
        th = threading.Thread(target=lambda: done.append(sum(x.numel() for x in recipe.produce())), name="user")
        th.start()
        th.join()
        assert done == [w.numel]
        assert sum(x.numel() for x in recipe.produce()) == w.numel  # from the main thread: set there
        d = copy(draft16, tmp_path / "d")
        edit(d, lambda t: t.__setitem__(Q_B, (t[Q_B].float() * 1.1).to(torch.bfloat16)))
        ckpt("stitch", d, verifier, "-o", tmp_path / "out")  # requantizes: torch work in the writer and the gate
        assert torch.get_num_threads() == 2
    finally:
        real(1)
    assert calls and set(calls) == {threading.main_thread().name}
