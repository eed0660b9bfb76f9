"""Property tests: mutated ``config.json`` and ``model.safetensors.index.json`` never crash a verb.

On a tiny DeepSeek-V3 fixture, hypothesis rewrites the config (a field replaced by a value of
any JSON type, deleted, or the whole document replaced) or the index (entries dropped, moved
to another shard, to a name that is not a shard, invented keys, a weight_map or metadata of
the wrong type). Each mutated checkpoint goes through open, the consistency gate, validate, a
planned extract and a planned stitch, in-process. Properties: the only exception is a CkptError
with a rule (never exit 5, never a traceback), and a verb that plans the checkpoint was handed a
consistent one: validate then reports report-only rules at most.
"""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_tools.errors import CkptError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.consistency import MTP_RULES, REPORT_ONLY
from ckpt_tools.ops.check.validate import validate
from ckpt_tools.ops.draft.extract import ExtractRequest, plan_extract
from ckpt_tools.ops.stitch.plan import StitchRequest, plan_stitch

from conftest import run_ckpt

INDEX = "model.safetensors.index.json"
FAST = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

scalar = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                   st.sampled_from(["64", "1e9", "DeepseekV3ForCausalLM", "deepseek_v3", "fp8"]))
weird = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                     max_leaves=6)


@pytest.fixture(scope="module")
def pristine(make_fixture, tmp_path_factory):
    base = make_fixture("deepseek_v3")
    draft = tmp_path_factory.mktemp("fuzz") / "draft"
    run_ckpt("extract", base, "-o", draft)
    return base, draft, json.loads((base / "config.json").read_text()), json.loads((base / INDEX).read_text())


@pytest.fixture(scope="module")
def work(pristine, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz") / "v"
    shutil.copytree(pristine[0], d)
    return d


def exercise(d, draft) -> None:
    """Every entry point; only CkptError may escape, and a planned checkpoint must be consistent."""
    try:
        report = validate(d)
    except CkptError as e:
        assert e.rule, f"CkptError without a rule: {e}"
    else:
        assert report.problems or report.family == "deepseek_v3"
    # each verb, with the rules it repairs by construction (--drop-mtp drops every MTP tensor)
    verbs = ((lambda c: plan_extract(c, ExtractRequest()), frozenset()),
             (lambda c: plan_extract(c, ExtractRequest(drop_mtp=True)), frozenset(MTP_RULES)),
             (lambda c: plan_stitch(Checkpoint.open(draft), c, StitchRequest()), frozenset()))
    for plan, repaired in verbs:
        try:
            plan(Checkpoint.open(d))
        except CkptError:
            continue  # a refusal; anything else (a bug, exit 5) propagates and fails the test
        blocking = {p.rule for p in validate(d).problems} - REPORT_ONLY - repaired
        assert not blocking, f"a verb planned an inconsistent checkpoint: {blocking}"


# -- config.json ---------------------------------------------------------------------------------

FIELDS = ["architectures", "model_type", "text_config", "quantization_config", "hidden_size", "vocab_size",
          "num_hidden_layers", "num_nextn_predict_layers", "n_routed_experts", "moe_intermediate_size",
          "first_k_dense_replace", "tie_word_embeddings", "q_lora_rank", "torch_dtype", "n_shared_experts"]


@FAST
@given(st.data())
def test_mutated_config(pristine, work, data):
    config = dict(pristine[2])
    how = data.draw(st.sampled_from(["replace", "delete", "nest", "document"]))
    if how == "document":
        doc = data.draw(weird)
    else:
        field = data.draw(st.sampled_from(FIELDS))
        if how == "replace":
            config[field] = data.draw(weird)
        elif how == "delete":
            config.pop(field, None)
        else:  # the same value one level down, under text_config
            config["text_config"] = {field: data.draw(weird)}
        doc = config
    try:
        text = json.dumps(doc)
    except ValueError:
        return
    (work / "config.json").write_text(text)
    (work / INDEX).write_text(json.dumps(pristine[3]))
    exercise(work, pristine[1])


# -- model.safetensors.index.json ------------------------------------------------------------------


@FAST
@given(st.data())
def test_mutated_index(pristine, work, data):
    index = json.loads(json.dumps(pristine[3]))
    wmap: dict = index["weight_map"]
    keys = sorted(wmap)
    shards = sorted(set(wmap.values()))
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        how = data.draw(st.sampled_from(["drop", "drop-shard", "move", "rename", "invent", "empty", "map-type",
                                         "value-type", "metadata"]))
        key = data.draw(st.sampled_from(keys))
        if how == "drop":
            wmap.pop(key, None)
        elif how == "drop-shard":
            gone = data.draw(st.sampled_from(shards))
            for k in [k for k, s in wmap.items() if s == gone]:
                del wmap[k]
        elif how == "move":
            wmap[key] = data.draw(st.sampled_from(shards))
        elif how == "rename":
            wmap[key] = data.draw(st.sampled_from(["nope.safetensors", "../x.safetensors", "", "/etc/passwd",
                                                   "config.json", "a\\b.safetensors"]))
        elif how == "invent":
            wmap[data.draw(st.text(min_size=1, max_size=12))] = data.draw(st.sampled_from(shards))
        elif how == "empty":
            wmap.clear()
        elif how == "map-type":
            index["weight_map"] = data.draw(weird)
            break
        elif how == "value-type":
            wmap[key] = data.draw(weird)
        else:
            index["metadata"] = data.draw(weird)
    (work / "config.json").write_text(json.dumps(pristine[2]))
    try:
        (work / INDEX).write_text(json.dumps(index))
    except ValueError:
        return
    exercise(work, pristine[1])
