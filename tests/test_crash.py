"""Crash consistency: `ckpt extract` and `ckpt stitch` killed with SIGKILL at many points.

After every kill the inputs are byte-identical, and the output is either complete (its
completion marker - the index, or the lone model.safetensors renamed last - is there, and
every file equals an uninterrupted run's) or visibly incomplete (no marker; `ckpt validate`
fails and, when the dead writer's lock is there, says to rerun with --resume). Rerunning with
--resume - past the dead run's lock file - then gives exactly the uninterrupted run's files.

Commands run in real child processes forked from a "zygote" (a Python process that imported
the tool, its tables and torch once), so a kill loop costs milliseconds of start-up, not
seconds. Kill points are both timed (10/30/60/90% into the write phase of an uninterrupted
run) and pinned to writer events (after the n-th byte-range copy, after a given file is
renamed into place).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpt_tools.cli import app

from conftest import tree_hash

runner = CliRunner()

MANIFEST = "ckpt_manifest.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# ~31 MB verifier (4 shards), ~12 MB draft: an uninterrupted run takes about a second on 2 busy cores.
BIG = dict(hidden_size=512, vocab_size=2048, n_routed_experts=8, moe_intermediate_size=256)
TIMED = (0.1, 0.3, 0.6, 0.9)  # fractions of the write phase (lock taken -> command done)

# The zygote: imports everything once, then forks one child per command. A child may be told to
# SIGKILL itself at a writer event ("copy" n: after the n-th byte-range copy; "replace" name: right
# after a file of that name is renamed into place), to pause ("pause" n seconds: after the n-th copy)
# and to run under an RLIMIT_FSIZE.
ZYGOTE = r'''
import json, os, resource, signal, sys
sys.argv = ["ckpt"]
from ckpt_tools.cli import app
from ckpt_tools.model.tables.loader import all_tables
import ckpt_tools.ops.draft.extract, ckpt_tools.ops.check.validate, ckpt_tools.stream.targets.local
all_tables()
if os.environ.get("ZYGOTE_TORCH") == "1":
    import torch, ckpt_tools.ops.stitch.plan
    torch.set_num_threads(1)


def arm(kill):
    import ckpt_tools.stream.targets.local as w

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if kill[0] in ("copy", "pause"):
        orig, left = w.copy_range, [kill[1]]

        def copy_range(*a, **k):
            orig(*a, **k)
            left[0] -= 1
            if left[0] == 0:
                if kill[0] == "pause":
                    import time
                    time.sleep(kill[2])
                else:
                    die()
        w.copy_range = copy_range
    elif kill[0] == "replace":
        orig_replace = os.replace

        def replace(src, dst, *a, **k):
            orig_replace(src, dst, *a, **k)
            if os.path.basename(dst) == kill[1]:
                die()
        os.replace = replace


def child(req):
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if req.get("fsize") is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
    if req.get("kill"):
        arm(req["kill"])
    sys.argv = ["ckpt", *req["args"]]
    try:
        app(req["args"], prog_name="ckpt")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "wait":
        _, status = os.waitpid(req["pid"], 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"code": code}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        code = 98
        try:
            code = child(req)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
'''


class Zygote:
    """Runs `ckpt` commands in freshly forked child processes (real processes, real signals)."""

    def __init__(self, torch: bool = False) -> None:
        env = dict(os.environ, ZYGOTE_TORCH="1" if torch else "0")
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.ready = False  # it starts up while the caller builds fixtures

    def wait_ready(self) -> None:
        if not self.ready:
            assert self.proc.stdout.readline(), "the zygote failed to start"
            self.ready = True

    def _ask(self, req: dict) -> dict:
        self.wait_ready()
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, args, log: Path, *, kill=None, fsize: int | None = None) -> int:
        req = {"op": "run", "args": [str(a) for a in args], "log": str(log), "kill": kill, "fsize": fsize}
        return self._ask(req)["pid"]

    def wait(self, pid: int) -> int:
        """Exit code of the child (negative: killed by that signal)."""
        return self._ask({"op": "wait", "pid": pid})["code"]

    def run(self, args, log: Path, **kw) -> tuple[int, float]:
        self.wait_ready()
        t0 = time.monotonic()
        code = self.wait(self.start(args, log, **kw))
        return code, time.monotonic() - t0

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.kill()  # our own process; its interpreter shutdown is not worth waiting for
        self.proc.wait(timeout=30)


_ZYGOTES: dict[bool, Zygote] = {}


def shared_zygote(torch: bool) -> Zygote:
    """One zygote per test process, shared by the modules that run commands in child processes.
    ``torch``: the children need torch (stitch compares tensors); a torch zygote also serves the rest."""
    if True in _ZYGOTES:
        return _ZYGOTES[True]
    if not torch and False in _ZYGOTES:
        return _ZYGOTES[False]
    if not _ZYGOTES:
        atexit.register(lambda: [z.close() for z in _ZYGOTES.values()])
    _ZYGOTES[torch] = Zygote(torch=torch)
    return _ZYGOTES[torch]


@pytest.fixture
def zygote():
    """For stitch (it compares tensors with torch)."""
    return shared_zygote(torch=True)


@pytest.fixture
def zygote_light():
    """For extract: no torch import, a quicker start (unless a torch zygote is running already)."""
    return shared_zygote(torch=False)


@pytest.fixture(scope="module")
def small(make_fixture):
    return make_fixture("deepseek_v3")


@pytest.fixture(scope="module")
def inputs(make_fixture, tmp_path_factory):
    """The verifier, and a finetuned native draft of it (one MTP tensor changed)."""
    verifier = make_fixture("deepseek_v3", config_overrides=BIG)
    draft = tmp_path_factory.mktemp("crash") / "draft"
    r = runner.invoke(app, ["extract", str(verifier), "-o", str(draft)])
    assert r.exit_code == 0, r.output
    tensors = load_file(draft / SINGLE)
    key = next(k for k in sorted(tensors) if k.endswith("eh_proj.weight"))
    tensors[key] = (tensors[key].float() * 1.01).to(tensors[key].dtype)
    save_file(tensors, draft / SINGLE, metadata={"format": "pt"})
    return verifier, draft


def commands(verifier: Path, draft: Path) -> dict[str, tuple[list, list[Path]]]:
    """name -> (argv without -o, input directories)."""
    return {
        "extract": (["extract", verifier], [verifier]),
        "stitch": (["stitch", draft, verifier], [draft, verifier]),
    }


def normalized(path: Path) -> bytes:
    """A file's bytes; for the manifest, without the command line (it names -o and --resume) and the file_stats
    (inodes and mtimes of this run's files)."""
    data = path.read_bytes()
    if path.name == MANIFEST:
        obj = json.loads(data)
        obj.pop("command", None)
        obj.pop("file_stats", None)
        return json.dumps(obj, sort_keys=True).encode()
    return data


def visible_files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and not p.name.startswith("."))


