"""The Hugging Face Hub: ``hf://`` URLs, the endpoint, transfer accounting and clear errors.

Reading lives in ``sources.hf`` (a commit-pinned store read by byte ranges), publishing in
``hub_push`` and the model card in ``model_card``. Everything goes through huggingface_hub (its
HTTP session, backoff, token sources); ``HF_ENDPOINT`` is read at call time so it always wins.
Tokens are never printed: error messages name the repository, the revision and what to do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import unquote

from ..errors import CkptError, InputError, OutputError, UsageError
from .sources.stats import DOWNLOADS

HF_PREFIX = "hf://"
DEFAULT_REVISION = "main"
T = TypeVar("T")


# ---------------------------------------------------------------------------
# URLs and settings


@dataclass(frozen=True)
class HubRef:
    """``hf://ORG/REPO[@REVISION]``; a revision may be a branch, a tag, a commit or ``refs/pr/N``."""

    repo_id: str
    revision: str | None = None

    @property
    def rev(self) -> str:
        return self.revision or DEFAULT_REVISION

    def __str__(self) -> str:
        return f"{HF_PREFIX}{self.repo_id}@{self.rev}"


def parse_repo_rev(text: str, what: str = "repository") -> HubRef:
    """``ORG/REPO[@REV]`` (with or without ``hf://``) -> HubRef; UsageError when malformed."""
    body = text[len(HF_PREFIX):] if text.startswith(HF_PREFIX) else text
    repo, sep, rev = body.partition("@")
    repo = repo.strip("/")
    parts = repo.split("/")
    bad = not repo or len(parts) > 2 or any(not p or p in (".", "..") for p in parts)
    if bad or (sep and not rev):
        raise UsageError(f"{what} {text!r} is not of the form ORG/REPO[@REVISION]")
    return HubRef(repo, unquote(rev) if rev else None)


def parse_hf_url(url: str) -> HubRef:
    if not url.startswith(HF_PREFIX):
        raise UsageError(f"{url!r} is not an hf:// URL")
    return parse_repo_rev(url, "hf:// source")


def endpoint() -> str:
    """The Hub endpoint: ``HF_ENDPOINT`` when set (read now, not at import), else huggingface_hub's."""
    env = os.environ.get("HF_ENDPOINT")
    if env:
        return env.rstrip("/")
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def get_api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint())


def retry_settings() -> tuple[int, float]:
    """(retries, first wait in seconds) for transient network failures; doubled per retry, capped at 8 s."""
    try:
        retries = int(os.environ.get("CKPT_HUB_RETRIES", "5"))
        wait = float(os.environ.get("CKPT_HUB_RETRY_WAIT", "1"))
    except ValueError:
        raise UsageError("CKPT_HUB_RETRIES / CKPT_HUB_RETRY_WAIT must be numbers") from None
    return max(retries, 0), max(wait, 0.0)


# ---------------------------------------------------------------------------
# Transfer accounting


# every remote source's downloads are counted in one place (the Hub is one origin among others)
HUB_STATS = DOWNLOADS


# ---------------------------------------------------------------------------
# Errors


class HubReadError(InputError):
    """Reading from the Hub failed (exit 3): repository, revision or file missing, auth, network."""


class HubPushError(OutputError):
    """Publishing to the Hub failed (exit 4)."""


def _status(exc: BaseException) -> int | None:
    resp = getattr(exc, "response", None)
    return getattr(resp, "status_code", None)


def _http_module():
    """The HTTP library huggingface_hub runs on (httpx2 in 2.x, httpx in 1.x)."""
    from huggingface_hub.utils import _http

    return getattr(_http, "httpx2", None) or _http.httpx


def is_transient(exc: BaseException) -> bool:
    http = _http_module()
    if isinstance(exc, (http.TransportError, ConnectionError, TimeoutError)):
        from huggingface_hub.errors import OfflineModeIsEnabled

        return not isinstance(exc, OfflineModeIsEnabled)
    return _status(exc) in (408, 429, 500, 502, 503, 504)


def hub_error(exc: BaseException, *, ref: HubRef | str, what: str, push: bool = False) -> CkptError:
    """Turn a huggingface_hub / network exception into a CkptError that says what to do."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cls = HubPushError if push else HubReadError
    repo = ref.repo_id if isinstance(ref, HubRef) else str(ref)
    rev = ref.rev if isinstance(ref, HubRef) else None
    token_hint = ("set HF_TOKEN (or run `hf auth login`) with a token that can "
                  + ("write to" if push else "read") + f" {repo}")
    status = _status(exc)
    if isinstance(exc, OfflineModeIsEnabled):
        return cls(f"{what}: HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it to use hf:// sources",
                   rule="hub-offline", path=repo)
    if isinstance(exc, GatedRepoError):
        return cls(f"{what}: {repo} is gated and this token has no access; request access on the repository "
                   f"page, then {token_hint}", rule="hub-gated", path=repo)
    if isinstance(exc, RepositoryNotFoundError):
        return cls(f"{what}: repository {repo} not found at {endpoint()} (or it is private and the token cannot "
                   f"see it); check the name, and for a private repository {token_hint}",
                   rule="hub-repo-not-found", path=repo)
    if isinstance(exc, RevisionNotFoundError):
        return cls(f"{what}: revision {rev!r} not found in {repo}; check the branch, tag or commit after '@'",
                   rule="hub-revision-not-found", path=repo)
    if isinstance(exc, LocalEntryNotFoundError):
        return cls(f"{what}: cannot reach {endpoint()} and the file is not cached ({_short(exc)})",
                   rule="hub-network", path=repo)
    if isinstance(exc, EntryNotFoundError):
        return cls(f"{what}: file not found in {repo}@{rev}", rule="hub-file-not-found", path=repo)
    if status == 401:
        return cls(f"{what}: the Hub rejected the token (401 Unauthorized): it is invalid, expired or missing; "
                   f"{token_hint}", rule="hub-auth", path=repo)
    if status == 403:
        return cls(f"{what}: permission denied (403 Forbidden): the token cannot "
                   + ("write to" if push else "read") + f" {repo}; use a token with "
                   + ("write" if push else "read") + " access (fine-grained tokens need the repository or its "
                   "organisation enabled)", rule="hub-forbidden", path=repo)
    if is_transient(exc):
        retries, _ = retry_settings()
        return cls(f"{what}: network failure talking to {endpoint()} after {retries} retries: {_short(exc)}"
                   + ("; re-run the same command to resume (files already uploaded are not sent again)"
                      if push else ""), rule="hub-network", path=repo)
    if isinstance(exc, (HfHubHTTPError, _http_module().HTTPError)):
        return cls(f"{what}: the Hub answered {status or 'an error'}: {_short(exc)}", rule="hub-http", path=repo)
    return cls(f"{what}: {type(exc).__name__}: {_short(exc)}", rule="hub-error", path=repo)


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def call(fn: Callable[[], T], *, ref: HubRef | str, what: str, push: bool = False, retry: bool = True) -> T:
    """Run a Hub call; retry transient failures with exponential backoff; map errors to CkptError.

    Only idempotent calls may pass ``retry=True`` (a commit that succeeded but whose answer was
    lost must not be sent twice).
    """
    retries, wait = retry_settings() if retry else (0, 0.0)
    attempt = 0
    while True:
        try:
            return fn()
        except CkptError:
            raise
        except Exception as e:
            if attempt < retries and is_transient(e):
                time.sleep(min(wait * 2**attempt, 8.0))
                attempt += 1
                continue
            raise hub_error(e, ref=ref, what=what, push=push) from e
