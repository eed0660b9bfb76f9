"""Issue 14, the command line: signals, option values, strict JSON, `--link symlink`, and a line for every failure.

- SIGTERM / SIGHUP stop a command like Ctrl-C: one line naming the signal, exit 128 + signal number,
  no completion marker, no temporary file, no lock, and `--resume` finishes to the uninterrupted bytes.
- Option values are refused before anything is opened or written (exit 2, the option named).
- Every `--json` report is strict JSON (no bare NaN / Infinity).
- Every non-zero exit prints at least one line naming its cause.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_crash import INDEX, SINGLE, assert_same_output, shared_zygote
from typer.testing import CliRunner

from ckpt_tools.cli import app
from ckpt_tools.cli.common import command
from ckpt_tools.errors import EXIT_INPUT, EXIT_OUTPUT, EXIT_USAGE, InputError
from ckpt_tools.jsonutil import dumps_indented, dumps_strict

from conftest import run_ckpt, tree_hash

FAMILY = "deepseek_v3"


@pytest.fixture(scope="module")
def verifier(make_fixture) -> Path:
    return make_fixture(FAMILY)


@pytest.fixture(scope="module")
def draft(verifier, tmp_path_factory) -> Path:
    """A native draft of the verifier with one MTP tensor finetuned (stitch rewrites a shard)."""
    d = tmp_path_factory.mktemp("cli") / "draft"
    run_ckpt("extract", verifier, "-o", d)
    tensors = load_file(d / SINGLE)
    key = next(k for k in sorted(tensors) if k.endswith("eh_proj.weight"))
    tensors[key] = (tensors[key].float() * 1.01).to(tensors[key].dtype)
    save_file(tensors, d / SINGLE, metadata={"format": "pt"})
    return d


def invoke(*args):
    """In-process run: exit code, stdout, stderr (never a traceback)."""
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r.exit_code, r.stdout, r.stderr


# --------------------------------------------------------------------------- signals


def _wait_for_partial(out: Path, timeout: float = 60.0) -> None:
    """Until the writer has its resume record in place and a shard open (it is then paused after its first copy)."""
    deadline = time.monotonic() + timeout

    def writing() -> bool:
        names = [p.name for p in out.iterdir()] if out.is_dir() else []
        return ".ckpt-resume.json" in names and any(n.endswith(".safetensors.partial") for n in names)

    while not writing():
        assert time.monotonic() < deadline, f"no writer started on {out}"
        time.sleep(0.005)


@pytest.mark.parametrize(("cmd", "sig"), [("extract", signal.SIGTERM), ("extract", signal.SIGHUP),
                                          ("stitch", signal.SIGTERM)])
def test_signal_stops_cleanly_and_resume_finishes(cmd, sig, verifier, draft, tmp_path):
    argv = ["extract", verifier] if cmd == "extract" else ["stitch", draft, verifier]
    inputs = [verifier] if cmd == "extract" else [draft, verifier]
    hashes = [tree_hash(p) for p in inputs]
    ref, out, log = tmp_path / "ref", tmp_path / "out", tmp_path / "log"
    run_ckpt(*argv, "-o", ref)

    zygote = shared_zygote(torch=cmd == "stitch")
    pid = zygote.start([*argv, "-o", out], log, kill=("pause", 1, 60))  # holds still inside the writer
    _wait_for_partial(out)
    os.kill(pid, sig)
    code = zygote.wait(pid)
    text = log.read_text()
    assert code == 128 + sig, text
    name = signal.Signals(sig).name
    assert f"terminated by {name} while writing {out}; no output was marked complete; rerun with --resume" \
        in " ".join(text.split()), text
    assert "Traceback" not in text
    assert not (out / INDEX).exists() and not (out / SINGLE).exists()
    # only the resume record and journal stay (--resume needs them to prove the same job and the bytes of each
    # finished file); no temporary file, no lock
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".ckpt-resume-journal.jsonl",
                                                                              ".ckpt-resume.json"]
    assert [tree_hash(p) for p in inputs] == hashes

    run_ckpt(*argv, "-o", out, "--resume")
    assert_same_output(out, ref)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_outside_a_write_names_the_signal_and_restores_handlers(sig, capsys):
    before = signal.getsignal(sig)

    @command
    def slow() -> None:
        os.kill(os.getpid(), sig)
        time.sleep(10)  # the handler raises out of this at once

    t0 = time.monotonic()
    with pytest.raises(Exception) as ei:
        slow()
    assert time.monotonic() - t0 < 5
    assert getattr(ei.value, "exit_code", None) == 128 + sig
    how = "interrupted" if sig == signal.SIGINT else "terminated"
    assert f"{how} by {signal.Signals(sig).name} before the command finished" in capsys.readouterr().err
    assert signal.getsignal(sig) == before  # library use and this test runner are left as they were


def test_an_ignored_signal_stays_ignored():
    """`nohup ckpt ...`: SIGHUP is ignored on purpose, and the command must not turn it back on."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        @command
        def hup() -> str:
            os.kill(os.getpid(), signal.SIGHUP)
            return "finished"

        assert hup() == "finished"
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_closed_stdout_is_said_on_stderr(verifier):
    """`ckpt inspect V | head -1`: the reader went away; one line on stderr, exit 141, no internal error."""
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "inspect", str(verifier)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    proc.stdout.close()  # before the child has written anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert err.strip() == "stdout was closed before the output was complete (broken pipe)", err