def assert_same_output(out: Path, ref: Path, *, report_may_be_placeholder: bool = False) -> None:
    assert visible_files(out) == visible_files(ref)
    for name in visible_files(ref):
        if name == "stitch-report.json" and report_may_be_placeholder and (out / name).read_bytes() == b"{}":
            continue  # killed after the weights were complete, before the report was filled in
        assert normalized(out / name) == normalized(ref / name), f"{name} differs from an uninterrupted run"


def is_complete(out: Path) -> bool:
    return (out / INDEX).is_file() or (out / SINGLE).is_file()


def validate_code(out: Path) -> tuple[int, str]:
    r = runner.invoke(app, ["validate", str(out)])
    assert "Traceback" not in r.output
    return r.exit_code, r.output


def wait_for_writer(out: Path, timeout: float = 60.0) -> float:
    """When the writer took the output's lock (the end of planning): polled, so a few ms late at most."""
    deadline = time.monotonic() + timeout
    while not (out / ".ckpt.lock").exists():
        assert time.monotonic() < deadline, f"no writer started on {out}"
        time.sleep(0.002)
    return time.monotonic()


class Outcomes:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []
        self.refusal_checked = False

    def add(self, cmd: str, point: str, state: str) -> None:
        self.rows.append((cmd, point, state))


