"""`ckpt stitch` and `ckpt graft`: MTP tensors written into a verifier, in its names, layout and dtypes."""
