"""The block-format audit: every weight stored in the checkpoint's block format (FP8 codes with one scale per
tile, ``companions.WeightFormat``) has its scale companion, of the grid its tile gives; such weights are
present exactly when the configuration declares the format's scheme (rules ``fp8-scale-missing``,
``fp8-scale-shape``, ``fp8-block-size``, ``quant-config``).

Whole-checkpoint and header-only, so it also covers stacked experts and tensors no family table names. The
tile is the scheme table's ``block`` parameter as the configuration declares it (``weight_block_size``: the
one reader, ``detect``'s); an explicit ``null`` is one per-tensor scale, as transformers' FineGrainedFP8
reads it (a scalar ``weight_scale_inv``).
"""

from __future__ import annotations

from typing import Any

from ..expert_layouts import scale_key, scale_shape
from ..problem import Problem
from .companions import WeightFormat, config_params
from .tables import get_scheme

BLOCK_SIZE_RULE = "fp8-block-size"

def declared_block(ckpt: Any, fmt: WeightFormat) -> tuple[tuple[int, int] | None, bool, Any]:
    """(the tile the configuration declares for ``fmt``'s scheme - None: one per-tensor scale -, whether the
    configuration declares that scheme at all, the declared value when it is no tile: the format's own tile is
    used for the scale checks then, and the value is a problem of its own); undeclared, the format's tile."""
    params = config_params(get_scheme(fmt.scheme), ckpt)
    if params is None:
        return fmt.block, False, None
    b = params.get("block")
    if b is None:
        return None, True, None
    ok = isinstance(b, (list, tuple)) and len(b) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in b)
    return ((int(b[0]), int(b[1])), True, None) if ok else (fmt.block, True, b)


def block_problems(ckpt: Any, fmt: WeightFormat, unknown: set[str], cfg: str | None) -> list[Problem]:
    """Every weight of ``fmt``'s dtypes has its scale, of the tile's grid; such weights <=> the scheme declared."""
    out: list[Problem] = []
    stored = fmt.weight_dtypes  # what fmt.stores accepts, without a call per tensor
    fp8 = [k for k, r in ckpt.tensors.items() if r.dtype in stored]
    qc = ckpt.config.get("quantization_config") if cfg else None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    block, declared, malformed = declared_block(ckpt, fmt) if cfg else (fmt.block, False, None)
    if malformed is not None:  # a loader would misread every scale grid: refused, not guessed
        out.append(Problem(BLOCK_SIZE_RULE, cfg, None, f"the block the configuration declares ({malformed!r}) is not "
                           "two positive integers [rows, cols] (or null: one per-tensor scale)"))
    if cfg is not None:
        if method is None and ckpt.local_dir is not None and (ckpt.local_dir / "hf_quant_config.json").is_file():
            return out  # declared in ModelOpt's side file, with its own scale names (quant scheme tables)
        if fp8 and method is None:
            out.append(Problem("quant-config", cfg, min(fp8),
                               f"{len(fp8)} FP8 tensor(s) (e.g. this one) but config.json has no quantization_config "
                               f"declaring {get_scheme(fmt.scheme).title}; loaders would read the FP8 bytes as the "
                               "model dtype"))
        elif declared and not fp8 and not unknown:
            out.append(Problem("quant-config", cfg, None,
                               f"quantization_config says quant_method {method!r} but no tensor is FP8; remove "
                               "quantization_config"))
        if method is not None and not declared:
            return out  # another scheme (compressed-tensors, fbgemm_fp8, ...) names its scales its own way
    suffix = fmt.scale_suffix
    grids: dict[tuple[int, ...], tuple[int, ...]] = {}  # weight shape -> scale shape (few distinct shapes)
    tensors = ckpt.tensors
    found: list[tuple[str, Problem]] = []
    for k in fp8:
        # scale_key's common case inlined: tens of thousands of weights in a large FP8 release
        skey = k[:-6] + suffix if k.endswith(".weight") else scale_key(k, suffix)
        ref = tensors[k]
        sref = tensors.get(skey)
        if sref is None:
            if skey not in unknown:
                found.append((k, Problem("fp8-scale-missing", ref.file, k, f"{ref.dtype} weight without its {skey}")))
            continue
        if block is None:
            want = None if sref.shape in ((), (1,), (1, 1)) else "[] (one per-tensor scale)"
        elif len(ref.shape) < 2:
            continue  # block scales are defined for matrices (and stacks of them) only
        else:
            want_shape = grids.get(ref.shape) or grids.setdefault(ref.shape, scale_shape(ref.shape, block))
            want = None if sref.shape == want_shape else (f"{list(want_shape)} (block {block[0]}x{block[1]} over "
                                                          f"{list(ref.shape)})")
        if want is not None:
            found.append((k, Problem("fp8-scale-shape", sref.file, skey, f"shape {list(sref.shape)}, expected {want}")))
    return out + [p for _, p in sorted(found, key=lambda kp: kp[0])]
