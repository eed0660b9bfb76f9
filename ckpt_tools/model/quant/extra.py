"""The optional ``[quant]`` extra (compressed-tensors), imported only where a verb needs the library.

The decoders and checks of this package are numpy-only and need nothing beyond the core install;
code that calls compressed-tensors itself (its converters, its own decompression) goes through
``compressed_tensors()``, so a missing extra is one clear error naming it.
"""

from __future__ import annotations

from types import ModuleType

from ...errors import UsageError

EXTRA = "ckpt-tools[quant]"


def compressed_tensors(what: str = "this command") -> ModuleType:
    """The compressed_tensors module, or a UsageError naming the extra that installs it."""
    try:
        import compressed_tensors
    except ImportError as e:
        raise UsageError(f"{what} needs compressed-tensors, which is not installed ({e.msg}); "
                         f"install the extra: pip install '{EXTRA}'", rule="missing-extra") from None
    return compressed_tensors