# --------------------------------------------------------------------------- option values


def _bad_options(v: Path, d: Path, out: Path) -> list[tuple[list, int, list[str]]]:
    """(argv, exit code, fragments of the message): each refused before anything is written."""
    init = ["init-draft", v, "-o", out]
    return [
        ([*init, "--std", "inf"], EXIT_USAGE, ["--std", "finite"]),
        ([*init, "--std", "nan"], EXIT_USAGE, ["--std", "finite"]),
        ([*init, "--std", "0"], EXIT_USAGE, ["--std", "above 0"]),
        ([*init, "--std", "-1"], EXIT_USAGE, ["--std", "above 0"]),
        ([*init, "--std", "1e38"], EXIT_USAGE, ["--std", "do not fit"]),  # Inf once drawn into float32
        ([*init, "--std", "1e-40"], EXIT_USAGE, ["--std", "do not fit"]),  # all zeros in bf16
        ([*init, "--std", "5000", "--dtype", "fp16"], EXIT_USAGE, ["--std", "F16"]),
        ([*init, "--seed", "-5"], EXIT_USAGE, ["--seed", "from 0 to"]),
        ([*init, "--seed", str(2**63)], EXIT_USAGE, ["--seed", "from 0 to"]),
        ([*init, "--num-layers", "0"], EXIT_USAGE, ["--num-layers", "from 1 to 64"]),
        ([*init, "--num-layers", "65"], EXIT_USAGE, ["--num-layers", "from 1 to 64"]),
        ([*init, "--num-layers", "100000"], EXIT_USAGE, ["--num-layers", "from 1 to 64"]),
        ([*init, "--from-layer", "-1"], EXIT_USAGE, ["--from-layer"]),
        ([*init, "--from-layer", "99"], EXIT_USAGE, ["--from-layer 99", "decoder layers"]),
        ([*init, "--arch", "no_such_family"], EXIT_USAGE, ["unknown-family", FAMILY]),
        (["diff", v, v, "--keys", "("], EXIT_USAGE, ["--keys", "not a regular expression"]),
        (["diff", v, v, "--keys", "a{4294967296}"], EXIT_USAGE, ["--keys", "too large"]),
        (["diff", v, v, "--keys", "(" * 5000 + ")" * 5000], EXIT_USAGE, ["--keys", "nested too deeply"]),
        (["extract", v, "-o", out, "--layers", "-1"], EXIT_USAGE, ["--layers", "'-1'"]),
        (["extract", v, "-o", out, "--layers", "x"], EXIT_USAGE, ["--layers", "'x'"]),
        (["extract", v, "-o", out, "--layers", ""], EXIT_USAGE, ["--layers", "empty item"]),
        (["extract", v, "-o", out, "--layers", "0,0"], EXIT_USAGE, ["--layers", "more than once"]),
        (["extract", v, "-o", out, "--layers", "9" * 5000], EXIT_USAGE, ["--layers", "characters"]),
        (["extract", v, "-o", out, "--max-shard-size", "infGB"], EXIT_USAGE, ["--max-shard-size"]),
        (["extract", v, "-o", out, "--arch", "no_such_family"], EXIT_USAGE, ["unknown-family"]),
        (["inspect", v, "--arch", "no_such_family"], EXIT_USAGE, ["unknown-family"]),
        (["stitch", d, v, "-o", out, "--layers", "-1"], EXIT_USAGE, ["--layers"]),
        (["stitch", d, v, "-o", out, "--dtype", "bf16"], EXIT_USAGE, ["--dtype", "verifier or draft"]),
        (["stitch", d, v, "-o", out, "--link", "symlink"], EXIT_USAGE,
         ["--link symlink was removed", "hardlink", "reflink"]),
        (["extract", v, "-o", out, "--plan-json", v / "model.safetensors.index.json"], EXIT_USAGE,
         ["--plan-json", "inside the input"]),  # it used to overwrite the input's index
        (["stitch", d, v, "-o", out, "--plan-json", d / "plan.json"], EXIT_USAGE, ["--plan-json", "inside the input"]),
        (["extract", v, "-o", out, "--plan-json", out.parent / "no-dir" / "p.json"], EXIT_OUTPUT,
         ["--plan-json", "cannot write"]),  # was an internal error (exit 5)
        (["inspect", v, "--discover", "--write", v / "x.yaml"], EXIT_USAGE, ["--write", "inside the input"]),
        (["push", v, "bad id", "--dry-run"], EXIT_USAGE, ["REPO_ID", "bad id"]),
        (["push", v, "org/x", "--base", "a/b..c", "--dry-run"], EXIT_USAGE, ["--base"]),
    ]


