"""The block FP8 codec's encoder (DeepSeek style), the one thing that writes block FP8: values -> F8_E4M3 codes
and one scale per ``br x bc`` tile (edge tiles partial), the scale named by the scheme table. Per block::

    s = max(float32(amax / 448), 2**-126)     (a true division; zero and tiny blocks get 2**-126)
    Q = e4m3_rne(clamp(W / s, -448, 448))      (NaN / Inf inputs raise)

With ``s = fl(amax / 448)`` (not transformers' ``1 / (448 / amax)``) the round trip through the decoder
(``W = float32(Q) * s``) is a fixed point byte for byte (tests/test_fp8.py checks a whole binade): the codec
``keeps_bytes``. ``requantize`` plans the codes and the grid as two recipes that read the values in bands
of one block row (``stream``; ``encode`` runs it over a matrix in memory). ``pow2``: scales rounded up to
powers of two (``scale_fmt: ue8m0``), or stored as F8_E8M0 exponents. torch is imported in the functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ...arrays import bytes_to_torch, torch_threads
from ...dtypes import DTYPES, FLOAT_DTYPES
from ...errors import InputError, PlanError
from ...numeric.transforms import RecipeReader, inputs_of, recipe_bytes
from ...stream.plan import Compute, OutputTensor
from .encode_core import EncodeArgs

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0  # largest finite e4m3fn value
FLT_MIN = 2.0**-126  # smallest normal float32: floor of every block scale (all-zero blocks included)


def block_scales(x: torch.Tensor, block: tuple[int, int], *, pow2: bool = False, where: str = "input",
                 path: str | None = None) -> torch.Tensor:
    """The scale grid ``[..., ceil(rows/br), ceil(cols/bc)]`` of float32 values ``[..., rows, cols]``.

    ``where`` / ``path`` name the values in the error a NaN or Inf raises."""
    import torch

    amax = _block_amax(x, *block)
    if not bool(torch.isfinite(amax).all()):
        bad = (~torch.isfinite(amax)).nonzero()[0].tolist()
        raise InputError(f"{where} holds NaN or Inf (block {bad}); FP8 quantization needs finite values",
                         rule="fp8-nonfinite", path=path)
    s = amax / FP8_MAX  # float32 division, correctly rounded: the fixed-point property needs exactly this
    s.clamp_(min=FLT_MIN)
    if pow2:  # rounded up to a power of two, as DeepSeek's ue8m0 quantizer does: 2 ** ceil(log2(s))
        mant, exp = torch.frexp(s)
        s = torch.where(mant == 0.5, s, torch.ldexp(torch.ones_like(s), exp))
    return s


def quantize_with(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 codes of float32 values ``x`` with their scale grid (from ``block_scales``); ``x`` is
    divided in place (scratch)."""
    br, bc = block
    _apply_row_blocks(x, scale.repeat_interleave(bc, dim=-1)[..., : x.shape[-1]], br, _div)
    return _to_e4m3(x)


def _div(t: torch.Tensor, f: torch.Tensor) -> None:
    t.div_(f)


