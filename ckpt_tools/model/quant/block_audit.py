"""The block-format audit: every weight stored in the checkpoint's block format (FP8 codes with one scale per
tile, ``companions.Codec``) has its scale companion, of the grid its tile gives; such weights are
present exactly when the configuration declares the format's scheme (rules ``fp8-scale-missing``,
``fp8-scale-shape``, ``fp8-block-size``, ``quant-config``).

Whole-checkpoint and header-only, so it also covers stacked experts and tensors no family table names. The
tile is the scheme table's ``block`` parameter as the configuration declares it (``weight_block_size``: the
one reader, ``detect``'s); an explicit ``null`` is one per-tensor scale, as transformers' FineGrainedFP8
reads it (a scalar ``weight_scale_inv``).
"""

from __future__ import annotations

from typing import Any

from ..problem import Problem
from .codec import Codec, config_params
from .tables import get_scheme

BLOCK_SIZE_RULE = "fp8-block-size"


Pairs = tuple[list[tuple[str, Any, str, Any]], frozenset[str]]


def scale_pairs(ckpt: Any, fmt: Codec) -> Pairs:
    """Every weight of ``fmt``'s dtypes as (key, ref, its scale companion's key, the stored scale or None), in the
    checkpoint's order, and the keys of those whose scale is stored. Found once per checkpoint and kept on it (as
    ``detect_scheme`` keeps its answer) while its tensors stay the same object: the trunk audit, the fp8 rule and
    the block fit each ask (a release has 45,808 such weights)."""
    tensors = ckpt.tensors
    at = (id(tensors), len(tensors), fmt.weight_dtypes, fmt.scale_suffix)
    memo = getattr(ckpt, "_scale_pairs", None)
    if memo is not None and memo[0] == at:
        return memo[1]
    stored, suffix, scale_key = fmt.weight_dtypes, fmt.scale_suffix, fmt.scale_key
    keys = [k for k, ref in tensors.items() if ref.dtype in stored]
    skeys = [k[:-6] + suffix if k.endswith(".weight") else scale_key(k) for k in keys]  # Codec.scale_of's key
    srefs = list(map(tensors.get, skeys))
    pairs = list(zip(keys, map(tensors.__getitem__, keys), skeys, srefs, strict=True))
    found = (pairs, frozenset(k for k, sref in zip(keys, srefs, strict=True) if sref is not None))
    try:
        ckpt._scale_pairs = (at, found)
    except AttributeError:  # a checkpoint-like object that keeps no attributes: found again next time
        pass
    return found


def declared_block(ckpt: Any, fmt: Codec) -> tuple[tuple[int, int] | None, bool, Any]:
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


def block_problems(ckpt: Any, fmt: Codec, unknown: set[str], cfg: str | None) -> list[Problem]:
    """Every weight of ``fmt``'s dtypes has its scale, of the tile's grid; such weights <=> the scheme declared."""
    out: list[Problem] = []
    pairs = scale_pairs(ckpt, fmt)[0]
    fp8 = [k for k, *_ in pairs]
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
    found: list[tuple[str, Problem]] = []
    grids: dict[tuple[int, ...], Any] = {}  # weight shape -> its scale grid (a release has a few dozen shapes)
    for k, ref, skey, sref in pairs:
        if sref is None:
            if skey not in unknown:
                found.append((k, Problem("fp8-scale-missing", ref.file, k, f"{ref.dtype} weight without its {skey}")))
            continue
        if block is None:
            want = None if sref.shape in ((), (1,), (1, 1)) else "[] (one per-tensor scale)"
        elif (want_shape := grids[ref.shape] if ref.shape in grids else grids.setdefault(
                ref.shape, fmt.scale_of(k, ref.shape, {}, block)[1])) is None:
            continue
        else:
            want = None if sref.shape == want_shape else (f"{list(want_shape)} (block {block[0]}x{block[1]} over "
                                                          f"{list(ref.shape)})")
        if want is not None:
            found.append((k, Problem("fp8-scale-shape", sref.file, skey, f"shape {list(sref.shape)}, expected {want}")))
    shape_problems = [p for _, p in found if p.rule == "fp8-scale-shape"]
    if shape_problems and cfg is not None:
        wrong = misdeclared_block(ckpt, fmt)
        if wrong is not None:  # one fault, in the configuration: said once, with its repair
            first = min(shape_problems, key=lambda p: p.key or "")
            out.append(Problem(BLOCK_SIZE_RULE, cfg, None, f"{block_advice(ckpt, wrong)} ({len(shape_problems)} "
                               f"scale(s) disagree with {list(wrong[0])}, e.g. {first.key}: {first.message})"))
            found = [(k, p) for k, p in found if p.rule != "fp8-scale-shape"]
    return out + [p for _, p in sorted(found, key=lambda kp: kp[0])]


