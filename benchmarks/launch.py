"""Launch one command and report its wall time, CPU, peak RSS and I/O counters as JSON.

``python -S launch.py RESULT.json TIMEOUT CMD...``. Standard library only.

Why a launcher: a child's ``ru_maxrss`` includes the memory of the process that forked
it (exec records the old address space's high-water mark), so children of the big
harness process would all report the harness's RSS. Forked from this small launcher
they report their own.

The child is reaped in two steps: ``waitid(WNOWAIT)`` returns once it has exited but
leaves it a zombie, so ``/proc/PID/io`` (whole-life I/O counters, threads included) can
still be read; ``wait4`` then reaps it and returns that child's own rusage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def read_io(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def main(argv: list[str]) -> int:
    result_path, timeout, cmd = argv[0], float(argv[1]), argv[2:]
    timed_out = False
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def on_alarm(_sig, _frame) -> None:
        nonlocal timed_out
        timed_out = True
        proc.kill()

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    wall = time.perf_counter() - t0
    signal.setitimer(signal.ITIMER_REAL, 0)
    io = read_io(proc.pid)
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    result = {
        "wall": wall, "user": ru.ru_utime, "sys": ru.ru_stime, "maxrss": ru.ru_maxrss * 1024,
        "rchar": io.get("rchar", 0), "wchar": io.get("wchar", 0), "read_bytes": io.get("read_bytes", 0),
        "write_bytes": io.get("write_bytes", 0), "returncode": rc, "timed_out": timed_out,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