def _block_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """[..., rows, cols] -> [..., ceil(rows/br), ceil(cols/bc)] max |x| (NaN propagates)."""
    import torch

    def reduce(t: torch.Tensor, dim: int, b: int) -> torch.Tensor:
        n = t.shape[dim]
        if n == 0 or t.numel() == 0:  # empty weights have an empty grid
            shape = list(t.shape)
            shape[dim] = -(-n // b)
            return t.new_zeros(shape)
        full = n // b
        parts = []
        if full:
            parts.append(t.narrow(dim, 0, full * b).unflatten(dim, (full, b)).amax(dim=dim + 1 if dim >= 0 else dim))
        if n % b:
            parts.append(t.narrow(dim, full * b, n - full * b).amax(dim=dim, keepdim=True))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    a = x.abs()
    return reduce(reduce(a, -1, bc), -2, br)


def _apply_row_blocks(x: torch.Tensor, per_col: torch.Tensor, br: int, op: Callable) -> None:
    """``op(x_rows, factor)`` in place on [..., rows, cols] with per-row-block factors [..., g, cols]."""
    rows = x.shape[-2]
    full = rows // br
    if full:
        op(x[..., : full * br, :].unflatten(-2, (full, br)), per_col[..., :full, None, :])
    if rows % br:
        op(x[..., full * br :, :], per_col[..., full : full + 1, :])


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round to nearest even e4m3fn, saturating at +-448 (explicit: torch versions differ above 448)."""
    import torch

    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def requantize(t: OutputTensor, block: tuple[int, int], scale_key: str, pow2: bool = False,
               scale_dtype: str = "F32") -> tuple[OutputTensor, OutputTensor]:
    """Block-FP8 quantization of ``t``: the F8_E4M3 weight and its scale grid ``scale_key`` (F32, or F8_E8M0:
    the biased exponents of power-of-two scales, ``pow2`` required), this codec's streamed encoder.

    The two recipes share one ``_ScaleGrid``: the grid is computed once, by whichever recipe runs
    first (the writer puts F32 scales before F8 weights in a shard), and the weights are then divided
    by it. Both walk ``t`` in bands of one block row (of one matrix of a stack), so memory stays at
    one band and the grid (one float per block).
    """
    if t.dtype not in FLOAT_DTYPES or len(t.shape) < 2:
        raise PlanError(f"{t.key}: cannot quantize {t.dtype} {list(t.shape)} to FP8", rule="fp8-dtype")
    *lead_dims, rows, cols = t.shape
    grid = (*lead_dims, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    shared = _ScaleGrid(t, block, pow2)

    def weights():
        with torch_threads(load=True):  # one thread for the whole recipe (not switched per band)
            for values, scale in shared.bands():
                yield quantize_with(values, scale, block)

    if scale_dtype not in ("F32", "F8_E8M0") or (scale_dtype == "F8_E8M0" and not pow2):
        raise PlanError(f"{t.key}: block scales are written as F32, or F8_E8M0 when powers of two; not {scale_dtype}",
                        rule="quant-encode")

    def scales():
        g = shared.grid()
        if scale_dtype == "F8_E8M0":  # a power of two 2**(e - 127) is its float32 biased exponent e: the E8M0 byte
            import torch

            g = ((g.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        yield g

    meta = dict(t.meta, quantized={"block": list(block), **({"scale_fmt": "ue8m0"} if pow2 else {})})
    w = OutputTensor(t.key, "F8_E4M3", t.shape, Compute(weights, "quantize", inputs_of(t)), t.shard, meta)
    s = OutputTensor(scale_key, scale_dtype, grid, Compute(scales, "quantize-scale", inputs_of(t)), t.shard,
                     {"role": "scale", "source": inputs_of(t)})
    return w, s


class _ScaleGrid:
    """The block scales of one tensor being re-quantized, shared by its weight and scale recipes.

    The first pass over the values (either recipe's) computes each block row's scales and keeps
    them; the other recipe reuses them, so a block's amax is taken once per run and the weights are
    divided by exactly the scales written. Held until both recipes have their bytes, then dropped
    (a recipe run again recomputes it: the same bytes).
    """

    def __init__(self, src: OutputTensor, block: tuple[int, int], pow2: bool) -> None:
        self.src, self.block, self.pow2 = src, block, pow2
        self._grid = None  # float32 [lead, gr, gc] once a pass has completed
        self._served: set[str] = set()

    def bands(self):
        """The weight recipe's pass: (float32 values [n, cols], their scale row [1, gc]) per block row,
        in C order. The values are scratch (the consumer divides them in place)."""
        yield from self._pass()
        self._serve("weights")

    def grid(self):
        """The scale recipe's bytes: the whole grid, float32 ``[*lead, gr, gc]`` (an amax-only pass when
        the weights have not run yet)."""
        if self._grid is None:
            for _ in self._pass():
                pass
        grid = self._grid
        self._serve("scales")
        return grid.reshape(*self.src.shape[:-2], *grid.shape[-2:])

    def _pass(self):
        import torch

        *lead_dims, rows, cols = self.src.shape
        (br, bc), lead = self.block, math.prod(lead_dims)
        known, computed = self._grid, []
        reader = RecipeReader(self.src.recipe)
        item = DTYPES[self.src.dtype].nbytes(1)
        with torch_threads(load=True):  # one thread for the whole pass (not switched per band)
            for li in range(lead):
                for r in range(0, rows, br):
                    n = min(br, rows - r)
                    values = bytes_to_torch(reader.read(n * cols * item), self.src.dtype, (n, cols)).float()
                    if known is not None:
                        scale = known[li, r // br : r // br + 1]
                    else:
                        where = f"{self.src.key} ({f'matrix {li}, ' if lead_dims else ''}rows {r}..{r + n})"
                        scale = block_scales(values, self.block, pow2=self.pow2, where=where)
                        computed.append(scale)
                    yield values, scale
        if known is None:
            gc = math.ceil(cols / bc)
            self._grid = (torch.cat(computed) if computed else torch.empty((0, gc))).reshape(lead, -(-rows // br), gc)

    def _serve(self, recipe: str) -> None:
        self._served.add(recipe)
        if len(self._served) == 2:  # both recipes have their bytes: nothing asks again within this run
            self._grid, self._served = None, set()


def _block(args: EncodeArgs) -> tuple[int, int]:
    block = args.params.get("block")
    if not block:
        raise PlanError("block FP8 without a block (weight_block_size null: one per-tensor scale) has no encoder",
                        rule="quant-encode")
    return int(block[0]), int(block[1])


def _scale_suffix(args: EncodeArgs) -> str:
    """The scale companion's name, from the scheme table (``weight_scale_inv``, DeepSeek-V4's ``scale``)."""
    if "scale" not in args.suffixes:
        raise PlanError("the block FP8 encoder needs the table's scale suffix (EncodeArgs.suffixes)",
                        rule="quant-encode")
    return args.suffixes["scale"]


def _block_scale_dtype(args: EncodeArgs) -> str:
    """F32 scales, or F8_E8M0 where the reference stores them so (powers of two, which E8M0 holds exactly)."""
    return "F8_E8M0" if args.dtypes.get(_scale_suffix(args)) == "F8_E8M0" else "F32"


def layout(shape: tuple[int, int], args: EncodeArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    br, bc = _block(args)
    return {args.suffixes.get("weight", "weight"): ("F8_E4M3", shape),
            _scale_suffix(args): (_block_scale_dtype(args), (-(-shape[0] // br), -(-shape[1] // bc)))}


def stream(values: OutputTensor, args: EncodeArgs, keys: Mapping[str, str]) -> dict[str, OutputTensor]:
    """DeepSeek block FP8, streamed: ``requantize`` (F32 ``amax / 448`` per block, e4m3 codes,
    the round trip through the decoder a fixed point), its scale named by the table (``keys``: suffix -> key);
    powers of two under ``scale_fmt: ue8m0`` or F8_E8M0 scales."""
    wsfx, ssfx = args.suffixes.get("weight", "weight"), _scale_suffix(args)
    e8m0 = _block_scale_dtype(args) == "F8_E8M0"
    pow2 = e8m0 or str(args.params.get("scale_fmt") or "").lower() == "ue8m0"
    w, s = requantize(values, _block(args), keys[ssfx], pow2, "F8_E8M0" if e8m0 else "F32")
    w.key = keys[wsfx]
    return {wsfx: w, ssfx: s}


def encode(values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """``stream`` over one in-memory matrix (its outputs read back as tensors)."""
    return run_stream(stream, layout, values, args)


def run_stream(stream, layout, values: torch.Tensor, args: EncodeArgs) -> dict[str, torch.Tensor]:
    """A streamed encoder run over an in-memory matrix: the same recipes, their bytes read back as tensors (the one
    implementation serves both: nothing encodes block FP8 another way)."""
    from ...dtypes import from_torch

    src = OutputTensor("values", from_torch(values.dtype), tuple(values.shape),
                       Compute(lambda: iter([values.contiguous()]), "values", []))
    outs = stream(src, args, {sfx: sfx for sfx in layout((int(values.shape[-2]), int(values.shape[-1])), args)})
    return {sfx: bytes_to_torch(bytearray(b"".join(recipe_bytes(t.recipe, max(t.nbytes, 1)))), t.dtype,
                                tuple(t.shape)) for sfx, t in outs.items()}
