"""One MTP that probe measures: the table engine's, and transformers' MtpModel of the same tensors where one loads.

Its own module because both probe.py (the verifier's MTP and each --draft) and mtp_quant.py (the verifier's MTP in
each storage scheme) make them: neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Drafter:
    """One MTP measured by probe: the engine's, and transformers' MtpModel of the same tensors where it loads."""

    name: str
    engine: Any
    reference: Any = None
