"""Error types and the exit codes they map to.

Every failure the tool reports on purpose is a ``CkptError``. The CLI prints its
message (no traceback unless ``--debug``) and exits with its ``exit_code``:

    0  success
    1  the check found problems (validate) or differences (diff)
    2  usage error (bad option, bad combination of options)
    3  unusable input: unreadable or hostile checkpoint, missing tensors, unknown family
    4  output error: cannot write, output exists, disk full
    5  internal error: a bug (``ckpt --debug`` shows the traceback)
    128 + N  stopped by signal N (129 SIGHUP, 130 SIGINT, 143 SIGTERM); 141 stdout closed early
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_FOUND = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_OUTPUT = 4


class CkptError(Exception):
    """Base class: a failure with a message meant for the user."""

    exit_code = EXIT_INPUT

    def __init__(self, message: str, *, rule: str | None = None, path: str | None = None,
                 key: str | None = None) -> None:
        self.rule = rule
        self.path = path
        self.key = key  # the tensor key the failure is about, when there is one
        self.message = message  # without the "path: [rule]" prefix
        parts = []
        if path:
            parts.append(str(path))
        if rule:
            parts.append(f"[{rule}]")
        parts.append(message)
        super().__init__(": ".join(parts) if path else " ".join(parts))


class CheckFailed(CkptError):
    """The command ran and measured, and what it measured fails its check (validate's problems, diff's
    differences, probe's greedy mismatch or acceptance below --min-acceptance). ``report`` holds the result."""

    exit_code = EXIT_FOUND

    def __init__(self, message: str, *, report: object = None, **where: str | None) -> None:
        super().__init__(message, **where)
        self.report = report


class UsageError(CkptError):
    exit_code = EXIT_USAGE


class InputError(CkptError):
    """The input cannot be used (corrupt, hostile, incomplete, unknown)."""

    exit_code = EXIT_INPUT


class HeaderError(InputError):
    """A safetensors file breaks a format rule."""


class TableError(InputError):
    """A mapping table is malformed or does not fit the checkpoint."""


class PlanError(InputError):
    """The requested transform cannot be planned (missing, extra or mis-shaped tensors)."""


class OutputError(CkptError):
    exit_code = EXIT_OUTPUT


def extra_module(name: str, what: str, package: str, extra: str, hint: str = "") -> Any:
    """Module ``name``, or a UsageError (exit 2, ``missing-extra``) naming the extra that installs it."""
    try:
        return __import__(name)
    except ImportError as e:
        raise UsageError(f"{what} needs {package}, which is not installed ({e.msg}); install the extra: "
                         f"pip install '{extra}'{hint}", rule="missing-extra") from None
