"""Conformance over the real producers' corpus (fixtures/producers/, issue 24).

Every checkpoint there was written by the tool that writes it in the wild (transformers' save_pretrained,
llm-compressor's oneshot, ModelOpt's export, speculators' converter, torch.save / DCP as AngelSpec calls
them); none was generated from our tables. Each verb runs over each of them through the CLI, and its
output is held to the consumer's own loader where one installs here (transformers, compressed-tensors).
A verb either gives a correct output or refuses with a rule: none exits 0 with a wrong result.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from functools import cache
from pathlib import Path

import pytest
import transformers  # before any in-process CLI run: its log handler keeps a stream that stays open
from safetensors import safe_open

from conftest import run_ckpt as ckpt

CORPUS = Path(os.environ.get("CKPT_PRODUCERS", Path(__file__).resolve().parents[1] / "fixtures" / "producers"))


def _entries() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(CORPUS.glob("*.json"))]


ENTRIES = {e["id"]: e for e in _entries()}
CHECKPOINTS = [e for e in ENTRIES.values() if e["kind"] == "checkpoint"]
WITH_MTP = [e for e in CHECKPOINTS if e["mtp"] == "present"]
DROPPED = [e for e in CHECKPOINTS if e["mtp"] == "dropped-by-producer"]
DRAFTS = [e for e in ENTRIES.values() if e["kind"] in ("draft", "trainer-output")]
QUANTIZED = [e for e in CHECKPOINTS if e["scheme"]]


def ids(entries: list[dict]) -> list[str]:
    return [e["id"] for e in entries]


def path_of(entry: dict) -> Path:
    return CORPUS / entry["id"]


def as_json(result) -> dict | list:
    return json.loads(result.stdout)


@cache
def formats_of(family: str) -> tuple[str, ...]:
    """The draft formats our table says the family can be extracted to."""
    table = next(t for t in as_json(ckpt("tables", "--json")) if t["family"] == family)
    return tuple(f for f, why in table["formats"].items() if why == "ok")


def tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of a checkpoint directory: key -> (dtype, shape, raw bytes)."""
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(key)
                out[key] = (str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(__import__("torch").uint8)
                            .numpy().tobytes())
    return out


def config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# -- the corpus itself ------------------------------------------------------------------------------


def test_corpus_holds_every_producer_the_issue_names():
    producers = {(e["producer"], e["scheme"]) for e in ENTRIES.values()}
    for scheme in ("FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16"):
        assert ("llm-compressor", scheme) in producers, scheme
    assert any(p == "llm-compressor" and s and s.startswith("W4A16") for p, s in producers)
    assert any(p == "nvidia-modelopt" and s == "FP8_DEFAULT_CFG" for p, s in producers)
    assert {e["family"] for e in ENTRIES.values() if e["producer"] == "transformers"} >= {
        "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe"}
    assert any(e["producer"] == "speculators" for e in ENTRIES.values())
    kinds = {e["id"].split("-")[1] for e in ENTRIES.values() if e["producer"].lower().startswith("angelspec")}
    assert {"bin", "dcp"} <= kinds


@pytest.mark.parametrize("entry", ENTRIES.values(), ids=ids(list(ENTRIES.values())))
def test_catalogue_entry_is_consistent(entry):
    assert path_of(entry).is_dir(), entry["id"]
    if entry["source"] is not None:
        assert entry["source"] in ENTRIES, f"{entry['id']}: unknown source {entry['source']}"


# -- read-only verbs: inspect never refuses a readable checkpoint; validate says what is wrong ----------


@pytest.mark.parametrize("entry", CHECKPOINTS, ids=ids(CHECKPOINTS))
def test_inspect_reports_what_is_stored(entry):
    report = as_json(ckpt("inspect", path_of(entry), "--json", code=None))
    assert report["family"] == entry["family"]
    declared = report["mtp_layers"] if "mtp_layers" in report else report["mtp"]["layers"]
    assert declared >= 1


