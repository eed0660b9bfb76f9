"""`ckpt probe` on a tiny TRAINED DeepSeek-V3-layout verifier (tests/probe_model.py).

The model learns a Markov-chain language, so its MTP layer's agreement with the verifier means
something: high for the trained layer, lower for a draft whose eh_proj halves are exchanged, and
identical for a draft that went through extract -> stitch unchanged.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from conftest import run_ckpt as ckpt

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

from ckpt_tools.errors import InputError  # noqa: E402
from ckpt_tools.ops.probe import probe as probe_ops  # noqa: E402


@pytest.fixture(scope="session")
def trained() -> Path:
    t0 = time.perf_counter()
    d, seconds = probe_model.build(CACHE)
    print(f"trained tiny verifier: {d} (training {seconds:.1f} s, fixture {time.perf_counter() - t0:.1f} s)")
    return d


@pytest.fixture(scope="session")
def prompts(tmp_path_factory) -> Path:
    return probe_model.write_prompts(tmp_path_factory.mktemp("prompts"), 4, 6, seed=7)


def probe_json(verifier, prompts, *drafts, depth: int = 1, code: int = 0) -> dict:
    args = ["probe", verifier, "--prompts", prompts, "--max-new-tokens", 16, "--depth", depth, "--json"]
    for d in drafts:
        args += ["--draft", d]
    r = ckpt(*args, code=code)
    return json.loads(r.stdout)


@pytest.fixture(scope="session")
def extracted(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("extracted") / "draft"
    ckpt("extract", trained, "-o", out)
    return out


def _numbers(entry: dict) -> tuple:
    return entry["agreement"], entry["kl"], entry["positions"], entry["greedy_equal"]


def test_trained_verifier_agrees_and_the_greedy_loop_holds(trained, prompts):
    out = probe_json(trained, prompts, depth=2)
    [v] = out["drafts"]
    assert v["name"] == "verifier"
    # the names and types scripts rely on (issue 18)
    assert isinstance(v["agreement"], list) and isinstance(v["kl"], list) and all(
        isinstance(x, float) for x in v["agreement"] + v["kl"])
    assert type(v["positions"]) is int and type(v["greedy_equal"]) is bool
    assert out["chain"] == "sglang" and out["needed_bytes"] > 0
    assert v["agreement"][0] >= 0.8, v
    assert len(v["agreement"]) == len(v["kl"]) == 2
    assert v["positions"] == 4 * 16  # every generated token of every prompt, prompts longer than depth + 1
    assert v["greedy_equal"] is True
    assert 0 <= v["kl"][0] < 0.5
    a1, a2 = v["agreement"]
    assert v["expected_accepted"] == pytest.approx(a1 + a1 * a2)


def test_extract_then_stitch_round_trip_gives_identical_numbers(trained, prompts, extracted, tmp_path):
    stitched = tmp_path / "stitched"
    ckpt("stitch", extracted, trained, "-o", stitched)
    base = probe_json(trained, prompts, extracted)
    again = probe_json(stitched, prompts)
    assert [d["name"] for d in base["drafts"]] == ["verifier", str(extracted)]
    assert _numbers(base["drafts"][1]) == _numbers(base["drafts"][0])  # the extracted draft, mapped in memory
    assert _numbers(again["drafts"][0]) == _numbers(base["drafts"][0])  # the stitched checkpoint's own MTP


def _swap_norms(tensors: dict) -> None:
    [e] = [k for k in tensors if k.endswith("enorm.weight")]
    [h] = [k for k in tensors if k.endswith("hnorm.weight")]
    tensors[e], tensors[h] = tensors[h], tensors[e]


def test_damaged_drafts_measure_worse_and_the_verifier_runs_once_per_prompt(
        trained, prompts, extracted, tmp_path, monkeypatch):
    swapped = probe_model.edited(extracted, tmp_path / "swapped", probe_model.swap_eh_proj_halves)
    norms = probe_model.edited(extracted, tmp_path / "norms", _swap_norms)
    calls = []
    real = probe_ops.teacher_forward
    monkeypatch.setattr(probe_ops, "teacher_forward", lambda main, seq: calls.append(seq.shape) or real(main, seq))
    out = probe_json(trained, prompts, swapped, extracted, norms)
    assert len(calls) == 4  # one forward per prompt, shared by the verifier's MTP and all three drafts
    names = [d["name"] for d in out["drafts"]]
    assert names == ["verifier", str(swapped), str(extracted), str(norms)]
    v, s, e, n = out["drafts"]
    assert v["agreement"][0] - s["agreement"][0] >= 0.3, (v, s)
    assert s["kl"][0] > v["kl"][0]
    assert n["kl"][0] > v["kl"][0], (v, n)  # enorm / hnorm exchanged: KL sees it
    assert s["greedy_equal"] is True and n["greedy_equal"] is True  # verification keeps greedy output
    assert _numbers(e) == _numbers(v)


def test_a_family_without_mtp_is_refused(tmp_path, prompts):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    r = ckpt("probe", tmp_path / "llama", "--prompts", prompts, code=3)
    assert "probe-family" in r.output and "llama" in r.output


def test_the_memory_needed_is_said_up_front_and_a_verifier_that_does_not_fit_is_refused(
        trained, prompts, extracted, monkeypatch):
    from ckpt_tools.cli.common import human_bytes
    from ckpt_tools.io.checkpoint import Checkpoint

    with Checkpoint.open(trained) as c:
        weights = sum(r.nbytes for r in c.tensors.values())  # the test model is stored in fp32
        mtp = sum(r.nbytes for k, r in c.tensors.items() if k.startswith(probe_model.MTP_PREFIX))
        assert probe_ops.needed_bytes(c, "fp32") == weights == 2 * probe_ops.needed_bytes(c, "bf16")
        assert probe_ops.needed_bytes(c, "fp32", drafts=2) == weights + 2 * mtp  # each draft: a copy of its MTP
    # up front: on stderr before the weights load
    def stop(*a):
        raise InputError("stopped before loading", rule="test-stop")

    monkeypatch.setattr(probe_ops, "load_verifier", stop)
    r = ckpt("probe", trained, "--prompts", prompts, "--draft", extracted, code=3)
    assert "test-stop" in r.output
    assert f"loading the verifier: its weights need {human_bytes(weights + mtp)} in fp32" in r.stderr
    # refused, exit 3, with both numbers, before loading
    monkeypatch.setattr(probe_ops, "available_memory", lambda: 1000)
    r = ckpt("probe", trained, "--prompts", prompts, "--draft", extracted, "--json", code=3)
    assert "[memory]" in r.output and f"({weights + mtp} bytes" in r.output and "(1000 bytes) is available" in r.output
    assert r.stdout == ""


def test_prompt_files_are_read_or_refused(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("hello\n\nworld\n")
    assert probe_ops.read_prompts(str(text)) == ["hello", "world"]
    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "a"}\n{"input_ids": [3, 4]}\n')
    assert probe_ops.read_prompts(str(j)) == ["a", [3, 4]]
    j.write_text('{"input_ids": [3, "4"]}\n')
    with pytest.raises(InputError, match=r"line 1 \(prompt 1\): input_ids\[1\] is '4', not an integer token id"):
        probe_ops.read_prompts(str(j))


def test_a_greedy_mismatch_exits_1_naming_the_prompt_and_position(monkeypatch, tmp_path):
    bad = probe_ops.DraftResult("./draft", [0.5], [0.1], 16, False, {"prompt": 2, "position": 5})
    good = probe_ops.DraftResult("verifier", [0.9], [0.01], 16, True)
    monkeypatch.setattr(probe_ops, "probe",
                        lambda req, progress=None, announce=None: probe_ops.ProbeResult([good, bad], 3, 10))
    r = ckpt("probe", tmp_path, "--json", code=1)
    assert json.loads(r.stdout)["drafts"][1]["mismatch"] == {"prompt": 2, "position": 5}
    assert "./draft: generate(use_mtp=True) differs from greedy at prompt 2, generated position 5" in r.output
    assert probe_ops.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert probe_ops.first_difference([1, 2], [1, 2, 3]) == 2


def test_bf16_probe_runs_and_agrees(trained, prompts):
    out = json.loads(ckpt("probe", trained, "--prompts", prompts, "--max-new-tokens", 8, "--dtype", "bf16",
                          "--json").stdout)
    assert out["drafts"][0]["agreement"][0] >= 0.8 and out["drafts"][0]["greedy_equal"] is True


def _fake_results(monkeypatch, *drafts, seen: list | None = None):
    """``probe`` replaced by one returning ``drafts`` (and recording the progress callable it got)."""
    def fake(req, progress=None, announce=None):
        if seen is not None:
            seen.append((req, progress))
        return probe_ops.ProbeResult(list(drafts), 3, 10)

    monkeypatch.setattr(probe_ops, "probe", fake)


def test_min_acceptance_checks_the_drafts_or_else_the_verifier(monkeypatch, tmp_path):
    v = probe_ops.DraftResult("verifier", [0.5], [0.01], 16, True)
    good = probe_ops.DraftResult("./good", [0.9], [0.01], 16, True)
    low = probe_ops.DraftResult("./low", [0.6], [0.2], 16, True)
    _fake_results(monkeypatch, v, good, low)
    r = ckpt("probe", tmp_path, "--json", "--min-acceptance", 0.8, code=1)
    assert "./low: depth-1 agreement 0.6000 is below --min-acceptance 0.8" in r.output
    assert "verifier:" not in r.output and "./good:" not in r.output  # with drafts, the baseline is not checked
    ckpt("probe", tmp_path, "--json", "--min-acceptance", 0.6)
    _fake_results(monkeypatch, v)  # no draft: the verifier's own MTP is checked
    r = ckpt("probe", tmp_path, "--json", "--min-acceptance", 0.7, code=1)
    assert "verifier: depth-1 agreement 0.5000 is below --min-acceptance 0.7" in r.output
    ckpt("probe", tmp_path, "--json", "--min-acceptance", 0.5)
    for bad in ("1.5", "-0.1", "nan"):
        assert "--min-acceptance" in ckpt("probe", tmp_path, "--min-acceptance", bad, code=2).output


def test_min_acceptance_on_the_trained_model(trained, prompts, extracted, tmp_path):
    swapped = probe_model.edited(extracted, tmp_path / "swapped", probe_model.swap_eh_proj_halves)
    base = ["probe", trained, "--prompts", prompts, "--max-new-tokens", 8, "--json"]
    ckpt(*base, "--min-acceptance", 0.8)
    r = ckpt(*base, "--draft", swapped, "--min-acceptance", 0.8, code=1)
    assert f"{swapped}: depth-1 agreement" in r.output


def test_report_file_holds_the_json_and_per_prompt_results(trained, prompts, extracted, tmp_path):
    report = tmp_path / "probe.json"
    r = ckpt("probe", trained, "--prompts", prompts, "--max-new-tokens", 16, "--depth", 2, "--draft", extracted,
             "--json", "--report", report)
    out = json.loads(r.stdout)
    assert json.loads(report.read_text()) == out
    v, e = out["drafts"]
    for d in (v, e):
        assert {"name", "agreement", "kl", "positions", "greedy_equal"} <= set(d)
        assert len(d["prompts"]) == 4
        for p in d["prompts"]:
            assert len(p["agreement"]) == len(p["kl"]) == 2 and len(p["tokens_sha256"]) == 64
        # the per-prompt numbers add up to the totals
        agree = sum(p["agreement"][0] * p["positions"] for p in d["prompts"]) / d["positions"]
        assert agree == pytest.approx(d["agreement"][0])
        kl = sum(p["kl"][0] * p["positions"] for p in d["prompts"]) / d["positions"]
        assert kl == pytest.approx(d["kl"][0])
    assert [p["tokens_sha256"] for p in v["prompts"]] == [p["tokens_sha256"] for p in e["prompts"]]
    assert len({p["tokens_sha256"] for p in v["prompts"]}) == 4  # different prompts, different tokens
    assert e["prompts"] == v["prompts"]  # the extracted draft is the verifier's own MTP
    assert probe_ops.tokens_sha256([5, 17]) == __import__("hashlib").sha256(b"5,17").hexdigest()
    # without --json the report is still written, and the table printed
    report.unlink()
    r = ckpt("probe", trained, "--prompts", prompts, "--max-new-tokens", 4, "--report", report)
    assert "agree@1" in r.stdout and json.loads(report.read_text())["drafts"][0]["name"] == "verifier"


def test_a_report_inside_an_input_is_refused_before_loading(trained, extracted, monkeypatch, tmp_path):
    monkeypatch.setattr(probe_ops, "probe", lambda *a, **k: pytest.fail("probe ran"))
    for inside in (trained / "probe.json", extracted / "probe.json"):
        r = ckpt("probe", trained, "--draft", extracted, "--report", inside, code=2)
        assert "--report" in r.output and "inside the input" in r.output
        assert not inside.exists()


def test_device_auto_cpu_and_cuda_without_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe_ops.resolve_device("auto") == "cpu"
    assert probe_ops.resolve_device("cpu") == "cpu"
    seen: list = []
    _fake_results(monkeypatch, probe_ops.DraftResult("verifier", [0.9], [0.01], 16, True), seen=seen)
    r = ckpt("probe", tmp_path, "--device", "cuda", code=2)
    assert "--device cuda" in r.output and "no CUDA GPU" in r.output and not seen
    assert "--device" in ckpt("probe", tmp_path, "--device", "tpu", code=2).output
    ckpt("probe", tmp_path, "--device", "auto", "--json")
    assert seen[-1][0].device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert probe_ops.resolve_device("auto") == "cuda"
    assert probe_ops.resolve_device("cuda") == "cuda"


def test_progress_is_a_bar_over_prompts_and_silent_with_json(trained, prompts, monkeypatch):
    from ckpt_tools.cli import probe_cmd

    calls = []
    real = probe_cmd.PromptBar.__call__
    monkeypatch.setattr(probe_cmd.PromptBar, "__call__", lambda self, d, t: calls.append((self.enabled, d, t))
                        or real(self, d, t))
    r = ckpt("probe", trained, "--prompts", prompts, "--max-new-tokens", 4, "--json")
    assert r.stderr == "" and json.loads(r.stdout)["drafts"][0]["name"] == "verifier"
    assert calls == [(False, i, 4) for i in range(5)]
    r = ckpt("probe", trained, "--prompts", prompts, "--max-new-tokens", 4)
    assert "prompt 1/4" not in r.output
    # enabled (a terminal on stderr), the bar starts at (0, n), follows the prompts and is gone after
    bar = probe_cmd.PromptBar(enabled=True)
    with bar:
        for i in range(3):
            bar(i, 2)
        assert bar._p.tasks[0].completed == 2 and bar._p.tasks[0].total == 2
    assert bar._p is None


def test_tables_list_the_families_probe_supports():
    rows = {r["family"]: r for r in json.loads(ckpt("tables", "--json", "--probe").stdout)}
    supported = {f for f, r in rows.items() if r["probe"]}
    assert len(supported) >= 15, sorted(supported)  # issue 25: the table engine, not only transformers' MtpModel
    assert {"deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe", "hy_v3"} <= supported
    assert rows["deepseek_v3"]["probe_reference"] is True and rows["qwen3_next"]["probe_reference"] is False
    assert rows["llama"]["probe"] is False  # a template: no MTP
    assert "trunk decoder layer" in rows["longcat_flash"]["probe_reason"]  # why not, said
    assert "probe" in ckpt("tables", "--probe").stdout
    assert "probe" not in json.loads(ckpt("tables", "--json").stdout)[0]  # by default: no transformers import


def test_asking_transformers_about_a_family_leaves_the_cached_table_alone():
    """transformers normalises nested config values in place (inkling's rope settings): the check works on
    a copy, or later users of the cached table would see a changed fixture."""
    import copy

    from ckpt_tools.model.tables.loader import all_tables
    from ckpt_tools.ops.inspect.tables import tables_info
    from ckpt_tools.ops.probe.families import probe_row

    before = {k: copy.deepcopy(t.fixture) for k, t in all_tables().items()}
    tables_info(probe_support=probe_row)
    assert {k: t.fixture for k, t in all_tables().items()} == before


def _without(monkeypatch, module: str) -> None:
    """``module`` looks uninstalled: find_spec finds nothing and importing it fails."""
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == module else real(name, *a, **k))
    monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize("accelerate", [True, False])
def test_the_verifier_loads_with_a_device_map_when_accelerate_is_there_and_without_on_cpu(
        trained, prompts, monkeypatch, accelerate):
    """transformers 5.24 needs accelerate for any device_map; on cpu the load without one is the same load."""
    if accelerate:
        pytest.importorskip("accelerate")
    else:
        _without(monkeypatch, "accelerate")
    seen = []
    cls = getattr(transformers, json.loads((Path(trained) / "config.json").read_text())["architectures"][0])
    real = cls.from_pretrained  # probe loads the class the config names
    monkeypatch.setattr(cls, "from_pretrained", lambda *a, **k: seen.append(k) or real(*a, **k))
    out = json.loads(ckpt("probe", trained, "--prompts", prompts, "--max-new-tokens", 4, "--json").stdout)
    assert [k["device_map"] for k in seen] == [{"": "cpu"} if accelerate else None]
    assert out["drafts"][0]["agreement"][0] >= 0.8 and out["drafts"][0]["greedy_equal"] is True


def test_missing_extras_are_named(trained, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _without(monkeypatch, "accelerate")
    monkeypatch.setattr(probe_ops, "read_prompts", lambda p: pytest.fail("read before the extra was checked"))
    r = ckpt("probe", trained, "--device", "cuda", code=2)
    assert "[missing-extra]" in r.output and "accelerate" in r.output and "ckpt-tools[probe]" in r.output
    assert probe_ops.device_map("cpu") is None
    _without(monkeypatch, "transformers")
    for args in (["probe", trained], ["probe", trained, "--json"], ["tables", "--probe"]):
        r = ckpt(*args, code=2)
        assert "[missing-extra]" in r.output and "transformers" in r.output and "ckpt-tools[probe]" in r.output


# -- prompts the model cannot take are refused, naming the file and the line (issue 32, item 6) -------------------


@pytest.mark.parametrize(("ids", "max_new", "says"), [
    # past int64: refused as it is read, not an overflow inside torch
    ([5, 2**64], 4, f"line 2 (prompt 2): input_ids[1] = {2**64} is no token id (not an int64)"),
    ([5, 128], 4, "line 2 (prompt 2): input_ids[1] = 128 is outside the vocabulary: token ids are 0 <= id < 128 "
                  "(the verifier's vocab_size)"),
    ([5, -1], 4, "line 2 (prompt 2): input_ids[1] = -1 is negative: token ids are 0 <= id < 128"),
    ([5] * 120, 16, "line 2 (prompt 2): 120 prompt tokens + --max-new-tokens 16 exceed the model's 128 positions"),
])
def test_prompts_the_model_cannot_take_are_refused_with_file_and_line(tmp_path, ids, max_new, says):
    from ckpt_tools.errors import InputError
    from ckpt_tools.ops.probe.probe import check_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"input_ids": [3, 4]}) + "\n" + json.dumps({"input_ids": ids}) + "\n")
    with pytest.raises(InputError) as e:
        check_prompts(str(path), 128, 128, max_new)
    assert e.value.rule == "prompts" and says in str(e.value) and str(path) in str(e.value)


def test_a_draft_that_computes_no_number_is_refused_not_reported(trained, prompts, extracted, tmp_path):
    """Finite weights whose products overflow float32 give Inf / NaN logits: probe refuses (exit 3, naming the draft)
    instead of reporting null (issue 32)."""
    def overflow(tensors: dict) -> None:
        [key] = [k for k in tensors if k.endswith("eh_proj.weight")]
        tensors[key] = torch.full_like(tensors[key], 3e38)

    huge = probe_model.edited(extracted, tmp_path / "huge", overflow)
    r = ckpt("probe", trained, "--prompts", prompts, "--max-new-tokens", 4, "--draft", huge, "--json", code=3)
    assert "[probe-nonfinite]" in r.output and str(huge) in r.output and r.stdout == ""


def test_vllm_mismatch_position_counts_generated_tokens_whatever_the_prompt():
    """vLLM's engine compares generations (a text prompt's length is known only from vLLM's tokenization); counters are
    differences over the run; per position acceptance is over drafts."""
    from ckpt_tools.ops.probe.vllm import Sequence, _result

    ref = [Sequence([7, 8, 9], [1, 2, 3, 4]), Sequence([5], [6, 6])]
    out = [Sequence([7, 8, 9], [1, 2, 3, 4]), Sequence([5], [6, 7])]
    r = _result("d", 2, ref, out, {"num_drafts": [4.0], "num_accepted_tokens": [6.0],
                                   "num_accepted_tokens_per_pos": [4.0, 2.0]})
    assert r.mismatch == {"prompt": 1, "position": 1} and r.greedy_equal is False
    assert r.agreement == [1.0, 0.5] and r.mean_acceptance_length == 2.5 and r.num_drafts == 4
    assert [p["greedy_equal"] for p in r.prompts] == [True, False]
    assert r.prompts[0]["tokens_sha256"] == probe_ops.tokens_sha256([7, 8, 9, 1, 2, 3, 4])
    with pytest.raises(InputError, match="drafted nothing"):
        _result("d", 1, ref, ref, {"num_drafts": [0.0]})