def test_bad_option_values_are_refused_at_once(verifier, draft, tmp_path):
    out = tmp_path / "out"
    before = [tree_hash(verifier), tree_hash(draft)]
    cases = _bad_options(verifier, draft, out)
    for argv, want, fragments in cases:
        t0 = time.monotonic()
        code, _, err = invoke(*argv)
        took = time.monotonic() - t0
        flat = " ".join(err.split())
        assert code == want, (argv[:6], code, err)
        assert all(f in flat for f in fragments), (argv[:6], err)
        assert took < 2, f"{argv[:6]} took {took:.1f} s to be refused"
        assert not out.exists(), f"{argv[:6]} wrote {out}"
    assert [tree_hash(verifier), tree_hash(draft)] == before
    print(f"\noption values: tried {len(cases)}, refused {len(cases)}")


@pytest.mark.parametrize(("value", "fragment"), [(-1, "not a finite number above 0"), ("0.02", "not a finite"),
                                                 (1e300, "do not fit")])
def test_unusable_initializer_range_is_an_input_error(value, fragment, make_fixture, tmp_path):
    """Without --std the config's initializer_range is the std: a value that cannot be one is refused (it used
    to fall back to 0.02 without a word, or to write an all-Inf draft)."""
    target = make_fixture(FAMILY, config_overrides={"initializer_range": value})
    code, _, err = invoke("init-draft", target, "-o", tmp_path / "o")
    flat = " ".join(err.split())
    assert code == EXIT_INPUT and "initializer_range" in flat and fragment in flat and "--std" in flat, err
    assert not (tmp_path / "o").exists()


def test_good_option_values_still_work(verifier, tmp_path):
    run_ckpt("init-draft", verifier, "-o", tmp_path / "a", "--seed", str(2**63 - 1), "--std", "0.5",
             "--num-layers", "2")
    run_ckpt("extract", verifier, "-o", tmp_path / "b", "--layers", " 0 ")
    run_ckpt("diff", verifier, verifier, "--keys", r"^model\.layers\.\d+\.mlp")


# --------------------------------------------------------------------------- strict JSON


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"not JSON: bare {name}")

    return json.loads(text, parse_constant=refuse)


def _write(d: Path, tensors: dict[str, torch.Tensor]) -> Path:
    d.mkdir()
    save_file(tensors, d / SINGLE, metadata={"format": "pt"})
    return d


def test_diff_json_is_strict_with_nonfinite_values(tmp_path):
    a = _write(tmp_path / "a", {"nan": torch.tensor([1.0, 2.0]), "inf": torch.tensor([1e30, 0.0]),
                                "big": torch.tensor([1.0, 2.0], dtype=torch.float64)})
    b = _write(tmp_path / "b", {"nan": torch.tensor([float("nan"), 2.0]), "inf": torch.tensor([float("inf"), 0.0]),
                                "big": torch.tensor([1e300, 2.0], dtype=torch.float64)})
    code, out, _ = invoke("diff", a, b, "--stats", "--json")
    assert code == 1
    report = _strict(out)
    assert {t["key"] for t in report["tensors"]} == {"nan", "inf", "big"}


def test_every_json_report_is_strict(verifier, draft, tmp_path):
    o = tmp_path
    runs = [
        ["inspect", verifier, "--json"],
        ["inspect", verifier, "--discover", "--json"],
        ["validate", verifier, "--json"],
        ["tables", "--json"],
        ["extract", verifier, "-o", o / "x", "--json"],
        ["extract", verifier, "-o", o / "x2", "--dry-run", "--json"],
        ["verify-manifest", o / "x", "--json"],
        ["fuse-experts", verifier, "-o", o / "f", "--json"],
        ["fuse-experts", verifier, "--dry-run", "--json"],
        ["unfuse-experts", o / "f", "-o", o / "u", "--json"],
        ["init-draft", verifier, "-o", o / "i", "--json"],
        ["init-draft", verifier, "-o", o / "i2", "--dry-run", "--json"],
        ["stitch", draft, verifier, "-o", o / "s", "--json"],
        ["stitch", draft, verifier, "-o", o / "s2", "--dry-run", "--json"],
        ["diff", verifier, o / "s", "--stats", "--json"],
        ["validate", o / "x" / SINGLE, "--json"],  # exit 1 (a lone draft file): still JSON
    ]
    for argv in runs:
        code, out, err = invoke(*argv)
        assert code in (0, 1), (argv, code, err)
        _strict(out)
    print(f"\nstrict JSON: {len(runs)} --json runs parsed")


