"""`ckpt diff`: two checkpoints compared, tensors, config and side files."""
