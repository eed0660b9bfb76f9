"""Loading probe's verifier so that every stored tensor is used as stored, or refusing.

transformers skips a quantization config it has no quantizer for and then loads FP8 codes as values,
dropping their scales; ``MtpModel.from_pretrained`` applies no quantizer at all. A measurement of such a
model is not the checkpoint's. So the trunk loads through transformers only when nothing is quantized or
transformers builds the declared quantizer, and its loading info must show no missing, unexpected,
mismatched or unconverted key; otherwise (and for the MTP layers always) the stored tensors go through
``state.float_state`` (floats as stored, quantized modules decoded by our scheme decoders) into a
model built without its quantization config, under the same checks. Anything else is refused (exit 3,
``probe-load``) naming the cause and the first keys. Which tensors are the MTP layers is the family
table's answer (``open_mtp``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ...errors import InputError
from ...io.checkpoint import Checkpoint
from ...stream.plan import OutputTensor
from . import mtp_engine
from .checks import load_problems, refuse, sequential_load, unquantized_config
from .state import RULE, Lazy, float_state, is_quantized, materialize

AS_STORED = "as stored by transformers"
MTP_AS_STORED = "as stored, by the ckpt-tools table engine"  # the MTP layers: our engine loads them


def dequantized_by(schemes: list[str]) -> str:
    return f"dequantized by ckpt-tools ({'+'.join(schemes)})"


@dataclass
class LoadedVerifier:
    main: Any
    mtp: Any  # the table-driven engine (mtp_engine.TableMtp)
    loaded: str  # how the trunk loaded: AS_STORED, or dequantized_by(...)
    mtp_loaded: str  # how the verifier's MTP layers loaded
    scheme: Any = None  # the declared QuantScheme, for decoding drafts mapped onto the verifier
    notes: list[str] = field(default_factory=list)  # transformers' warnings while loading
    mtp_keys: KeySet | None = None  # the stored MTP tensors (the table's)
    reference: Any = None  # transformers' MtpModel holding the same tensors, where it loads them
    reference_regex: Any = None  # its key patterns
    reference_note: str = ""  # why there is none


class KeySet:
    """The MTP's stored keys, and the namespaces (prefixes) only MTP tensors live under, with the ``search`` of a
    compiled pattern (what ``load_problems`` takes): transformers reports keys after its conversions (fused
    experts' names), so a converted name under an MTP-only prefix is one of them too."""

    def __init__(self, keys, prefixes=()) -> None:
        self.keys = frozenset(keys)
        self.prefixes = tuple(prefixes)

    def search(self, key: str) -> bool:
        return key in self.keys or key.startswith(self.prefixes)


def mtp_key_set(verifier: Checkpoint) -> KeySet:
    """The table's MTP tensors of ``verifier``; its layer and sub-block prefixes that hold no other tensor."""
    from ...model.mtp import open_mtp

    view = open_mtp(verifier)
    keys = set(view.keys())
    others = [k for k in verifier.tensors if k not in keys and k not in view.extra]
    candidates = {p for layer in view.resolved.layers for p in (layer.prefix, *layer.block_prefixes)}
    return KeySet(keys, sorted(p for p in candidates if not any(k.startswith(p) for k in others)))


@contextlib.contextmanager
def captured_warnings() -> Iterator[list[str]]:
    """transformers' log records of WARNING and above while loading (its library logger does not propagate)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    root = logging.getLogger("transformers")
    # kept instead of printed: probe judges the load itself and names what was not loaded as stored (transformers'
    # LOAD REPORT table would only repeat it, on a stream that may be gone when the CLI runs in-process)
    shown, root.handlers = root.handlers, [handler]
    try:
        yield records
    finally:
        root.handlers = shown


def _all_unexpected_reported(cls) -> contextlib.AbstractContextManager:
    """The model class's ``_keys_to_ignore_on_load_unexpected`` emptied while loading: DeepSeek-V3 hides every
    ``model.layers.61.*`` key there, so a stray key under that prefix would go unreported. The MTP keys are
    taken out of the report by the caller (they are loaded, and checked, separately)."""
    from unittest import mock

    return mock.patch.object(cls, "_keys_to_ignore_on_load_unexpected", None, create=True)


def transformers_quantizer(config) -> str | None:
    """The quant_method of the config's quantization config when transformers builds a quantizer for it, else None
    (no quantization config, or one transformers skips). transformers' own mapping, as ``get_hf_quantizer`` reads it."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    qc = getattr(config, "quantization_config", None) or getattr(config.get_text_config(), "quantization_config", None)
    if qc is None:
        return None
    d = qc if isinstance(qc, Mapping) else qc.to_dict()
    method = d.get("quant_method")
    if d.get("load_in_8bit") or d.get("load_in_4bit"):
        method = f"bitsandbytes_{'4bit' if d.get('load_in_4bit') else '8bit'}"
    method = getattr(method, "value", method)
    return method if method in AUTO_QUANTIZATION_CONFIG_MAPPING else None


def declared_quantization(config) -> bool:
    return bool(getattr(config, "quantization_config", None)
                or getattr(config.get_text_config(), "quantization_config", None))


def stored_tensors(verifier: Checkpoint) -> dict[str, OutputTensor]:
    from ..shared.compare import recipe_of

    return {k: OutputTensor(k, ref.dtype, tuple(ref.shape), recipe_of(ref)) for k, ref in verifier.tensors.items()}


def model_class(config):
    """The class transformers loads this config with: the one config.json names (the release's own, e.g. a
    multimodal ``...ForConditionalGeneration``) when transformers has it, else its causal-LM class; none is a
    family probe cannot load."""
    import transformers
    from transformers.models.auto.auto_factory import _get_model_class

    for name in getattr(config, "architectures", None) or ():
        if isinstance(getattr(transformers, name, None), type):
            return getattr(transformers, name)
    try:
        return _get_model_class(config, transformers.AutoModelForCausalLM._model_mapping)
    except (KeyError, ValueError):
        raise InputError(f"transformers has no model class for {type(config).__name__} (architectures "
                         f"{getattr(config, 'architectures', None)})", rule="probe-family") from None


def mtp_regex(cls, config):
    """transformers' regex of the MTP checkpoint keys (``MtpModel.get_mtp_weights_regex``), before a model is built.

    A class that registers no MTP key pattern is one whose MTP transformers cannot find: refused."""
    from transformers.modeling_layers import MtpModel

    patterns = cls._keys_to_ignore_on_load_unexpected or _instance_patterns(cls, config)
    try:
        if not patterns:
            raise ValueError("no _keys_to_ignore_on_load_unexpected")
        return MtpModel.get_mtp_weights_regex(
            SimpleNamespace(config=config, _keys_to_ignore_on_load_unexpected=patterns))
    except ValueError as e:
        raise InputError(f"transformers' {cls.__name__} registers no MTP key pattern ({e}), so its MtpModel "
                         "cannot find the MTP layers", rule="probe-family") from None


def _instance_patterns(cls, config) -> list[str] | None:
    """Patterns a class sets per instance (from the config's MTP count), read from a model built on the meta
    device: no weight is allocated."""
    import torch

    try:
        with torch.device("meta"):
            return cls(copy.deepcopy(config))._keys_to_ignore_on_load_unexpected
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return None


def load(path: str, verifier: Checkpoint, config, device: str, dtype: str, device_map) -> LoadedVerifier:
    """The verifier's trunk and its MTP layers, each loaded as stored (or dequantized by our decoders), or refused."""
    import torch

    from ...model.quant import detect_scheme
    from ...model.quant.scale_values import require_finite_scales

    torch_dtype = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype])
    from ...model.mtp import open_mtp

    cls = model_class(config)
    # scales are values: a NaN / zero scale would measure a model that is not the checkpoint (rule quant-scale-value)
    require_finite_scales(verifier, path)
    stray = open_mtp(verifier).extra
    if stray:
        raise refuse(path, "the MTP layers", [f"{len(stray)} stored tensor(s) in the MTP namespace the family table "
                                              f"has no place for (unexpected: {', '.join(sorted(stray)[:3])})"])
    regex = mtp_key_set(verifier)
    tensors = stored_tensors(verifier)
    quantized = is_quantized(tensors)
    method = transformers_quantizer(config)
    notes: list[str] = []
    main = None
    scheme = None
    loaded = AS_STORED
    if method is not None or not (quantized or declared_quantization(config)):
        # transformers reads this config as stored: load it and check that it used every tensor
        with captured_warnings() as notes, _all_unexpected_reported(cls):
            try:
                main, info = cls.from_pretrained(path, config=config, dtype=torch_dtype, device_map=device_map,
                                                 local_files_only=True, output_loading_info=True)
            except (RuntimeError, ValueError, OSError, ImportError) as e:
                if not quantized:
                    raise InputError(f"transformers cannot load the verifier: {str(e).splitlines()[0][:300]}",
                                     rule=RULE, path=path) from e
                main, info = None, {}  # its quantizer cannot load it here: our decoders below
        problems = load_problems(info, regex)
        if main is not None and method is not None and getattr(main, "hf_quantizer", None) is None:
            problems.insert(0, f"transformers built no quantizer for quant_method {method!r}")
        if problems and not quantized:
            raise refuse(path, "the verifier", problems, notes)
        if problems:
            main = None  # quantized, and transformers did not load it as stored: our decoders below
        elif main is not None and method is not None:
            loaded = f"{AS_STORED} (quantizer {method})"
            failure = _forward_failure(main)
            if failure and quantized:  # its quantizer loads it but cannot run it here: our decoders below
                notes.append(f"transformers' quantizer {method} cannot run it here ({failure}); dequantized instead")
                main, loaded = None, AS_STORED
    if quantized or declared_quantization(config):
        try:
            scheme = detect_scheme(verifier)
        except InputError:
            if main is None:
                raise
    if main is None:
        main, schemes = _load_dequantized(path, cls, config, tensors, regex, scheme, torch_dtype, dtype, device_map,
                                          notes)
        loaded = dequantized_by(schemes) if schemes else AS_STORED
    main.eval()
    mtp, schemes = mtp_engine.build(main, verifier, tensors, scheme, dtype, device, path)
    out = LoadedVerifier(main, mtp, loaded, dequantized_by(schemes) if schemes else MTP_AS_STORED, scheme, notes,
                         regex)
    out.reference, out.reference_regex, out.reference_note = reference_mtp(main, cls, config, tensors, scheme, dtype,
                                                                           device, path)
    return out


