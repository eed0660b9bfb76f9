"""The dtypes safetensors knows: name, size in bits and writer order.

The order of ``DTYPES`` is the order of safetensors' ``Dtype`` enum. Its writer
places tensors by descending dtype (then by name), which keeps every tensor aligned
for its element size; our writer uses the same rule so that outputs match
``safetensors.save_file`` byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str
    bits: int
    rank: int  # position in safetensors' Dtype enum
    torch_name: str | None  # attribute of the torch module, when torch has it

    def nbytes(self, numel: int) -> int:
        """Byte size of ``numel`` elements; the caller checks byte alignment for sub-byte types."""
        return numel * self.bits // 8


_ENUM = [
    ("BOOL", 8, "bool"),
    ("F4", 4, None),
    ("F6_E2M3", 6, None),
    ("F6_E3M2", 6, None),
    ("U8", 8, "uint8"),
    ("I8", 8, "int8"),
    ("F8_E5M2", 8, "float8_e5m2"),
    ("F8_E4M3", 8, "float8_e4m3fn"),
    ("F8_E8M0", 8, "float8_e8m0fnu"),
    ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
    ("I16", 16, "int16"),
    ("U16", 16, "uint16"),
    ("F16", 16, "float16"),
    ("BF16", 16, "bfloat16"),
    ("I32", 32, "int32"),
    ("U32", 32, "uint32"),
    ("F32", 32, "float32"),
    ("C64", 64, "complex64"),
    ("F64", 64, "float64"),
    ("I64", 64, "int64"),
    ("U64", 64, "uint64"),
]

DTYPES: dict[str, DType] = {name: DType(name, bits, rank, tn) for rank, (name, bits, tn) in enumerate(_ENUM)}

FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")  # dtypes of their block scales (weight_scale_inv)

# Spellings users type for --dtype, and the names configs use.
_ALIASES = {
    "bf16": "BF16",
    "bfloat16": "BF16",
    "fp16": "F16",
    "f16": "F16",
    "float16": "F16",
    "half": "F16",
    "fp32": "F32",
    "f32": "F32",
    "float32": "F32",
    "float": "F32",
    "fp64": "F64",
    "float64": "F64",
    "fp8": "F8_E4M3",
    "float8_e4m3fn": "F8_E4M3",
}


def lookup(name: str) -> DType:
    """Return the dtype for a safetensors name or a common alias; KeyError if unknown."""
    key = _ALIASES.get(name.lower(), name) if name not in DTYPES else name
    return DTYPES[key]


def torch_dtype(name: str):
    """The torch dtype for a safetensors dtype name (imports torch lazily)."""
    import torch

    tn = DTYPES[name].torch_name
    if tn is None or not hasattr(torch, tn):
        raise KeyError(f"torch has no dtype for {name}")
    return getattr(torch, tn)


def from_torch(dtype) -> str:
    """The safetensors name of a torch dtype."""
    tn = str(dtype).removeprefix("torch.")
    for d in DTYPES.values():
        if d.torch_name == tn:
            return d.name
    raise KeyError(f"no safetensors dtype for {dtype}")
