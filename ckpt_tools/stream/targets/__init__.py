"""Where a writer's output goes: a local directory, or an object store named by an fsspec URL.

One writer (``writer.Writer``) drives a ``writer.Target``: ``local.LocalTarget`` (temporary files
renamed into place, an flock) or, for ``-o s3://bucket/prefix`` (or any fsspec URL of a store:
``gs://``, ``az://``, ...), ``object_store.ObjectStoreTarget``: multipart uploads streamed from
the plan, server-side copies, a lock object created by a conditional put. Same plan, manifest,
validation and index-last order.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import UsageError

if TYPE_CHECKING:
    from ..plan import Plan
    from ..writer import Target, Writer

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# fsspec protocols that are not object stores we can write to (hf:// goes through `ckpt push`)
_NOT_STORES = {"hf": "write locally and publish with `ckpt push`", "http": "read-only", "https": "read-only"}

Output = Path | str  # a local directory, or the URL of a prefix in an object store


def is_url(out: object) -> bool:
    return isinstance(out, str) and _SCHEME.match(out) is not None


def output_location(text: str | os.PathLike) -> Output:
    """-o as given: a URL with a scheme stays a string (its prefix), anything else is a local path.

    ``file://`` is a local path. Credentials written into the URL are refused: they would land in
    the manifest's command line and in messages; the standard chains provide them.
    """
    text = os.fspath(text)
    m = _SCHEME.match(text)
    if m is None:
        return Path(text)
    scheme = m.group(1).lower()
    rest = text[m.end():]
    if scheme == "file":
        return Path(rest)
    if scheme in _NOT_STORES:
        raise UsageError(f"-o {text}: {scheme}:// is not an output target ({_NOT_STORES[scheme]})")
    if "@" in rest.split("/", 1)[0]:
        raise UsageError(f"-o {scheme}://...: credentials in the URL are refused; give them through the environment, "
                         "a profile or the instance's role", rule="credentials-in-url")
    if not rest.strip("/"):
        raise UsageError(f"-o {text}: name a bucket (and a prefix), e.g. {scheme}://bucket/prefix")
    return f"{scheme}://{rest.rstrip('/')}"


def target_for(out: Output) -> Target:
    """Where ``out`` lands: a local directory, or an object store for a URL."""
    if is_url(out):
        from .object_store import ObjectStoreTarget

        return ObjectStoreTarget(str(out))
    from .local import LocalTarget

    return LocalTarget(out)


def writer_for(plan: Plan, out: Output, **kwargs) -> Writer:
    from ..writer import Writer

    return Writer(plan, target_for(out), **kwargs)


def write_output_file(out: Output, name: str, content: bytes) -> None:
    """One more small file into a finished output (a report written after the index): atomic either way."""
    target_for(out).put(name, content)
