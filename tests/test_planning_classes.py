"""Planning at release scale judges classes, not tensors (issue 34): each shortcut gives what the per-item rule gives.

- ``Declarer`` answers ``declaration`` once per combination of pattern matches: the same answer for every module,
  under real producers' configurations and under edited ones (regex, glob and exact exclusions, targets);
- ``judge`` judges modules stored and declared alike once: the same findings as judging each module;
- ``quant-scale-value`` finds the failing tensors of a batch with one ``reduceat``: the same tensors as reading
  each one, each named once (however many batches it spans), the first ``MAX_DETAILED`` in detail;
- tables read back from the cache are plain records with every field and property the checked models have;
- the command line converts plain values without pydantic, and leaves every other value (and its message) to
  typer.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import typer._coercion
import typer.core
from typer.testing import CliRunner

from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.mtp import open_mtp
from ckpt_tools.model.quant import scale_values
from ckpt_tools.model.quant.audit import ModuleAudit, _judge, judge, trunk_rows
from ckpt_tools.model.quant.config import dig, section
from ckpt_tools.model.quant.declared import Declarer, declaration
from ckpt_tools.model.quant.detect import detect_scheme

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "producers"
QUANTIZED = ("llmcompressor-fp8-block", "llmcompressor-fp8-dynamic", "llmcompressor-nvfp4a16", "llmcompressor-w4a16",
             "modelopt-fp8", "modelopt-nvfp4")
# exclusion entries each matcher reads differently: some name one module, some a layer, some tell layers apart by
# their digits only
EDITS = ["re:.*layers\\.1\\..*", "model.layers.0.mlp.down_proj", "re:.*\\.\\d\\.self_attn\\.o_proj$",
         "*layers.0.mlp.experts.1.*", "*.?.self_attn.q_*", "mlp.gate", "lm_head"]


def _modules(ckpt) -> list[str]:
    """Every module of the checkpoint, and names told apart from them by digits only."""
    mods = sorted({k.rpartition(".")[0] for k in ckpt.tensors})
    return mods + [m.replace("layers.0.", "layers.10.").replace("layers.1.", "layers.11.") for m in mods]


def _edited(scheme) -> dict:
    """The scheme's configuration files with ``EDITS`` in every exclusion list of every place it is declared."""
    files = copy.deepcopy(dict(scheme.files))
    for decl in scheme.declarations:
        sec = section(files, decl.file, decl.path)
        for e in decl.where.exclude:
            parent_path, _, leaf = e.field.rpartition(".")
            parent = dig(sec, parent_path) if parent_path else sec
            if isinstance(parent, dict):
                parent[leaf] = [*(parent.get(leaf) or []), *EDITS]
    return files


@pytest.mark.parametrize("producer", QUANTIZED)
def test_the_declarer_answers_as_declaration_for_every_module(producer):
    with Checkpoint.open(CORPUS / producer) as ckpt:
        scheme = detect_scheme(ckpt)
        assert scheme is not None
        modules = _modules(ckpt)
        for files in (None, _edited(scheme)):
            declare = Declarer(scheme, files)
            got = [declare(m) for m in modules]
            assert got == [declaration(scheme, files, m) for m in modules]
            if files is not None:  # the edits decide differently for modules of one pattern
                assert len({d.state for d in got}) > 1


@pytest.mark.parametrize("producer", QUANTIZED)
def test_judging_classes_finds_what_judging_each_module_finds(producer):
    with Checkpoint.open(CORPUS / producer) as ckpt:
        view = open_mtp(ckpt)
        scheme = detect_scheme(ckpt)
        rows = trunk_rows(view, scheme)
        for files in (None, _edited(scheme)):
            each = judge(rows, scheme, view.table, files)
            lean = judge(rows, scheme, view.table, files, every_module=False)
            reference = _judge_each(rows, scheme, view.table, files)
            assert [f.message for f in each.findings] == reference
            assert lean.findings == each.findings
            assert [m.module for m in each.modules] == [r[0] for r in rows]
        assert reference, "the edited configuration excludes quantized modules: findings expected"


