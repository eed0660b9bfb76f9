"""Plan -> bytes: the output plan, the writer that executes it, and its output targets."""
