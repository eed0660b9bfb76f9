"""A lock object on an output prefix: created by a conditional put, so a second writer refuses.

``If-None-Match: *`` makes the store create the object only if none exists (S3, and moto's
server; fsspec's ``mode="create"``). Unlike the local flock, nothing releases it when its
holder dies: the holder's host and pid are in it, so a run on the same host whose holder is
gone takes it over; otherwise the message says how to remove it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from ...errors import OutputError
from ...io.artefacts import LOCK_NAME
from .store import Store


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


class ObjectLock:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.path = store.path(LOCK_NAME)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime())}
        self.content = (json.dumps(me) + "\n").encode()
        if self._create():
            return
        holder = self._holder()
        if holder and holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) \
                and not _alive(holder["pid"]):
            # a killed run of this host: take its lock over (the race of two takers on one host is left open)
            store.remove([LOCK_NAME])
            if self._create():
                return
            holder = self._holder()
        who = f" (host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')})" if holder else ""
        raise OutputError(
            f"another ckpt command{who} is writing this prefix (lock object {LOCK_NAME} exists); wait for it or pick "
            f"another -o. If no writer is running (a killed run), delete {store.url_of(LOCK_NAME)} and rerun with "
            "--resume", rule="output-locked", path=store.url)

    def _create(self) -> bool:
        with self.store.errors(self.store.url_of(LOCK_NAME), "lock"):
            try:
                self.store.fs.pipe_file(self.path, self.content, mode="create")
            except FileExistsError:  # 412 Precondition Failed: someone holds it
                return False
        return True

    def _holder(self) -> dict | None:
        raw = self.store.cat(LOCK_NAME)
        try:
            holder = json.loads(raw) if raw else None
        except ValueError:
            return None
        return holder if isinstance(holder, dict) else None

    def release(self) -> None:
        with contextlib.suppress(Exception):  # releasing must not hide the error being raised
            self.store.fs.rm_file(self.path)
