"""`ckpt dequant`, `ckpt fuse-experts` / `unfuse-experts` and `ckpt validate --fix-quant-config`: one checkpoint
rewritten in another representation."""
