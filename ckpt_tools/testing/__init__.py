"""Tiny, structurally faithful checkpoints for tests, demos and benchmarks."""

from .fixtures import FixtureOptions, fixture_config, make_checkpoint, natural_key

__all__ = ["FixtureOptions", "fixture_config", "make_checkpoint", "natural_key"]
