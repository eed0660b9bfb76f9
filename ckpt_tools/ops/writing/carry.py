"""How the input's files reach the output untouched: carried side files (tokenizer, code, README, ...),
shards copied, linked or left on the Hub (``--link``, ``LINK_MODES``), and the checks on ``--link``.
"""

from __future__ import annotations

from ...errors import UsageError
from ...io.checkpoint import Checkpoint
from ...stream.plan import OutputFile

LINK_MODES = ("copy", "reflink", "hardlink", "remote")


def carried_files(ckpt: Checkpoint) -> list[OutputFile]:
    """Tokenizer, generation config, chat template, code, README: copied as they are."""
    if ckpt.local_dir is None:
        fetch = getattr(ckpt, "fetch_file", None)
        return [OutputFile(name, source=fetch(name)) for name in ckpt.files] if fetch else []
    return [OutputFile(name, source=ckpt.local_dir / name) for name in ckpt.files]


def untouched_file(verifier: Checkpoint, shard: str, link: str, tensors: dict[str, int], name: str | None = None
               ) -> OutputFile:
    """A verifier shard the stitch leaves alone: copied, linked, or (remote) left on the Hub."""
    if link == "remote":
        return OutputFile(name or shard, link="remote", remote=f"{verifier.root}/{shard}", tensors=tensors)
    return OutputFile(name or shard, source=verifier.file_path(shard), link=link, tensors=tensors)


def check_inputs(link: str, verifier: Checkpoint, other: Checkpoint, roles: tuple[str, str] = ("verifier", "draft")
                 ) -> None:
    """--link against the verifier (the checkpoint whose shards are carried), and two distinct inputs."""
    check_link(link, verifier, roles[0])
    if other.local_dir is not None and verifier.local_dir is not None and \
            other.local_dir.resolve() == verifier.local_dir.resolve():
        raise UsageError(f"the {roles[1]} and the {roles[0]} are the same directory")


def check_link(link: str, carried: Checkpoint, role: str) -> None:
    """--link against the checkpoint whose untouched shards are carried (``role`` names it in messages)."""
    if link == "symlink":  # removed: links out of the output fail our own shard-path rule
        raise UsageError("--link symlink was removed: a symlinked output is not self-contained and every verb "
                         "refuses shards that resolve outside the checkpoint; use --link hardlink or --link reflink "
                         "(the same space saving)")
    if link not in LINK_MODES:
        raise UsageError(f"--link {link!r}: use one of {', '.join(LINK_MODES)}")
    if link == "remote" and carried.local_dir is not None:
        raise UsageError(f"--link remote needs an hf:// {role} (its untouched shards stay on the Hub)")
