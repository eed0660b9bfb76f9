"""The canonical roles of the glue tensors of an MTP layer (design.md section 2), shared by the table schema and
the code that reads tables (importable without the schema's validator)."""

GLUE_ROLES = (
    "embed_norm",  # norm on the token embedding
    "hidden_norm",  # norm on the previous hidden state
    "fusion",  # [H, 2H] projection of the concatenated pair
    "fusion_embed",  # [H, H] embedding half, for families with two projections
    "fusion_hidden",  # [H, H] hidden half
    "final_norm",  # norm before the (shared or own) head
    "embed",  # per-layer copy of the token embedding
    "head",  # per-layer copy (or own) LM head
)
