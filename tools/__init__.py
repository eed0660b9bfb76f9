"""Development tools that keep the repository's generated files true (not shipped in the wheel)."""
