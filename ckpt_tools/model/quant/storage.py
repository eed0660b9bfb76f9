"""How one linear module is stored in a checkpoint (``module_storage``).

Unquantized (a float ``weight``), quantized in one of the scheme tables' storage formats (the
weight tensor, its companions, which are missing or wrong), or absent. The checkpoint's own
scheme is tried first, then every other table, so a module stored in a scheme its configuration
does not declare is still recognised (and reported as such).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from ...dtypes import FLOAT_DTYPES
from ..expr import ExprError, evaluate, names_in
from .arg_rules import ROLE_RULES
from .detect import QuantScheme
from .tables import loaded_schemes

if TYPE_CHECKING:
    from .schema import FormatDef, SchemeTable

StorageState = Literal["unquantized", "quantized", "absent"]


@dataclass
class _Memo:
    """What ``module_storage`` derives from the scheme and the tables alone, once per scheme rather than once
    per module (a release has 46,000 quantized modules)."""

    scheme: QuantScheme | None
    tables: dict[str, SchemeTable]
    own_names: set[str]
    candidates: list[tuple[SchemeTable, FormatDef]]  # the declared scheme's formats first, then every other
    suffixes: tuple[str, ...]  # every tensor name a candidate (or a float weight) may use, after "{module}."
    per_module: bool  # some table's parameters depend on the module's name (several declared groups)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # table -> params, when not per module
    position: dict[str, int] = field(init=False)  # suffix -> its index in ``suffixes``

    def __post_init__(self) -> None:
        self.position = {s: i for i, s in enumerate(self.suffixes)}
    # what the modules stored alike are stored as (see module_storage): their tensors' dtypes and shapes -> Storage
    alike: dict[tuple, Storage] = field(default_factory=dict)


_LAST: list[_Memo] = []


def _scheme_memo(scheme: QuantScheme | None) -> _Memo:
    tables = loaded_schemes()
    if _LAST and _LAST[0].scheme is scheme and _LAST[0].tables is tables:
        return _LAST[0]
    own = scheme.formats() if scheme is not None else []
    own_names = {t.scheme for t, _ in own}
    others = [(t, f) for t in tables.values() if t.scheme not in own_names for f in t.storage]
    candidates = own + others
    suffixes = dict.fromkeys(["weight", *(s for _, f in candidates for s in (f.weight.suffix,
                                                                               *(t.suffix for t in f.tensors)))])
    per_module = scheme is not None and any(
        len({repr(sorted(g.params.items())) for d in scheme.declarations for g in (*d.groups, *d.modules.values())
             if g.table is t}) > 1 for t in scheme.tables)
    _LAST[:] = [_Memo(scheme, tables, own_names, candidates, tuple(suffixes), per_module)]
    return _LAST[0]


@dataclass(frozen=True, slots=True)  # slots: one per quantized module, 46,000 in a release
class Storage:
    """What module ``module`` is stored as."""

    module: str
    state: StorageState
    dtype: str | None = None  # the weight's stored dtype
    scheme: str | None = None  # the table whose format matched (quantized)
    format: str | None = None  # that format's name
    label: str = ""  # e.g. "BF16", "NVFP4 (e2m1, F8_E4M3 scales per 16, global scale)"
    tensors: Mapping[str, str] = field(default_factory=dict)  # suffix -> key, of the tensors present
    missing: tuple[str, ...] = ()  # keys of required companions that are absent
    problems: tuple[str, ...] = ()  # present companions with the wrong dtype or shape
    shape: tuple[int, ...] | None = None  # the logical weight [..., out, in]
    params: Mapping[str, Any] = field(default_factory=dict)
    # (rule, message): what the module's declared arguments make wrong (schema.ARG_RULES): a zero point a symmetric
    # scheme never reads, a group that does not divide the columns, an activation order the consumers refuse.
    # Decoding refuses such a module (the consumers read it differently, or not at all).
    issues: tuple[tuple[str, str], ...] = ()

    @property
    def quantized(self) -> bool:
        return self.state == "quantized"

    @property
    def complete(self) -> bool:
        return not (self.missing or self.problems)

    def all_keys(self) -> list[str]:
        """Every tensor the module is stored as (weight first)."""
        return list(self.tensors.values())


def _params(scheme: QuantScheme | None, table: SchemeTable, module: str, fused,
            memo: _Memo | None = None) -> dict[str, Any]:
    memo = memo or _scheme_memo(scheme)
    if table.scheme in memo.params:
        return dict(memo.params[table.scheme])
    defaults = {name: p.default for d in table.declared_in for name, p in d.params.items()}
    if scheme is None or table.scheme not in {t.scheme for t in scheme.tables}:
        memo.params[table.scheme] = defaults
        return dict(defaults)
    groups = [g for d in scheme.declarations for g in (*d.groups, *d.modules.values()) if g.table is table]
    if len({repr(sorted(g.params.items())) for g in groups}) == 1:
        memo.params[table.scheme] = {**defaults, **groups[0].params}  # one parameter set: the same for every module
        return dict(memo.params[table.scheme])
    from .declared import declaration

    group = declaration(scheme, None, module, fused).group
    if group is not None and group.table.scheme == table.scheme:
        return {**defaults, **group.params}
    return {**defaults, **scheme.default_params(table)}


def params_for(scheme: QuantScheme | None, table: SchemeTable, module: str, fused=None) -> dict[str, Any]:
    """The parameters ``scheme`` declares ``table`` with for ``module`` (the table's defaults otherwise)."""
    return _params(scheme, table, module, fused)


def _applies(fmt: FormatDef, params: Mapping[str, Any]) -> bool:
    if fmt.when is None:
        return True
    try:
        return bool(evaluate(fmt.when, dict(params)))
    except ExprError:
        return False


def _logical_shape(tensors: Mapping[str, Any], module: str, fmt: FormatDef, wref: Any,
                   shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """[..., out, in]: given, else from a ``shape`` companion (compressed-tensors weight_shape), else
    the stored shape with its packed last axis unpacked."""
    if shape is not None:
        return tuple(shape)
    for t in fmt.tensors:
        ref = tensors.get(f"{module}.{t.suffix}")
        if t.role == "shape" and ref is not None and ref.dtype in ("I64", "I32") and ref.numel == len(wref.shape):
            values = [int(v) for v in ref.numpy().reshape(-1)]
            if all(v >= 0 for v in values):
                return tuple(values)
    *lead, cols = wref.shape or (0,)
    return (*lead, cols * fmt.weight.pack)


def scale_tile(fmt: FormatDef, shape: tuple[int, ...], params: Mapping[str, Any]) -> tuple[int, int]:
    """[rows, cols] of one scale tile of a logical weight ``shape`` [..., out, in] (the table's granularity)."""
    *_, out, cols = shape
    tile = evaluate(fmt.decoder.scale.granularity, {**params, "rows": out, "cols": cols})
    if not (isinstance(tile, (list, tuple)) and len(tile) == 2 and all(isinstance(x, int) and x > 0 for x in tile)):
        raise ExprError(f"granularity {fmt.decoder.scale.granularity!r} gave {tile!r}, not two positive integers")
    return int(tile[0]), int(tile[1])


def scale_grid(fmt: FormatDef, shape: tuple[int, ...], params: Mapping[str, Any]) -> tuple[int, ...]:
    """The scale tensor's shape for a logical weight ``shape`` [..., out, in] (lead dims kept)."""
    *lead, out, cols = shape
    tile = scale_tile(fmt, shape, params)
    return (*lead, -(-out // tile[0]), -(-cols // tile[1]))


def scale_shapes(fmt: FormatDef, grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every shape a scale of ``grid`` [..., gr, gc] may be stored as, the canonical one first: exactly the grid
    (channel [rows, 1], group [rows, cols / g], block [ceil(rows / b), ceil(cols / b)]); one scale per matrix
    also as [..., 1] or [...] ([1] or [] alone); with the table's ``row_vector``, a per-row scale as [..., rows]
    (ModelOpt per-channel). Nothing else: a transposed [1, rows] is another tensor to every loader."""
    *lead, gr, gc = grid
    lead = tuple(lead)
    out = [tuple(grid)]
    if gr == 1 and gc == 1:
        out += [(*lead, 1), lead]
    elif gc == 1 and fmt.decoder.scale.row_vector:
        out.append((*lead, gr))
    return list(dict.fromkeys(out))


def _shapes_text(shapes: list[tuple[int, ...]]) -> str:
    return " or ".join(str(list(s)) for s in shapes)


def _tile_text(tile: tuple[int, int], shape: tuple[int, ...]) -> str:
    rows, cols = shape[-2:]
    if tile[0] >= rows and tile[1] >= cols:
        return "one scale per matrix"
    if tile[0] == 1 and tile[1] >= cols:
        return "one scale per row"
    return f"one scale per {tile[0]}x{tile[1]} tile"


def _check(tensors: Mapping[str, Any], module: str, table: SchemeTable, fmt: FormatDef, wref: Any,
           params: Mapping[str, Any], shape: tuple[int, ...] | None) -> Storage:
    present = {fmt.weight.suffix: wref.key}
    missing, problems = [], []
    logical = _logical_shape(tensors, module, fmt, wref, shape)
    want_cols = -(-logical[-1] // fmt.weight.pack) if logical else None
    if logical and (tuple(wref.shape[:-1]) != tuple(logical[:-1]) or wref.shape[-1] != want_cols):
        problems.append(f"{wref.key} has shape {list(wref.shape)}; a {list(logical)} weight packed "
                        f"{fmt.weight.pack} per element is {[*logical[:-1], want_cols]}")
    tile, grid, error = _tile_grid(fmt, logical, params)
    if error is not None:
        problems.append(f"{module}: {error}")
    lead = math.prod(logical[:-2]) if len(logical) > 2 else 1
    issues = _refusals(table, params)
    divides = fmt.decoder.scale.divides
    if tile is not None and divides is not None and holds(divides, params) and logical[-1] % tile[1]:
        issues.append(("quant-group-size", f"{module} has {logical[-1]} columns, which the declared "
                       f"{_args(fmt.decoder.scale.granularity, params)} does not divide into whole {tile[1]}-column "
                       "scale groups: compressed-tensors refuses to decompress a partial last group"))
    for t in fmt.tensors:
        key = f"{module}.{t.suffix}"
        ref = tensors.get(key)
        rule = ROLE_RULES.get(t.role)
        if not holds(t.when, params):
            if ref is not None:  # part of the module all the same (copied with it), but never read
                present[t.suffix] = key
                text = (f"{key} is present, but the module is declared with {_args(t.when, params)}, under which "
                        f"the scheme stores no {t.suffix} (when: {t.when}) and its consumers never read one")
                if rule is not None:
                    issues.append((rule, text))
                else:
                    problems.append(text)
            continue
        if ref is None:
            if not t.optional and rule is not None and t.when is not None:
                issues.append((rule, f"{key} is missing: the module is declared with {_args(t.when, params)}, "
                                     f"which needs it (when: {t.when})"))
            elif not t.optional:
                missing.append(key)
            continue
        present[t.suffix] = key
        wrong = None
        if ref.dtype not in t.dtypes:
            wrong = f"{key} is {ref.dtype}, expected {' or '.join(t.dtypes)} (the {t.role} of {table.title})"
        elif t.suffix == fmt.decoder.scale.tensor and grid is not None \
                and tuple(ref.shape) not in (shapes := scale_shapes(fmt, grid)):
            wrong = (f"{key} has shape {list(ref.shape)}, expected {_shapes_text(shapes)} for a "
                     f"{list(logical)} weight ({_tile_text(tile, logical)})")
        elif t.role in ("global_scale", "input_scale") and ref.numel not in (1, lead):
            wrong = f"{key} has shape {list(ref.shape)}, expected one value"
        elif t.role == "zero_point" and grid is not None \
                and tuple(ref.shape) not in (shapes := zero_point_shapes(fmt, grid)):
            packed = ", packed along the rows" if shapes[0] != tuple(grid) else ""
            wrong = (f"{key} has shape {list(ref.shape)}, expected {_shapes_text(shapes)} for a {list(logical)} "
                     f"weight (one zero point per scale{packed})")
        if wrong is not None and rule is not None and t.when is not None:
            issues.append((rule, wrong))
        elif wrong is not None:
            problems.append(wrong)
    return Storage(module, "quantized", wref.dtype, table.scheme, fmt.name, _label(fmt, params), present,
                   tuple(missing), tuple(problems), logical, dict(params), tuple(issues))


def holds(expr: str | None, params: Mapping[str, Any], failed: bool = True) -> bool:
    """A table condition over the declared params (None: always true; ``failed``: when it cannot be evaluated)."""
    if expr is None:
        return True
    try:
        return bool(evaluate(expr, dict(params)))
    except ExprError:
        return failed


def _args(expr: str | None, params: Mapping[str, Any]) -> str:
    """The declared params an expression reads, as ``name = value`` (for messages)."""
    names = sorted(names_in(expr) & set(params)) if expr else []
    return ", ".join(f"{n} = {params[n]!r}" for n in names) or "these arguments"


def _refusals(table: SchemeTable, params: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(rule, message) of every ``refuse`` entry of the table's declarations whose condition the params meet."""
    out = []
    for d in table.declared_in:
        for r in d.refuse:
            message = f"declared with {_args(r.when, params)}: {r.reason}"
            if holds(r.when, params, False) and (r.rule, message) not in out:
                out.append((r.rule, message))
    return out


def zero_point_shapes(fmt: FormatDef, grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every shape a zero point of a scale ``grid`` may have: the scale's, or packed along the rows into I32 words
    ([..., ceil(gr * bits / 32), gc], compressed-tensors pack_to_int32 packed_dim=0)."""
    zp = fmt.decoder.zero_point
    if zp is not None and zp.packed == "rows":
        *lead, gr, gc = grid
        return [(*lead, -(-gr * fmt.decoder.bits // 32), gc)]
    return scale_shapes(fmt, grid)


# Pure functions of (format, shape, params), asked once per module: tens of thousands of times in a release
# (every routed expert), with a handful of distinct answers. Keyed by the format's identity (tables are loaded
# once) and the params' items.
_MEMO: dict[tuple, Any] = {}
_MEMO_MAX = 4096


def _memo(key: tuple, compute):
    try:
        return _MEMO[key]
    except KeyError:
        pass
    except TypeError:  # a list-valued param (a block): not hashable as it is
        return compute()
    if len(_MEMO) >= _MEMO_MAX:
        _MEMO.clear()
    value = _MEMO[key] = compute()
    return value


def _params_key(params: Mapping[str, Any]) -> tuple:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(params.items()))


def _tile_grid(fmt: FormatDef, logical: tuple[int, ...], params: Mapping[str, Any]
               ) -> tuple[tuple[int, int] | None, tuple[int, ...] | None, str | None]:
    def compute():
        try:
            return scale_tile(fmt, logical, params), scale_grid(fmt, logical, params), None
        except ExprError as e:
            return None, None, str(e)

    return _memo(("grid", id(fmt), tuple(logical), _params_key(params)), compute)


def _label(fmt: FormatDef, params: Mapping[str, Any]) -> str:
    def compute():
        try:
            return fmt.label.format_map(dict(params))
        except (KeyError, ValueError, IndexError):
            return fmt.label

    return _memo(("label", id(fmt), _params_key(params)), compute)


def _candidates(scheme: QuantScheme | None) -> tuple[list[tuple[SchemeTable, FormatDef]], set[str]]:
    """The checkpoint's own formats first, then every other table's (once per scheme and set of tables)."""
    memo = _scheme_memo(scheme)
    return memo.candidates, memo.own_names


def module_storage(ckpt: Any, scheme: QuantScheme | None, module: str, shape: tuple[int, ...] | None = None,
                   fused: Any = None) -> Storage:
    """How ``module`` (a prefix such as ``model.layers.61.eh_proj``, no ``.weight``) is stored.

    ``scheme``: what the checkpoint declares (``detect_scheme``), tried first; ``shape``: the logical
    weight shape when the caller knows it (the family table does), for the companion checks.
    ``ckpt`` needs only ``tensors`` (key -> TensorRef).
    """
    return _storage_in(_scheme_memo(scheme), scheme, ckpt, module, shape, fused)


def storage_lookup(scheme: QuantScheme | None) -> Callable[..., Storage]:
    """``module_storage`` with ``scheme`` and the tables in force looked up once: ``lookup(ckpt, module,
    shape=None, fused=None)``, for loops over every module of a checkpoint (do not keep it across table changes)."""
    return partial(_storage_in, _scheme_memo(scheme), scheme)


def _storage_in(memo: _Memo, scheme: QuantScheme | None, ckpt: Any, module: str,
                shape: tuple[int, ...] | None = None, fused: Any = None) -> Storage:
    tensors = ckpt.tensors
    alike = None
    if not memo.per_module:
        # Modules whose tensors have the same dtypes and shapes are stored alike (the parameters being the same
        # for all): one look at the tables per pattern, not per module (a release has 46,000 such modules).
        prefix = module + "."
        refs = list(map(tensors.get, [prefix + s for s in memo.suffixes]))
        alike = (shape, *[None if r is None else (r.dtype, r.shape) for r in refs])
        st = memo.alike.get(alike)
        if st is not None:
            at = memo.position
            return Storage(module, st.state, st.dtype, st.scheme, st.format, st.label,
                           {s: refs[at[s]].key for s in st.tensors}, (), (), st.shape, st.params)
    st = _module_storage(tensors, memo, scheme, module, shape, fused)
    if alike is not None and _reusable(st, memo):
        memo.alike[alike] = st
    return st


def alike_storage(ckpt: Any, scheme: QuantScheme | None, modules: Sequence[str],
                  shapes: Sequence[tuple[int, ...]], last_names: Collection[str] = ()) -> Storage | None:
    """The storage of ``modules[0]`` when every module (its logical shape in ``shapes``: a routed-expert group's
    projections) is stored as ``module_storage`` finds the first of its shape and those agree but for names: each
    tensor name a format may use present in all of a shape's modules or in none, in one dtype and shape. Looked at
    in columns, not module by module (a release's layer has 768 experts); None: ask per module. ``last_names``: the
    last name component of every key of ``ckpt`` when known (a name no key ends with is in no module: not looked
    up)."""
    memo = _scheme_memo(scheme)
    if memo.per_module or not modules:
        return None
    tensors = ckpt.tensors
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for module, shape in zip(modules, shapes, strict=True):
        by_shape.setdefault(tuple(shape), []).append(module)
    first: Storage | None = None
    for shape, names in by_shape.items():
        for suffix in memo.suffixes:
            if last_names and "." not in suffix and suffix not in last_names:
                continue
            refs = map(tensors.get, [f"{m}.{suffix}" for m in names])
            column = {None if r is None else (r.dtype, r.shape) for r in refs}
            if len(column) != 1:
                return None
        st = _storage_in(memo, scheme, ckpt, names[0], shape)
        if not _reusable(st, memo) or (first is not None and (st.state, st.dtype, st.scheme, st.format, st.label,
                                                               st.params) != (first.state, first.dtype, first.scheme,
                                                                              first.format, first.label, first.params)):
            return None
        first = first or st
    return first


def _reusable(st: Storage, memo: _Memo) -> bool:
    """Whether ``st`` holds for every module stored alike: nothing in it names this module's tensors (no
    missing companion, no problem) and nothing was read from its values (a ``shape`` companion)."""
    if st.missing or st.problems or st.issues:
        return False
    if st.format is None:
        return True
    fmt = next(f for t, f in memo.candidates if t.scheme == st.scheme and f.name == st.format)
    return all(t.role != "shape" for t in fmt.tensors)


def _module_storage(tensors: Mapping[str, Any], memo: _Memo, scheme: QuantScheme | None, module: str,
                    shape: tuple[int, ...] | None, fused: Any) -> Storage:
    own_names = memo.own_names
    best = None
    for rank, (table, fmt) in enumerate(memo.candidates):
        wref = tensors.get(f"{module}.{fmt.weight.suffix}")
        if wref is None or wref.dtype not in fmt.weight.dtypes:
            continue
        params = _params(scheme, table, module, fused, memo)
        companions = sum(f"{module}.{t.suffix}" in tensors for t in fmt.tensors)
        key = (table.scheme in own_names, _applies(fmt, params), companions, -rank)
        if best is None or key > best[0]:
            best = (key, table, fmt, wref, params)
    found = None
    if best is not None:
        _, table, fmt, wref, params = best
        found = _check(tensors, module, table, fmt, wref, params, shape)
        if best[0][0] or found.complete:
            return found  # the declared format, or a whole format of another scheme (a scheme mismatch)
    wrong = _wrong_dtype(tensors, memo, scheme, module, shape, fused, declared_only=found is not None)
    if wrong is not None:
        return wrong
    if found is not None:
        return found
    wref = tensors.get(f"{module}.weight")
    if wref is not None and wref.dtype in FLOAT_DTYPES:
        return Storage(module, "unquantized", wref.dtype, label=wref.dtype, tensors={"weight": wref.key},
                       shape=tuple(wref.shape))
    if wref is not None:
        return Storage(module, "unquantized", wref.dtype, label=wref.dtype, tensors={"weight": wref.key},
                       problems=(f"{wref.key} is {wref.dtype}, which no quantization scheme table stores",),
                       shape=tuple(wref.shape))
    return Storage(module, "absent", label="absent")


def _wrong_dtype(tensors: Mapping[str, Any], memo: _Memo, scheme: QuantScheme | None, module: str,
                 shape: tuple[int, ...] | None, fused: Any, declared_only: bool) -> Storage | None:
    """A format's weight under its own name in a dtype the format does not store (``weight_packed`` I8 for U8),
    as that format's storage with the wrong dtype its first problem: said as a wrong dtype, not as a missing
    tensor nor as a broken format of another scheme. Only the declared scheme's formats, or (``declared_only``
    False) a format with a companion present; a float ``weight`` is an unquantized module, not a wrong dtype."""
    near = None
    for rank, (table, fmt) in enumerate(memo.candidates):
        wref = tensors.get(f"{module}.{fmt.weight.suffix}")
        if wref is None or wref.dtype in fmt.weight.dtypes or (fmt.weight.suffix == "weight"
                                                               and wref.dtype in FLOAT_DTYPES):
            continue
        own = table.scheme in memo.own_names
        params = _params(scheme, table, module, fused, memo)
        companions = sum(f"{module}.{t.suffix}" in tensors for t in fmt.tensors)
        if not own and (declared_only or not companions):
            continue
        key = (own, _applies(fmt, params), companions, -rank)
        if near is None or key > near[0]:
            near = (key, table, fmt, wref, params)
    if near is None:
        return None
    _, table, fmt, wref, params = near
    st = _check(tensors, module, table, fmt, wref, params, shape)
    wrong = (f"{wref.key} is {wref.dtype}, expected {' or '.join(fmt.weight.dtypes)} (the {fmt.name} weight of "
             f"{table.title})")
    return replace(st, problems=(wrong, *st.problems))
