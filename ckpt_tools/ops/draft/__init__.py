"""`ckpt extract` and `ckpt init-draft`: a draft built from a verifier's MTP layers, or the trunk alone."""