def test_dumps_strict_maps_nonfinite_values():
    obj = {"nan": float("nan"), "inf": math.inf, "ninf": -math.inf, "np": np.float32("nan"), "n": np.int64(3),
           "arr": np.array([1.5, np.inf]), "t": (1, 2), "path": Path("/x"), "ok": 0.25}
    assert _strict(dumps_strict(obj)) == {"nan": None, "inf": "inf", "ninf": "-inf", "np": None, "n": 3,
                                          "arr": [1.5, "inf"], "t": [1, 2], "path": "/x", "ok": 0.25}


@pytest.mark.parametrize("indent", [1, 2])
def test_dumps_indented_is_dumps_strict(indent, verifier, tmp_path):
    """The manifest's, the index's and the reports' fast indenting writes json's text, character for character."""
    run_ckpt("extract", verifier, "-o", tmp_path / "d")
    cases = [json.loads((tmp_path / "d" / "ckpt_manifest.json").read_text()), {}, [], {"a": [], "b": {}},
             [1.5, -0.0, 1e300, 2**70, True, False, None, "é\n\"\\x\u2028\x7f"], {"t": (1, (2, []))},
             {"a": [[], [{}], {"b": [1, {"c": None}]}]}, "s", 3, 0.1, None,
             {"nan": float("nan")}, {1: 2}, {"n": np.int64(3)}, {"p": Path("/x")}]  # the last ones: json's own way
    for case in cases:
        assert dumps_indented(case, indent) == dumps_strict(case, indent=indent), case


# --------------------------------------------------------------------------- every non-zero exit says why


def test_every_nonzero_exit_prints_its_cause(verifier, draft, tmp_path, monkeypatch):
    o = tmp_path
    broken = o / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    damaged = o / "damaged"
    run_ckpt("extract", verifier, "-o", damaged)
    manifest = json.loads((damaged / "ckpt_manifest.json").read_text())
    key = next(iter(manifest["tensors"]))
    manifest["tensors"][key]["blake3"] = "0" * 64
    (damaged / "ckpt_manifest.json").write_text(json.dumps(manifest))
    busy = o / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    cases = [
        ["validate", broken], ["validate", broken, "--json"], ["validate", o / "nothing-here"],
        ["inspect", broken], ["inspect", broken, "--json"], ["inspect", broken, "--discover"],
        ["verify-manifest", damaged], ["verify-manifest", damaged, "--json"], ["verify-manifest", verifier],
        ["diff", verifier, damaged], ["diff", verifier, damaged, "--json"], ["diff", verifier, broken],
        ["extract", verifier, "-o", busy], ["extract", broken, "-o", o / "e"],
        ["fuse-experts", verifier, "-o", o / "f", "--to", "per-expert"], ["fuse-experts", verifier],
        ["init-draft", broken, "-o", o / "i"], ["stitch", verifier, verifier, "-o", o / "s"],
        ["stitch", draft, broken, "-o", o / "s"], ["push", broken, "org/x", "--card", "bogus"],
        ["demo", "--family", "no_such_family"], ["inspect"], ["extract", verifier],
        ["demo", "--family", "llama"],  # a template without MTP: the extract step fails (the demo used to exit 0)
    ]
    for argv in cases:
        code, out, err = invoke(*argv)
        assert code != 0, argv
        assert (out + err).strip(), f"{argv}: exit {code} without a word"
        if code not in (1,):  # an error (not a report of findings) is said on stderr
            assert err.strip(), (argv, code, out)
    assert code == EXIT_INPUT and "demo stopped: step 'MTP layer -> native draft'" in err, err

    # bugs with no text of their own still name their cause
    import ckpt_tools.ops.inspect.inspect as inspect_op

    for exc, fragment in ((MemoryError(), "out of memory"), (RuntimeError(), "RuntimeError (no message)"),
                          (InputError(""), "InputError (no message)")):
        monkeypatch.setattr(inspect_op, "inspect_checkpoint", lambda *a, exc=exc, **k: (_ for _ in ()).throw(exc))
        code, _, err = invoke("inspect", verifier)
        assert code in (3, 5) and fragment in err, (exc, err)
    print(f"\nnon-zero exits: tried {len(cases) + 3}, each printed its cause")