def reference_mtp(main, cls, config, tensors, scheme, dtype: str, device: str, where: str | None):
    """(transformers' MtpModel holding the MTP tensors it finds by its own key patterns, those patterns, "") where
    it builds and loads them; else (None, None, why not)."""
    if not getattr(config.get_text_config(), "num_mtp_layers", None):
        return None, None, f"transformers' MtpModel builds no MTP layers for {type(config).__name__}"
    try:
        regex = mtp_regex(cls, config)
        if not any(regex.search(k) for k in tensors):
            return None, None, "transformers' MtpModel key patterns match no stored tensor"
        mtp, _ = load_mtp(main, tensors, regex, scheme, dtype, device, where)
    except InputError as e:
        return None, None, f"transformers' MtpModel does not load them: {e.message}"
    return mtp, regex, ""


def _forward_failure(main) -> str:
    """Why the loaded model cannot run a forward pass of two tokens ("" when it can): a quantizer's kernels may
    load weights they cannot compute with on this device or dtype (a 4-bit float scheme on CPU in fp32)."""
    import torch

    try:
        with torch.no_grad():
            main(torch.tensor([[1, 2]], device=main.device))
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return ""


def _load_dequantized(path, cls, config, tensors, regex, scheme, torch_dtype, dtype, device_map, notes):
    trunk = {k: t for k, t in tensors.items() if not regex.search(k)}
    state, schemes = float_state(trunk, scheme, dtype, path)
    lazy = {k: Lazy(lambda t=t: materialize(t)) for k, t in state.items()}
    with captured_warnings() as more, _all_unexpected_reported(cls), sequential_load():
        try:
            # transformers takes a state dict only without a path: the generation config is read from the path after
            main, info = cls.from_pretrained(None, config=unquantized_config(config), state_dict=lazy,
                                             dtype=torch_dtype, device_map=device_map, output_loading_info=True)
        except (RuntimeError, ValueError, OSError) as e:
            raise InputError(f"the dequantized verifier does not load: {str(e).splitlines()[0][:300]}", rule=RULE,
                             path=path) from e
    notes.extend(more)
    main.config.name_or_path = path
    _generation_config(main, path)
    problems = load_problems(info)
    if problems:
        raise refuse(path, f"the verifier {dequantized_by(schemes)}", problems, notes)
    return main, schemes


