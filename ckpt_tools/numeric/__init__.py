"""Numeric formats: FP8 block quantization, transforms of tensor values, initial values."""
