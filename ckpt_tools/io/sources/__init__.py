"""Remote sources: the Hub and every fsspec filesystem as stores of files read by byte ranges.

This layer sits below ``checkpoint``: it knows files, sizes and bytes, never tensors or models,
and imports nothing above ``safetensors_io`` / ``hub`` (a test checks the import graph).
"""

from .backends import EXTRAS, MissingExtra, filesystem
from .ranges import FsFile, coalesce_ranges
from .stats import DOWNLOADS, transfer_summary
from .store import FsStore, is_url, open_store

__all__ = ["DOWNLOADS", "EXTRAS", "FsFile", "FsStore", "MissingExtra", "coalesce_ranges", "filesystem", "is_url",
           "open_store", "transfer_summary"]
