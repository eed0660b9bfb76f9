"""The integer fields of a config are read strictly, everywhere (issue 40, class 1).

``num_nextn_predict_layers: 1.0`` was valid for validate, copied by extract, and made probe exit 5
(transformers' strict config dataclasses refuse a float where an int belongs). Every count or integer a table
reads from config.json is a JSON integer: a float (even an integral one), a boolean or a string is refused by
validate and by every verb's gate under rule ``config-field``, naming config.json, the field (with its
``text_config.`` path), the value and what the table expected. Built on real transformers outputs
(fixtures/producers/).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_ckpt as ckpt
from conftest import tree_hash

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"


def copy_with(tmp_path: Path, producer: str, field: str, value, nested: bool = False) -> Path:
    dst = tmp_path / "in"
    shutil.copytree(CORPUS / producer, dst)
    p = dst / "config.json"
    config = json.loads(p.read_text())
    (config["text_config"] if nested else config)[field] = value
    p.write_text(json.dumps(config, indent=2))
    return dst


def refused(result, *names: str) -> str:
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == 3, f"exit {result.exit_code}: {text}"
    assert "[config-field]" in text, text
    for n in names:
        assert n in text, (n, text)
    return text


@pytest.mark.parametrize(("field", "value"), [
    ("num_nextn_predict_layers", 1.0),  # the case: an integral float
    ("hidden_size", 128.0),
    ("n_routed_experts", 4.0),
    ("num_attention_heads", 2.0),
    ("vocab_size", 256.0),
    ("num_nextn_predict_layers", True),
    ("num_nextn_predict_layers", "1"),
    ("num_nextn_predict_layers", 1.5),
])
def test_an_integer_field_that_is_no_json_integer_is_refused_by_validate_and_every_verb(tmp_path, field, value):
    src = copy_with(tmp_path, "transformers-deepseek_v3", field, value)
    before = tree_hash(src)
    shown = json.dumps(value)  # as config.json spells it
    names = ("config.json", f"'{field}' = {shown}")
    report = json.loads(ckpt("validate", src, "--json", code=1).stdout)
    found = [p for p in report["problems"] if p["rule"] == "config-field"]
    assert len(found) == 1 and found[0]["path"].endswith("config.json"), report["problems"]
    assert f"'{field}' = {shown}" in found[0]["message"] and "integer" in found[0]["message"], found
    if isinstance(value, float) and value.is_integer():
        assert f"not the float {value!r}" in found[0]["message"], found
    out = tmp_path / "o"
    refused(ckpt("inspect", src, code=None), *names)
    refused(ckpt("extract", src, "-o", out, code=None), *names)
    refused(ckpt("init-draft", src, "-o", out, code=None), *names)
    # was exit 5 (transformers' strict config dataclasses raise), now a refusal naming the field (transformers' own
    # check, or ours when transformers does not type the field)
    refused(ckpt("probe", src, code=None), "config.json", f"'{field}'")
    assert not out.exists()
    assert tree_hash(src) == before


def test_a_nested_field_is_named_with_its_text_config_path(tmp_path):
    src = copy_with(tmp_path, "transformers-qwen3_5_moe", "mtp_num_hidden_layers", 1.0, nested=True)
    report = json.loads(ckpt("validate", src, "--json", code=1).stdout)
    found = [p for p in report["problems"] if p["rule"] == "config-field"]
    assert found and "'text_config.mtp_num_hidden_layers' = 1.0" in found[0]["message"], report["problems"]
    refused(ckpt("extract", src, "-o", tmp_path / "o", code=None), "text_config.mtp_num_hidden_layers")


def test_an_integral_float_in_a_field_no_table_reads_is_a_refusal_for_probe_not_a_crash(tmp_path):
    """transformers' strict config refuses 512.0 for max_position_embeddings (the deepseek_v3 table does not read
    it): probe names the field under config-field instead of exiting 5."""
    src = copy_with(tmp_path, "transformers-deepseek_v3", "max_position_embeddings", 512.0)
    refused(ckpt("probe", src, code=None), "max_position_embeddings", "config.json")


def test_no_table_fixture_and_no_producer_output_uses_an_integral_float_for_a_count():
    """The strict reading refuses nothing shipped: every count / int field the tables read, in every producer's
    config and every table's fixture, is a JSON integer."""
    from ckpt_tools.io.config import ConfigView
    from ckpt_tools.model.tables.loader import all_tables

    tables = all_tables()
    configs = [(p.parent.name, json.loads(p.read_text())) for p in sorted(CORPUS.glob("*/config.json"))]
    configs += [(f"table {name}", t.fixture) for name, t in tables.items() if t.fixture]
    checked = 0
    for where, raw in configs:
        view = ConfigView(raw)
        for table in tables.values():
            for var in table.config.values():
                if var.kind not in ("count", "int"):
                    continue
                for key in var.keys:
                    v = view.get(key)
                    if v is not None:
                        checked += 1
                        assert type(v) is int, (where, table.family, key, v)
    assert checked > 500
