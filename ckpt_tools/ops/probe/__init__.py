"""`ckpt probe`: MTP acceptance measured with transformers (our table engine) or vLLM."""
