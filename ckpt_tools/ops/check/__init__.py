"""`ckpt validate` and `ckpt verify-manifest`: a shared room, because every writing verb validates its output before
its index appears and push validates what it publishes."""
