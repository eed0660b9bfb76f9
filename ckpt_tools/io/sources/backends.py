"""fsspec URL -> filesystem, with each backend an optional extra, and backend errors -> InputError.

Credentials come only from the backends' own chains (environment, profiles, instance metadata):
nothing here takes, prints or stores one. Error messages name the URL, never a secret.
"""

from __future__ import annotations

from ...errors import CkptError, InputError, UsageError

# protocol -> (module the backend needs, extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"),
}


class MissingExtra(UsageError):
    """The URL's backend is not installed (exit 2: the environment, not the input, needs changing)."""


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def filesystem(url: str, **options):
    """(fsspec filesystem, path inside it) for ``url`` (``options`` go to the backend); MissingExtra names
    the extra to install."""
    proto = protocol_of(url)
    need = EXTRAS.get(proto)
    try:
        if need is not None:
            __import__(need[0])
        from fsspec.core import url_to_fs

        # a filesystem of its own: the environment (endpoint, credentials) as it is now
        return url_to_fs(url, **{"skip_instance_cache": True, **options})
    except ImportError as e:
        extra = need[1] if need else None
        hint = f"pip install 'ckpt-tools[{extra}]'" if extra else f"install the fsspec backend for {proto}://"
        raise MissingExtra(f"{proto}:// needs {need[0] if need else 'a backend'} ({e.name or e}): {hint}",
                           rule="missing-extra", path=url) from None
    except ValueError as e:  # fsspec: "Protocol not known"
        raise UsageError(f"{e}", rule="unknown-protocol", path=url) from None


def read_error(exc: BaseException, url: str, what: str) -> CkptError:
    """A backend's exception while reading ``url`` -> InputError (exit 3) naming the URL and a rule."""
    if isinstance(exc, CkptError):
        return exc
    text = " ".join(str(exc).split())[:300]
    if isinstance(exc, FileNotFoundError):
        return InputError(f"{what}: not found (no such bucket, container or object): {text}",
                          rule="remote-not-found", path=url)
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "403" in text:
        return InputError(f"{what}: permission denied; check the credentials the backend finds (environment, "
                          f"profile, instance role): {text}", rule="remote-forbidden", path=url)
    return InputError(f"{what}: network failure or server error: {type(exc).__name__}: {text}",
                      rule="remote-network", path=url)
