"""`ckpt inspect` (with `--discover`) and `ckpt tables`: what a checkpoint or a table holds."""
