"""Run one command under ``launch.py`` and collect its measurements (see launch.py for why).

Reported per run: wall, user and system CPU, peak RSS of the command's own process,
and its ``/proc/PID/io`` counters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Sample:
    wall: float  # seconds, fork to exit
    user: float  # CPU seconds
    sys: float
    maxrss: int  # bytes (peak resident set of the child)
    rchar: int = 0  # bytes through read-like syscalls (read, pread, copy_file_range, sendfile; not mmap)
    wchar: int = 0  # bytes through write-like syscalls (write, copy_file_range, sendfile)
    read_bytes: int = 0  # bytes fetched from the block device (0 on a warm page cache)
    write_bytes: int = 0  # bytes of page cache dirtied for the device (what will reach the disk)
    returncode: int = 0
    timed_out: bool = False
    stderr_tail: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def cpu(self) -> float:
        return self.user + self.sys

    def to_json(self) -> dict:
        d = asdict(self)
        d["cpu"] = self.cpu
        if not self.stderr_tail:
            d.pop("stderr_tail")
        if not self.extra:
            d.pop("extra")
        return d


LAUNCHER = Path(__file__).resolve().parent / "launch.py"


def run(cmd: list[str], *, log: Path, env: dict | None = None, cwd: str | None = None,
        timeout: float = 900.0) -> Sample:
    """Run ``cmd`` with stdout and stderr into ``log``; measure it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    result = log.with_suffix(".measure.json")
    result.unlink(missing_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.run([sys.executable, "-S", str(LAUNCHER), str(result), str(timeout), *cmd],
                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                              timeout=timeout + 60)
    if proc.returncode != 0 or not result.exists():
        tail = log.read_bytes()[-2000:].decode("utf-8", "replace")
        return Sample(0.0, 0.0, 0.0, 0, returncode=proc.returncode or -1, stderr_tail="launcher failed: " + tail)
    m = json.loads(result.read_text())
    tail = ""
    if m["returncode"] != 0:
        tail = log.read_bytes()[-2000:].decode("utf-8", "replace")
    return Sample(m["wall"], m["user"], m["sys"], m["maxrss"], m["rchar"], m["wchar"], m["read_bytes"],
                  m["write_bytes"], m["returncode"], m["timed_out"], tail)