@pytest.mark.parametrize("entry", WITH_MTP, ids=ids(WITH_MTP))
def test_validate_accepts_a_complete_release(entry):
    report = as_json(ckpt("validate", path_of(entry), "--json"))
    assert report["ok"] is True, report


@pytest.mark.parametrize("entry", DROPPED, ids=ids(DROPPED))
def test_validate_names_the_dropped_mtp(entry):
    report = as_json(ckpt("validate", path_of(entry), "--json", code=1))
    assert report["ok"] is False
    assert "mtp-missing" in {p["rule"] for p in report["problems"]}, report


# -- graft: every quantizer output gets its release's MTP back, the trunk byte-identical ----------------


@pytest.fixture(scope="module")
def grafted(tmp_path_factory):
    done: dict[str, Path] = {}

    def run(entry: dict) -> Path:
        if entry["id"] not in done:
            out = tmp_path_factory.mktemp("graft") / entry["id"]
            ckpt("graft", path_of(ENTRIES[entry["source"]]), path_of(entry), "-o", out, "--json")
            done[entry["id"]] = out
        return done[entry["id"]]

    return run


@pytest.mark.parametrize("entry", DROPPED, ids=ids(DROPPED))
def test_graft_restores_mtp_and_keeps_the_trunk(entry, grafted):
    out = grafted(entry)
    target, source, result = tensors(path_of(entry)), tensors(path_of(ENTRIES[entry["source"]])), tensors(out)
    mtp = set(result) - set(target)
    assert mtp, "graft added no tensor"
    for key in target:
        assert result[key] == target[key], f"trunk tensor {key} changed"
    for key in mtp:
        assert result[key] == source[key], f"MTP tensor {key} is not the source's"
    assert as_json(ckpt("validate", out, "--json"))["ok"] is True


CT_DROPPED = [e for e in DROPPED if "compressed-tensors" in e["loaders"]]


def _linear_tree(names: dict[str, tuple[int, int]]):
    """Empty ``nn.Linear`` modules under the checkpoint's module names: what compressed-tensors matches against."""
    import torch

    root = torch.nn.Module()
    for name, (rows, cols) in names.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, torch.nn.Linear(cols, rows, bias=False, device="meta"))
    return root


TRUNK_LAYER = re.compile(r"^model\.layers\.\d+\.")


def grafted_linears(entry: dict, out: Path, excluded: list[str]) -> dict[str, tuple[int, ...]]:
    """The linear modules graft added (every 2-D weight but the embedding), less those the quantizer itself left
    out in the trunk by name (``excluded``): the MoE router, which llm-compressor's and ModelOpt's recipes skip
    in every layer and no engine builds quantized (vLLM and SGLang make it with quant_config=None)."""
    before = tensors(path_of(entry))
    added = {k: v for k, v in tensors(out).items() if k not in before}
    trunk_excluded = {TRUNK_LAYER.sub("", i) for i in excluded if TRUNK_LAYER.match(i)}
    linears = {k.removesuffix(".weight"): v[1] for k, v in added.items()
               if k.endswith(".weight") and len(v[1]) == 2 and not k.endswith("embed_tokens.weight")}
    kept = {m: shape for m, shape in linears.items() if TRUNK_LAYER.sub("", m) not in trunk_excluded}
    assert kept, f"graft added no linear module to {out}"
    return kept