def check_killed(cmd: str, point: str, out: Path, ref: Path, argv: list, ins: list[Path], hashes: list[str],
                 outcomes: Outcomes) -> None:
    """The checks after one kill, then --resume and compare with the uninterrupted run."""
    assert [tree_hash(p) for p in ins] == hashes, f"{cmd} killed at {point} changed an input"
    if not out.exists():
        state = "nothing written"
    elif is_complete(out):
        state = "complete"
        assert_same_output(out, ref, report_may_be_placeholder=True)
        assert validate_code(out)[0] == 0
    else:
        state = "incomplete"
        code, text = validate_code(out)
        assert code in (1, 3), f"validate accepted an interrupted output ({point}): {text}"
        if (out / ".ckpt.lock").exists():  # the dead writer's lock: validate says what happened and what to do
            assert "stopped (or is still running)" in text and "--resume" in text, text
        started = [p for p in out.iterdir() if p.name != ".ckpt.lock"]  # only a dead lock: as good as empty
        if started and not outcomes.refusal_checked:
            # without --resume (or --overwrite) a half-written directory is refused, with a hint (checked once:
            # planning a stitch compares every tensor)
            r = runner.invoke(app, [str(a) for a in argv] + ["-o", str(out)])
            assert r.exit_code == 4 and "--resume" in r.output, r.output
            outcomes.refusal_checked = True
    outcomes.add(cmd, point, state)
    r = runner.invoke(app, [str(a) for a in argv] + ["-o", str(out), "--resume"])
    assert r.exit_code == 0, f"--resume after a kill at {point}: {r.output}"
    assert_same_output(out, ref)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "temporary files or lock left"


@pytest.mark.parametrize("cmd", ["extract", "stitch"])
def test_sigkill_then_resume(cmd, inputs, tmp_path, request):
    zygote = request.getfixturevalue("zygote" if cmd == "stitch" else "zygote_light")
    verifier, draft = inputs
    argv, ins = commands(verifier, draft)[cmd]
    hashes = [tree_hash(p) for p in ins]
    log = tmp_path / "log"

    ref = tmp_path / "ref"
    # an uninterrupted run, timed: its write phase starts when the writer takes the output's lock
    zygote.wait_ready()
    t0 = time.monotonic()
    pid = zygote.start([*argv, "-o", ref], log)
    writing = wait_for_writer(ref) - t0
    code = zygote.wait(pid)
    window = time.monotonic() - t0 - writing
    assert code == 0, log.read_text()
    assert is_complete(ref)

    points: list[tuple[str, object]] = [(f"{int(f * 100)}% into writing ({window:.2f} s)", f) for f in TIMED]
    # pinned to writer events: inside the first file, after the first file is in place, with the
    # manifest written but no completion marker, right after the marker
    points += [("after 2nd tensor copy", ("copy", 2))]
    if cmd == "extract":  # one lone model.safetensors, renamed last
        points += [("after config.json", ("replace", "config.json")),
                   ("after manifest", ("replace", MANIFEST)), ("after marker", ("replace", SINGLE))]
    else:  # rewritten shard(s) plus copied verifier shards
        first = sorted(p.name for p in verifier.glob("*.safetensors"))[0]
        points += [("after 1st verifier shard", ("replace", first)),
                   ("after manifest", ("replace", MANIFEST)), ("after index", ("replace", INDEX))]

    outcomes = Outcomes()
    stale_locks = 0
    for n, (label, how) in enumerate(points):
        out = tmp_path / f"out{n}"
        if isinstance(how, float):
            pid = zygote.start([*argv, "-o", out], log)
            wait_for_writer(out)
            time.sleep(window * how)
            os.kill(pid, signal.SIGKILL)
            code = zygote.wait(pid)
            if code != -signal.SIGKILL:
                assert code == 0, log.read_text()  # finished before the kill landed
        else:
            code = zygote.run([*argv, "-o", out], log, kill=how)[0]
            assert code == -signal.SIGKILL, f"{label}: the kill point was never reached ({code}): {log.read_text()}"
        stale_locks += (out / ".ckpt.lock").exists()
        check_killed(cmd, label, out, ref, argv, ins, hashes, outcomes)

    assert [tree_hash(p) for p in ins] == hashes  # and after every --resume
    states = {s for _, _, s in outcomes.rows}
    assert "incomplete" in states and "complete" in states, outcomes.rows
    assert stale_locks, "no kill landed while the lock was held"
    assert outcomes.refusal_checked
    print(f"\n{cmd}: " + "; ".join(f"{p}: {s}" for _, p, s in outcomes.rows))


