"""A rule broken by a checkpoint: what every check returns, validate reports and the gate refuses on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    rule: str
    path: str | None  # the file the problem is in
    key: str | None  # the tensor key, when the problem concerns one
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        key = f"{self.key}: " if self.key else ""
        return f"{where}[{self.rule}] {key}{self.message}"

    def to_json(self) -> dict:
        return {"rule": self.rule, "path": self.path, "key": self.key, "message": self.message}