@pytest.mark.parametrize("entry", CT_DROPPED, ids=ids(CT_DROPPED))
def test_compressed_tensors_leaves_grafted_mtp_unquantized(entry, grafted):
    """compressed-tensors' own ``apply_quantization_config`` over graft's MTP linear modules leaves each of them
    unquantized, as they are stored."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    out = grafted(entry)
    qc = config(out)["quantization_config"]
    model = _linear_tree(grafted_linears(entry, out, config(path_of(entry))["quantization_config"].get("ignore", [])))
    apply_quantization_config(model, QuantizationConfig.model_validate(qc))
    quantized = [name for name, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    assert not quantized, f"compressed-tensors would build these MTP modules quantized: {quantized[:5]}"


MODELOPT_DROPPED = [e for e in DROPPED if e["producer"] == "nvidia-modelopt"]


@pytest.mark.parametrize("entry", MODELOPT_DROPPED, ids=ids(MODELOPT_DROPPED))
def test_modelopt_exclusions_cover_grafted_mtp(entry, grafted):
    """ModelOpt's consumers (vLLM's ModelOpt configs, TensorRT-LLM) skip a module whose name matches an
    ``exclude_modules`` glob (fnmatch); config.json's copy of the list must say the same."""
    out = grafted(entry)
    source_hf = json.loads((path_of(entry) / "hf_quant_config.json").read_text())["quantization"]
    modules = grafted_linears(entry, out, source_hf["exclude_modules"])
    hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    cfg = config(out)["quantization_config"]["ignore"]
    for globs in (hf, cfg):
        unmatched = [m for m in modules if not any(fnmatch.fnmatchcase(m, g) for g in globs)]
        assert not unmatched, f"ModelOpt would quantize {unmatched[:5]}"


@pytest.mark.parametrize("entry", [e for e in DROPPED if "transformers" in e["loaders"]],
                         ids=ids([e for e in DROPPED if "transformers" in e["loaders"]]))
