"""ckpt-tools: exact, streaming surgery on Hugging Face checkpoints around MTP layers."""

__version__ = "0.1.0"
