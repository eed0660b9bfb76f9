"""What a checkpoint means: tables, MTP layouts, draft formats, experts, quantization schemes."""