def test_transformers_loads_the_grafted_trunk_as_stored(entry, grafted):
    """transformers (with the producer's quantizer) loads graft's output: nothing missing, only MTP keys
    unexpected, and the trunk's logits are the quantizer output's own, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    out = grafted(entry)
    added = set(tensors(out)) - set(tensors(path_of(entry)))
    prefixes = {".".join(k.split(".")[:3]) + "." if k.startswith("model.layers.") else k.split(".")[0] + "."
                for k in added}
    ids_ = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    logits = []
    for path in (path_of(entry), out):
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        stray = [k for k in info["unexpected_keys"] if not any(k.startswith(p) for p in prefixes)]
        assert not stray, f"{path}: unexpected non-MTP keys {stray[:5]}"
        try:
            with torch.no_grad():
                logits.append(model(ids_).logits)
        except RuntimeError as e:  # the quantizer's own CPU forward cannot run this scheme: loading is the check
            pytest.skip(f"{entry['id']}: transformers' forward on CPU fails for the producer's own output: {e}")
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("entry", DROPPED, ids=ids(DROPPED))
def test_diff_names_what_graft_changed(entry, grafted):
    out = grafted(entry)
    report = as_json(ckpt("diff", path_of(entry), out, "--json", code=1))
    text = json.dumps(report)
    assert "added" in text
    assert "config" in text, "diff does not mention the config graft rewrote"


# -- extract into every format, stitch back: the verifier again, byte for byte -------------------------


def _roundtrips() -> list[tuple[dict, str]]:
    return [(e, f) for e in WITH_MTP for f in ("native", "sglang-nextn", "speculators", "angelspec")]


@pytest.mark.parametrize(("entry", "fmt"), _roundtrips(), ids=[f"{e['id']}-{f}" for e, f in _roundtrips()])
def test_extract_then_stitch_is_the_verifier_again(entry, fmt, tmp_path):
    src = path_of(entry)
    if fmt not in formats_of(entry["family"]):
        result = ckpt("extract", src, "-o", tmp_path / "draft", "--format", fmt, code=3)
        assert "format-unsupported" in result.output + result.stderr
        return
    ckpt("extract", src, "-o", tmp_path / "draft", "--format", fmt, "--json")
    ckpt("stitch", tmp_path / "draft", src, "-o", tmp_path / "back", "--json")
    assert tensors(tmp_path / "back") == tensors(src)


@pytest.mark.parametrize("entry", WITH_MTP, ids=ids(WITH_MTP))
def test_drop_mtp_gives_a_trunk_transformers_loads_whole(entry, tmp_path):
    """The trunk without MTP: transformers loads every tensor, none missing, none unexpected."""
    ckpt("extract", path_of(entry), "-o", tmp_path / "trunk", "--drop-mtp", "--json")
    cfg = config(tmp_path / "trunk")
    cls = getattr(transformers, cfg["architectures"][0])
    _, info = cls.from_pretrained(tmp_path / "trunk", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


# -- drafts and trainer outputs back into their verifier ------------------------------------------------


def mtp_keys(path: Path) -> set[str]:
    """The MTP tensors inspect finds in a checkpoint (the table's view, read from what is stored)."""
    return {t["key"] for t in as_json(ckpt("inspect", path, "--json"))["tensors"]}


@pytest.mark.parametrize("entry", DRAFTS, ids=ids(DRAFTS))
def test_draft_stitches_into_its_verifier(entry, tmp_path):
    """A trainer's or converter's draft goes back into its verifier: only MTP tensors change, the output is
    valid. A draft whose files do not say which model it belongs to (AngelSpec's) is refused until --arch says."""
    verifier = path_of(ENTRIES[entry["source"]])
    first = ckpt("stitch", path_of(entry), verifier, "-o", tmp_path / "out", "--json", code=None)
    if first.exit_code == 3:
        assert "draft-unproven" in first.output + first.stderr, first.output
        ckpt("stitch", path_of(entry), verifier, "-o", tmp_path / "out", "--json", "--arch", entry["family"])
    else:
        assert first.exit_code == 0, first.output
    assert as_json(ckpt("validate", tmp_path / "out", "--json"))["ok"] is True
    before, after = tensors(verifier), tensors(tmp_path / "out")
    assert set(before) == set(after), "stitch changed the set of tensors"
    changed = {k for k in before if before[k] != after[k]}
    assert changed <= mtp_keys(verifier), sorted(changed - mtp_keys(verifier))[:5]
    if entry["kind"] == "trainer-output":  # AngelSpec's draft took an optimizer step: every MTP weight moved
        assert changed


@pytest.mark.parametrize("entry", DROPPED, ids=ids(DROPPED))
def test_graft_then_drop_mtp_is_the_quantizer_output_again(entry, grafted, tmp_path):
    """graft adds and --drop-mtp takes away exactly the MTP: the quantizer's own tensors come back bit for bit."""
    ckpt("extract", grafted(entry), "-o", tmp_path / "trunk", "--drop-mtp", "--json")
    assert tensors(tmp_path / "trunk") == tensors(path_of(entry))
    assert config(tmp_path / "trunk")["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("entry", DROPPED, ids=ids(DROPPED))
def test_dequantized_draft_of_a_grafted_checkpoint_declares_no_quantization(entry, grafted, tmp_path):
    """extract --dequant bf16: a draft with no quantized tensor and no quantization config, which transformers'
    own config loader reads as unquantized."""
    from transformers import AutoConfig

    ckpt("extract", grafted(entry), "-o", tmp_path / "draft", "--dequant", "bf16", "--json")
    draft = tmp_path / "draft"
    assert "quantization_config" not in config(draft)
    assert not (draft / "hf_quant_config.json").exists()
    assert getattr(AutoConfig.from_pretrained(draft), "quantization_config", None) is None
    dtypes = {dtype for dtype, _, _ in tensors(draft).values()}
    assert dtypes <= {"torch.bfloat16", "torch.float32"}, dtypes


RUN_ROOTS = [e for e in DRAFTS if (path_of(e) / "latest_checkpointed_iteration.txt").is_file()]


@pytest.mark.parametrize("entry", RUN_ROOTS, ids=ids(RUN_ROOTS))
def test_a_run_root_is_read_through_the_step_it_names_and_a_wrong_name_is_refused(entry, tmp_path):
    import shutil

    report = as_json(ckpt("validate", path_of(entry), "--json"))
    assert report["ok"] is True
    root = tmp_path / "run"
    shutil.copytree(path_of(entry), root)
    (root / "latest_checkpointed_iteration.txt").write_text("7\n")
    result = ckpt("validate", root, code=3)
    assert "no-weights" in result.output + result.stderr and "iter_0000007" in result.output + result.stderr


PROBED = [e for e in CHECKPOINTS if e["mtp"] == "present" or e["producer"] == "nvidia-modelopt"]
# What probe refuses in the corpus, and the rule; every other checkpoint with MTP layers is measured.
PROBE_REFUSED = {
    # the MTP block is unlike every trunk decoder layer: the engine builds it as a copy of one
    "transformers-longcat_flash": "probe-family",
    "transformers-mimo_v2_flash": "probe-family",
    # transformers' own forward fails on these tiny saved configs (glm_ocr: rope sections summing to more
    # than the head dim; step3p7: no sliding_window): no verifier logits to measure against
    "transformers-glm_ocr": "probe-forward",
    "transformers-step3p7": "probe-forward",
}
PROBE_IDS = [5, 17, 9, 23, 4, 11]  # token ids below every corpus vocabulary (256)


@pytest.fixture(scope="module")
def token_prompts(tmp_path_factory) -> Path:
    """One prompt as token ids (the corpus has no tokenizers)."""
    path = tmp_path_factory.mktemp("probe") / "prompts.jsonl"
    path.write_text(json.dumps({"input_ids": PROBE_IDS}) + "\n")
    return path


def probe(path: Path, prompts: Path):
    return ckpt("probe", path, "--prompts", prompts, "--max-new-tokens", 4, "--json", code=None)


def measured(report: dict) -> dict:
    """The verifier's own MTP result of a probe report, its numbers checked finite."""
    import math

    from ckpt_tools.ops.probe.probe import ENGINE

    assert report["engine"]["mtp"] == ENGINE, report
    [mine] = report["drafts"]
    assert mine["name"] == "verifier" and mine["positions"] >= 1, mine
    assert all(0.0 <= a <= 1.0 for a in mine["agreement"]) and len(mine["agreement"]) == 1, mine
    assert all(math.isfinite(k) and k > -1e-6 for k in mine["kl"]), mine
    assert "max_abs_diff" in report["reference"] or report["reference"]["skipped"], report["reference"]
    return mine


@pytest.mark.parametrize("entry", PROBED, ids=ids(PROBED))
def test_probe_measures_only_a_model_loaded_as_stored(entry, grafted, token_prompts):
    """probe measures every corpus checkpoint with MTP layers (exit 0, finite agreement and KL, from the table
    engine) but those it refuses by name (exit 3, the rule); a quantized one only as loaded as stored or
    dequantized by our decoders, said so; anything else, including a ModelOpt export transformers would load
    unscaled, is a refusal with a ``probe-*`` rule. Never another exit code."""
    assert max(PROBE_IDS) < (config(path_of(entry)).get("text_config") or config(path_of(entry)))["vocab_size"]
    if entry["id"] in PROBE_REFUSED:
        result = probe(path_of(entry), token_prompts)
        assert result.exit_code == 3 and f"[{PROBE_REFUSED[entry['id']]}]" in result.output + result.stderr, \
            f"exit {result.exit_code}: {result.output}"
        return
    if not entry["scheme"]:
        result = probe(path_of(entry), token_prompts)
        assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}"
        report = as_json(result)
        assert report["loaded"] == "as stored by transformers", report
        assert report["mtp_loaded"] == "as stored, by the ckpt-tools table engine", report
        measured(report)
        return
    if entry["mtp"] == "dropped-by-producer":  # the config keeps the MTP count: refused before any weight loads
        result = probe(path_of(entry), token_prompts)
        assert result.exit_code == 3 and "[mtp-missing]" in result.output + result.stderr, result.output
    targets = [grafted(entry)] if entry["mtp"] == "dropped-by-producer" else [path_of(entry)]
    for path in targets:
        result = probe(path, token_prompts)
        if entry["mtp"] == "dropped-by-producer":  # every quantizer output measures once grafted (issue 25 item 3):
            # as stored where transformers' quantizer loads and runs it, else dequantized by our decoders
            assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}"
        if result.exit_code == 0:
            report = as_json(result)
            assert report["loaded"].startswith(("as stored", "dequantized by ckpt-tools")), report["loaded"]
            assert report["loaded"] != "as stored by transformers", report["loaded"]
            measured(report)
        else:
            assert result.exit_code == 3, f"exit {result.exit_code}: {result.output}"
            assert re.search(r"\[probe-[a-z-]+\]", result.output + result.stderr), result.output
