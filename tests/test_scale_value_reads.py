"""``quant-scale-value`` reads each run of scales lying end to end in a shard at once (issue 43).

The safetensors writer stores a file's tensors by dtype, then name, so a shard's scales lie end to end, broken
only by other tensors of their dtype: one read per such run, not one per scale (a release: 222 reads for its
45,808 scales), every value is still judged where it lies in the run, and a shard cut inside a run is the same
short read, at the same byte, as when each scale was read alone.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from ckpt_tools.errors import InputError
from ckpt_tools.io.checkpoint import Checkpoint
from ckpt_tools.model.quant import scale_values

CORPUS = Path(__file__).resolve().parent.parent / "fixtures" / "producers"


def _runs(shard: Path, scales: set[str]) -> int:
    """Runs of scale tensors next to each other in the shard's own order of data (its raw header)."""
    with open(shard, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    return sum(k in scales and (i == 0 or order[i - 1] not in scales) for i, k in enumerate(order))


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = os.preadv

    def preadv(fd, buffers, offset):
        calls.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def test_scales_lying_end_to_end_are_read_at_once(monkeypatch):
    with Checkpoint.open(CORPUS / "llmcompressor-fp8-block") as ckpt:
        refs = scale_values.companions(ckpt)
        files = {r.file for r, _ in refs}
        keys = {r.key for r, _ in refs}
        runs = sum(_runs(Path(f), keys) for f in files)
        calls = _counting(monkeypatch)
        assert scale_values.scale_value_problems(ckpt) == []
    assert len(calls) == runs < len(refs) / 2, (len(calls), runs, len(refs))


def test_a_bad_value_inside_a_run_is_named_where_it_lies(tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(CORPUS / "llmcompressor-fp8-block", out)
    with Checkpoint.open(out) as ckpt:
        refs = sorted((r for r, _ in scale_values.companions(ckpt)), key=lambda r: (r.file, r.offset))
    # a scale inside a run, half way through the checkpoint: its neighbours lie end to end with it
    ref = next(b for a, b, c in zip(refs[len(refs) // 2:], refs[len(refs) // 2 + 1:], refs[len(refs) // 2 + 2:])
               if a.file == c.file and a.offset + a.nbytes == b.offset and b.offset + b.nbytes == c.offset)
    with open(ref.file, "r+b") as f:
        f.seek(ref.offset + ref.nbytes - 2)
        f.write(b"\xc0\x7f")  # the last BF16 value: NaN
    with Checkpoint.open(out) as ckpt:
        found = scale_values.scale_value_problems(ckpt)
    last = [int(n) - 1 for n in ref.shape]
    assert [(p.key, p.message.split(":")[0]) for p in found] == [
        (ref.key, f"scale value NaN at index {last} is not finite and positive")]


def test_a_shard_cut_inside_a_run_is_a_short_read_at_its_end(tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(CORPUS / "llmcompressor-fp8-block", out)
    with Checkpoint.open(out) as ckpt:
        refs = sorted((r for r, _ in scale_values.companions(ckpt)), key=lambda r: (r.file, r.offset))
        a, b = next((a, b) for a, b in zip(refs, refs[1:]) if a.file == b.file and a.offset + a.nbytes == b.offset)
        os.truncate(b.file, b.offset + 1)  # within the run, after the file was opened
        with pytest.raises(InputError) as e:
            scale_values.scale_value_problems(ckpt)
    assert (e.value.rule, e.value.path, e.value.message) == (
        "short-read", b.file, f"short read at byte {b.offset + 1} (file changed or shrank while reading?)")
