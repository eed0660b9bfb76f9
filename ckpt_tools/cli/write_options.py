"""What every writing verb shares (its options are declared in api/options.py): ``--layers`` parsing, the
invocation the manifest records, and the lines said after a write."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .common import command_line, human_bytes, out_console, say_allowed


def layers(text: str | None) -> list[int] | None:
    """--layers: MTP depths, each below the MTP bound, none twice (extract and stitch)."""
    if text is None:
        return None
    from ..model.tables.resolve import MAX_MTP_LAYERS
    from ..options import index_list

    return index_list("--layers", text, MAX_MTP_LAYERS - 1)


@contextlib.contextmanager
def invoked() -> Iterator[None]:
    """Around a writing verb's call: the manifest records the command line, and what --allow-invalid let
    in is said once the plan is made (before anything is written)."""
    from ..api.writing import invocation

    with invocation(command_line(), on_plan=lambda plan: say_allowed(plan.manifest.get("allowed_invalid"))):
        yield


def say_written(report: Any) -> None:
    """The line after a write: tensors, bytes, where, how long, how much was read."""
    w = report.written
    out_console().print(f"wrote {w.tensors} tensors ({human_bytes(w.tensor_bytes)}) to {w.output} "
                        f"in {w.seconds} s; read {human_bytes(w.bytes_read)} from the source")


def say_shards_written(out: str, report: Any) -> None:
    """The line after a stitch or graft: which of the verifier's shards were rewritten, which are new."""
    out_console().print(f"wrote {out}; rewritten shards: {', '.join(report.rewritten_shards) or '-'}; "
                        f"new shards: {', '.join(report.new_shards) or '-'}")
    links = getattr(report, "link_digests", None)
    if links and links["hashed"]:  # a link moves no bytes: its digest for the manifest is one read of what landed
        first = next(iter(links["hashed"].items()))
        out_console().print(f"linked shards hashed for the manifest: {len(links['hashed'])} "
                            f"({human_bytes(links['hashed_bytes'])}), e.g. {first[0]}: {first[1]}; "
                            f"taken from the input's manifest: {len(links['from_manifest'])}", soft_wrap=True)
