"""The rules a module's declared quantization arguments are judged by (storage._check; docs/integrity.md).

A tensor the arguments exclude or require (by its role), scale tiles that must divide the columns, an argument the
consumers refuse. Kept apart from the table schema so that a run reading cached tables never imports pydantic.
"""

ARG_RULES = ("quant-zero-point", "quant-group-size", "quant-actorder")
ROLE_RULES = {"zero_point": "quant-zero-point", "g_idx": "quant-actorder"}