def _generation_config(main, path: str) -> None:
    """The checkpoint's generation_config.json (what from_pretrained reads from a path), when it has one."""
    from transformers import GenerationConfig

    with contextlib.suppress(OSError):  # none: the default built from the config stays
        main.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)


def load_mtp(main, tensors: Mapping[str, OutputTensor], regex, scheme, dtype: str, device: str,
             where: str | None) -> tuple[Any, str]:
    """An ``MtpModel`` of ``main`` holding the MTP tensors of ``tensors`` (the stored ones: the verifier's, or a
    draft mapped onto its names), as float values; refused when a tensor is left over or a parameter unset."""
    import torch
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_layers import MtpModel
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import ContextManagers

    state, schemes = float_state({k: t for k, t in tensors.items() if regex.search(k)}, scheme, dtype, where)
    with ContextManagers(MtpModel.get_init_context(main.config.dtype, False, False, None)):
        try:
            mtp = MtpModel(main, main.config.get_text_config().num_mtp_layers)
        except ValueError as e:  # e.g. a config whose MTP layer types transformers cannot tell
            raise InputError(f"transformers' MtpModel cannot be built for this config: {str(e).splitlines()[0]}",
                             rule="probe-family", path=where) from None
    with sequential_load():
        info, _ = convert_and_load_state_dict_in_model(
            model=mtp, state_dict={k: Lazy(lambda t=t: materialize(t)) for k, t in state.items()},
            load_config=LoadStateDictConfig(weight_mapping=mtp.get_weight_conversions(main),
                                            device_map={"": torch.device(device)}, dtype=main.config.dtype))
    mtp._adjust_missing_and_unexpected_keys(info)
    problems = load_problems(info)
    if problems:
        raise refuse(where or "", "the MTP layers", problems)
    mtp.tie_with_main_model(main)
    mtp.eval()
    return mtp, dequantized_by(schemes) if schemes else AS_STORED