def test_removing_the_output_and_rerunning_matches(zygote_light, small, tmp_path):
    """The other way back from a kill: delete the half-written directory and run again."""
    zygote, verifier = zygote_light, small
    log = tmp_path / "log"
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert zygote.run(["extract", verifier, "-o", ref], log)[0] == 0
    assert zygote.run(["extract", verifier, "-o", out], log, kill=("copy", 3))[0] == -signal.SIGKILL
    assert not is_complete(out)
    shutil.rmtree(out)
    assert zygote.run(["extract", verifier, "-o", out], log)[0] == 0
    assert_same_output(out, ref)


def test_resume_with_a_live_writer_is_refused(zygote_light, small, tmp_path):
    """The lock is an flock: a live holder blocks --resume (only a dead one's lock file is ignored)."""
    import fcntl

    zygote, verifier = zygote_light, small
    out = tmp_path / "out"
    assert zygote.run(["extract", verifier, "-o", out], tmp_path / "log", kill=("copy", 2))[0] == -signal.SIGKILL
    fd = os.open(out / ".ckpt.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = runner.invoke(app, ["extract", str(verifier), "-o", str(out), "--resume"])
        assert r.exit_code == 4 and "lock" in r.output, r.output
    finally:
        os.close(fd)
    r = runner.invoke(app, ["extract", str(verifier), "-o", str(out), "--resume"])
    assert r.exit_code == 0, r.output


def test_resume_rewrites_a_shard_that_does_not_match_the_plan(small, tmp_path):
    """A finished shard is skipped only when its header matches the plan; a damaged one is rewritten."""
    verifier = small
    ref, out = tmp_path / "ref", tmp_path / "out"
    for d in (ref, out):
        r = runner.invoke(app, ["extract", str(verifier), "-o", str(d), "--max-shard-size", "40KB"])
        assert r.exit_code == 0, r.output
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2
    (out / INDEX).unlink()  # as if killed before the index
    with open(shards[0], "r+b") as f:  # same size, another header
        f.seek(12)
        f.write(b"X")
    shards[1].write_bytes(shards[1].read_bytes()[:-1])  # truncated
    inodes = [p.stat().st_ino for p in shards]
    r = runner.invoke(app, ["extract", str(verifier), "-o", str(out), "--max-shard-size", "40KB", "--resume"])
    assert r.exit_code == 0, r.output
    assert_same_output(out, ref)
    after = [p.stat().st_ino for p in shards]
    assert after[0] != inodes[0] and after[1] != inodes[1], "damaged shards were not rewritten"
    assert after[2:] == inodes[2:], "intact shards were rewritten instead of skipped"


def test_resume_with_another_shard_size_is_refused(small, tmp_path):
    """Another --max-shard-size is another plan: --resume refuses (finished shards are never reused across plans)
    and leaves the directory as it was; --overwrite then writes the new plan without stale shards."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    for d, size in ((ref, "60KB"), (out, "40KB")):
        r = runner.invoke(app, ["extract", str(small), "-o", str(d), "--max-shard-size", size])
        assert r.exit_code == 0, r.output
    (out / INDEX).unlink()  # as if killed before the index
    before = tree_hash(out)
    assert {p.name for p in out.glob("*.safetensors")} != {p.name for p in ref.glob("*.safetensors")}
    r = runner.invoke(app, ["extract", str(small), "-o", str(out), "--max-shard-size", "60KB", "--resume"])
    assert r.exit_code == 4 and "[resume-mismatch]" in r.output and "plan differs" in r.output, r.output
    assert tree_hash(out) == before and not is_complete(out)
    r = runner.invoke(app, ["extract", str(small), "-o", str(out), "--max-shard-size", "60KB", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert_same_output(out, ref)