# -- a declared block no stored scale grid has, while all have one other: the configuration is wrong ------------------


def _axis_range(n: int, g: int) -> tuple[int, float]:
    """The tile sizes b with ceil(n / b) == g: [ceil(n / g), ceil(n / (g - 1)) - 1] (g == 1: b >= n)."""
    if g <= 0 or n <= 0:
        return 1, 0  # empty
    return -(-n // g), (float("inf") if g == 1 else -(-n // (g - 1)) - 1)


def _pick(lo: int, hi: float, default: int) -> int | None:
    """The tile size in [lo, hi]: the format's own when it is in range, else the one power of two in range."""
    if lo <= default <= hi:
        return default
    powers = [2**k for k in range(31) if lo <= 2**k <= hi]
    return powers[0] if len(powers) == 1 else None


def fitting_block(ckpt: Any, fmt: Codec, declared: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """The one tile every stored scale grid of ``fmt``'s weights is the grid of (each scale [..., gr, gc] of a
    [..., rows, cols] weight: ceil(rows / b0) == gr and ceil(cols / b1) == gc); None when no tile fits them all,
    when several do (the format's own tile first, else a power of two), or when ``declared`` fits them all."""
    seen: set[tuple] = set()
    lo0, hi0, lo1, hi1 = 1, float("inf"), 1, float("inf")
    for _, ref, _, sref in scale_pairs(ckpt, fmt)[0]:
        if sref is None or len(ref.shape) < 2:
            continue
        pair = (tuple(ref.shape), tuple(sref.shape))
        if pair in seen:
            continue
        seen.add(pair)
        if len(sref.shape) != len(ref.shape) or sref.shape[:-2] != ref.shape[:-2]:
            return None  # not a block grid (a per-tensor scale, a stacked scale of other lead dims)
        a0, b0 = _axis_range(ref.shape[-2], sref.shape[-2])
        a1, b1 = _axis_range(ref.shape[-1], sref.shape[-1])
        lo0, hi0, lo1, hi1 = max(lo0, a0), min(hi0, b0), max(lo1, a1), min(hi1, b1)
        if lo0 > hi0 or lo1 > hi1:
            return None
    if not seen or (declared is not None and lo0 <= declared[0] <= hi0 and lo1 <= declared[1] <= hi1):
        return None
    own = _table_block(fmt) or fmt.block  # the table's tile: what releases of this format use
    rows, cols = _pick(lo0, hi0, own[0]), _pick(lo1, hi1, own[1])
    return None if rows is None or cols is None else (rows, cols)


def _block_param(fmt: Codec):
    """The scheme table's ``block`` parameter (its configuration keys and default), or None."""
    return next((p for d in get_scheme(fmt.scheme).declared_in for name, p in d.params.items() if name == "block"),
                None)


def _table_block(fmt: Codec) -> tuple[int, int] | None:
    p = _block_param(fmt)
    d = p.default if p is not None else None
    return (int(d[0]), int(d[1])) if isinstance(d, list) and len(d) == 2 else None


def misdeclared_block(ckpt: Any, fmt: Codec) -> tuple[tuple[int, int], tuple[int, int], str] | None:
    """(the declared tile, the tile every stored scale grid has, the configuration key that declares it) when the
    configuration declares a tile some stored scale grid disagrees with and all agree with one other."""
    block, declared, malformed = declared_block(ckpt, fmt)
    if not declared or block is None or malformed is not None:
        return None
    fitting = fitting_block(ckpt, fmt, block)
    if fitting is None or fitting == block:
        return None
    p = _block_param(fmt)
    return block, fitting, (p.keys[0] if p is not None and p.keys else "block")


def block_advice(ckpt: Any, wrong: tuple[tuple[int, int], tuple[int, int], str]) -> str:
    """What to do about a misdeclared block (``misdeclared_block``): the configuration is wrong, not the scales."""
    block, fitting, key = wrong
    return (f"the configuration's {key} {list(block)} is wrong: every stored scale grid is that of block "
            f"{list(fitting)} (rule {BLOCK_SIZE_RULE}); `ckpt validate --fix-quant-config {ckpt.root} -o OUT` sets "
            f"{key} to {list(fitting)}")
