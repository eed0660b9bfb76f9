"""What reads bytes: safetensors headers and ranges, checkpoints, trainer formats, remote stores."""