def _judge_each(rows, scheme, table, files) -> list[str]:
    """The findings of judging every module on its own (the rule as written, without classes)."""
    from ckpt_tools.model.quant.audit import Audit, _judge_fused, fused_names
    from ckpt_tools.model.quant.codec import checkpoint_codec, restack_codec

    fused = {k: list(v) for k, v in table.fused_modules.items()}
    names = {m for m, *_ in rows}
    hint = checkpoint_codec(hint=table.quantization)
    convention = any(flag for _, _, flag, _ in rows) and (
        any(restack_codec(t) is not None for t in scheme.tables)
        or any(t.suffix == hint.scale_suffix for _, f in scheme.formats() for t in f.tensors))
    result = Audit(scheme)
    for module, stored, flag, expert in rows:
        m = ModuleAudit(module, stored, declaration(scheme, files, module), flag, expert, convention and not flag,
                        () if expert else fused_names(module, fused, names))
        result.modules.append(m)
        _judge(m, scheme, result)
    _judge_fused(result, scheme, files, fused)
    return [f.message for f in result.findings]


@pytest.fixture
def zero_scales(tmp_path) -> Path:
    """The FP8 block producer with every scale of its first shard set to zero (NaN in one of them)."""
    out = tmp_path / "ckpt"
    shutil.copytree(CORPUS / "llmcompressor-fp8-block", out)
    with Checkpoint.open(out) as ckpt:
        scales = [r for r, _ in scale_values.companions(ckpt)]
    for ref in scales:
        with open(ref.file, "r+b") as f:
            f.seek(ref.offset)
            f.write(b"\x00" * ref.nbytes)
    return out


def _bad_keys(ckpt) -> set[str]:
    """Every scale tensor holding a value out of its rule's range, read whole."""
    bad = set()
    for ref, kind in scale_values.companions(ckpt):
        raw = np.frombuffer(ref.read(), dtype=kind.view)
        if raw.size and (raw.min() < kind.low or raw.max() > kind.high):
            bad.add(ref.key)
    return bad


@pytest.mark.parametrize("batch", [scale_values.BATCH_BYTES, 16, 2])  # whole, several tensors, pieces of one
def test_failing_scales_are_the_tensors_read_one_by_one_each_named_once(zero_scales, monkeypatch, batch):
    monkeypatch.setattr(scale_values, "BATCH_BYTES", batch)
    monkeypatch.setattr(scale_values, "MAX_DETAILED", 5)
    with Checkpoint.open(zero_scales) as ckpt:
        bad = _bad_keys(ckpt)
        found = scale_values.scale_value_problems(ckpt)
    assert len(bad) > 5
    detailed, summary = found[:-1], found[-1]
    assert len(detailed) == 5 and len({p.key for p in detailed}) == 5 and {p.key for p in detailed} <= bad
    assert summary.key is None and summary.message.startswith(f"{len(bad) - 5} more scale")
    assert all("scale value 0.0 at index [0" in p.message for p in detailed)


def test_a_checked_table_read_back_has_every_field_and_property_of_its_model():
    from ckpt_tools.model.formats import all_formats
    from ckpt_tools.model.formats import models as format_models
    from ckpt_tools.model.quant import schema as quant_schema
    from ckpt_tools.model.quant.tables import all_schemes
    from ckpt_tools.model.tables import plain
    from ckpt_tools.model.tables import schema as table_schema
    from ckpt_tools.model.tables.loader import all_tables

    records = [*all_tables().values(), *all_schemes().values(), *all_formats().values()]
    assert all(isinstance(r, plain.Plain) for r in records)
    for module in (table_schema, quant_schema, format_models):
        for name, model in vars(module).items():
            if not (isinstance(model, type) and hasattr(model, "model_fields")) or model.__module__ != module.__name__:
                continue
            record = plain.plain_class(f"{model.__module__}.{model.__qualname__}")
            own = {a for c in model.__mro__ if c.__module__.startswith("ckpt_tools") for a, v in vars(c).items()
                   if not a.startswith("_") and (callable(v) or isinstance(v, property))}
            assert own <= set(dir(record)), (name, own - set(dir(record)))
    # read back from the cache's JSON: equal records, and the same answers from their properties
    text = plain.dumps({"t": records})
    assert text is not None and plain.loads(text)["t"] == records
    table = all_tables()["deepseek_v3"]
    assert {n: v.kind for n, v in table.config.items()} == {
        n: table_schema.VarDef.model_validate(json.loads(json.dumps(v.__dict__))).kind for n, v in table.config.items()}


def _run(args, *, typer_own: bool, monkeypatch):
    from ckpt_tools.cli import app

    if typer_own:
        monkeypatch.setattr(typer.core, "build_runtime_param", typer._coercion.build_runtime_param)
    r = CliRunner().invoke(app, [str(a) for a in args])
    monkeypatch.undo()
    return r.exit_code, r.output


