"""One writer over targets (issue 42 item 4): ``Writer`` drives a ``Target`` - a local directory or an object
store - and nothing subclasses it to replace its steps; ``Writer.run`` fits on a screen."""

from __future__ import annotations

import inspect
from pathlib import Path

from ckpt_tools.stream import writer
from ckpt_tools.stream.targets import target_for
from ckpt_tools.stream.targets.local import LocalTarget
from ckpt_tools.stream.targets.object_store import ObjectStoreTarget


def _protocol() -> set[str]:
    return {n for n in vars(writer.Target) if not n.startswith("_")} | set(writer.Target.__annotations__)


def test_both_targets_implement_the_whole_protocol_and_nothing_subclasses_the_writer():
    assert writer.Writer.__subclasses__() == []
    for cls in (LocalTarget, ObjectStoreTarget):
        target = cls.__new__(cls)
        target.__dict__.update(name="x", stats={}, reused={})  # instance attributes of the protocol
        assert not [n for n in _protocol() if not hasattr(target, n)], cls.__name__


def test_a_local_path_is_a_local_target(tmp_path):
    t = target_for(tmp_path / "out")
    assert isinstance(t, LocalTarget) and t.name == Path(tmp_path / "out")


def test_run_fits_on_a_screen():
    assert len(inspect.getsource(writer.Writer.run).splitlines()) <= 45