@pytest.mark.parametrize("threads", ["0", "x", "1.5", "2"])
def test_values_convert_as_typer_converts_them(make_fixture, tmp_path, monkeypatch, threads):
    src = make_fixture("deepseek_v3", fp8=True)
    args = ["dequant", src, "-o", tmp_path / "out", "--threads", threads, "--dry-run", "--max-shard-size", "2GB"]
    ours = _run(args, typer_own=False, monkeypatch=monkeypatch)
    assert ours == _run(args, typer_own=True, monkeypatch=monkeypatch)
    assert (ours[0] == 0) == (threads == "2")


@pytest.mark.parametrize("dtype", sorted(scale_values._POSITIVE_FINITE))
def test_small_batches_are_judged_without_numpy_as_numpy_judges_them(dtype):
    kind = scale_values._Kind("scale", *scale_values._POSITIVE_FINITE[dtype], dtype)
    rng = np.random.default_rng(0)
    width = np.dtype(kind.view)
    edges = [kind.low, kind.high, max(kind.low - 1, 0), min(kind.high + 1, np.iinfo(width).max)]
    for values in ([kind.low, kind.high], [kind.high + 1], [0], edges,
                   rng.integers(kind.low, kind.high, 1000, endpoint=True, dtype=width),
                   rng.integers(0, np.iinfo(width).max, 1000, dtype=width)):
        buf = bytearray(np.asarray(values, dtype=width).tobytes())
        assert scale_values._fine_small(buf, kind) == (not scale_values._bad(np.frombuffer(buf, width), kind))
    big = bytearray((scale_values.SMALL_VALUES + 1) * width.itemsize)  # numpy's to judge, whatever it holds
    assert not scale_values._fine_small(big, kind)


def test_routed_experts_are_declared_once_per_class_under_a_configuration_naming_no_module(tmp_path, monkeypatch):
    from ckpt_tools.testing.fixtures import FixtureOptions, make_checkpoint

    make_checkpoint("deepseek_v3", tmp_path / "fp8", FixtureOptions(fp8=True))
    asked: list[str] = []
    call = Declarer.__call__
    monkeypatch.setattr(Declarer, "__call__", lambda self, m: asked.append(m) or call(self, m))
    with Checkpoint.open(tmp_path / "fp8") as ckpt:
        view = open_mtp(ckpt)
        scheme = detect_scheme(ckpt)
        rows = trunk_rows(view, scheme)
        assert Declarer(scheme).constant
        asked.clear()
        lean = judge(rows, scheme, view.table, every_module=False)
    experts = [m for m, _, _, expert in rows if expert]
    assert len(experts) > 10 and not lean.findings
    assert len([m for m in asked if m in set(experts)]) == len({(id(s), f) for _, s, f, e in rows if e})


def test_nvfp4_routed_experts_are_looked_at_in_columns_and_a_missing_scale_still_named(tmp_path, monkeypatch):
    """A per-expert group stored in a scheme table's format (NVFP4) is stored alike: one storage per projection,
    its experts' tensors checked in columns, not a ``module_storage`` per expert in the trunk rules; an expert
    missing its scale breaks the group into modules again, and the gate names it as before."""
    from ckpt_tools.model import gate
    from ckpt_tools.model.quant import storage
    from ckpt_tools.testing.quantized import QuantOptions, make_quantized_checkpoint

    calls: list[str] = []
    real = storage._storage_in
    monkeypatch.setattr(storage, "_storage_in", lambda memo, scheme, ckpt, module, *a: calls.append(module)
                        or real(memo, scheme, ckpt, module, *a))
    whole = make_quantized_checkpoint("deepseek_v3", tmp_path / "whole", QuantOptions("ct-nvfp4"))
    with Checkpoint.open(whole) as ckpt:
        experts = [k for k in ckpt.tensors if ".mlp.experts." in k and k.endswith(".weight_packed")
                   and not k.startswith("model.layers.3.")]  # the trunk's (layer 3 is the MTP layer here)
        problems, _ = gate.check(ckpt)
    assert len(experts) > 20 and not problems
    # two trunk rules ask: per expert that was 2 * len(experts); per group and projection shape, a third of that
    assert len([m for m in calls if f"{m}.weight_packed" in experts]) < len(experts) // 2
    lost = experts[5].replace(".weight_packed", ".weight_scale")
    broken = make_quantized_checkpoint("deepseek_v3", tmp_path / "broken", QuantOptions("ct-nvfp4", drop_keys=(lost,)))
    with Checkpoint.open(broken) as ckpt:
        problems, _ = gate.check(ckpt)
    assert any(p.key == lost and p.rule == "trunk-missing" for p in problems), [(p.rule, p.key) for p in problems]
