"""What vLLM needs to BUILD a family's MTP draft class on a CPU, for a load check (ops/check/vllm_loader.py).

Runs in the interpreter where vLLM is installed; imported only from there (vllm, torch and transformers are
imported inside the functions). The engine config states what a load check needs instead of inheriting the
platform's defaults (``engine_config``); the stand-ins let a class be built where its constructor reaches for a
GPU-only piece. None of them touches ``load_weights``, which is what the check runs.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path
from typing import Any


class _Any(types.ModuleType):
    """A module (and everything inside it) that stands for a package this build lacks: never called here."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Any(f"{self.__name__}.{name}")
        sub.__spec__ = importlib.machinery.ModuleSpec(sub.__name__, None)
        setattr(self, name, sub)
        return sub

    def __call__(self, *a, **k):
        return self

    def __or__(self, other):  # type annotations such as ``tvF.InterpolationMode | int``
        return self

    __ror__ = __or__


class _Finder:
    """Imports of ``names`` (and their submodules) get an ``_Any``."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if any(name == n or name.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Any(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0"
        return m

    def exec_module(self, module):
        pass


def stub_missing_modules() -> None:
    """The CPU build lacks torchvision, which multimodal processors import at module level: a stand-in."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        sys.modules.pop("torchvision", None)
        sys.meta_path.insert(0, _Finder("torchvision"))


CUDA_ONLY = ("vllm.vllm_flash_attn", "vllm.third_party.deep_gemm")


def _stub_cuda_imports() -> None:
    """Modules only CUDA builds have (flash attention, which raises on import without its extension, and
    DeepGEMM): some families' modules import them at module level for kernels they call at run time. Only
    for tables that ask: a CPU code path that probes for them would otherwise think them present."""
    for name in [n for n in sys.modules if any(n == m or n.startswith(m + ".") for m in CUDA_ONLY)]:
        del sys.modules[name]
    sys.meta_path.insert(0, _Finder(*CUDA_ONLY))
    from vllm.v1.attention.backends import fa_utils

    # the CUDA-only helpers fa_utils defines when flash attention is present
    fa_utils.__getattr__ = lambda name: _Any(f"{fa_utils.__name__}.{name}")
    from vllm.v1.attention.backends.mla.prefill import flash_attn as prefill

    if prefill.flash_attn_varlen_func is None:  # the prefill backend asserts it exists when built
        prefill.flash_attn_varlen_func = _Any("flash_attn_varlen_func")


def _stub_cuda_stream() -> None:
    """``torch.cuda.Stream()`` / ``torch.cuda.Event()`` in a layer's constructor (overlap at run time)."""
    import torch

    class Inert:
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):
            return lambda *a, **k: None

    torch.cuda.Stream = Inert
    torch.cuda.Event = Inert


def _stub_sparse_attention() -> None:
    """vLLM's CPU platform refuses to pick a backend for sparse (DSA) attention: hand it CUDA's FlashMLA
    sparse backend (its module imports on CPU), whose only GPU step when built is reserving a scratch
    workspace: reserve nothing. A backend shapes the KV cache and the kernels, not the parameters."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.mla import flashmla_sparse

    class NoWorkspace:
        def get_simultaneous(self, *specs):
            return [None for _ in specs]

    flashmla_sparse.current_workspace_manager = NoWorkspace
    pick = CpuPlatform.get_attn_backend_cls.__func__

    def sparse(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse:
            return "vllm.v1.attention.backends.mla.flashmla_sparse.FlashMLASparseBackend"
        return pick(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(sparse)


def _stub_moe_kernel() -> None:
    """vLLM's CPU build has no fused-MoE kernel for some expert activations (non-gated relu2, clamped
    SwiGLU) and refuses to build such experts: accept the configuration and take the CPU backend's weight
    layout. The kernel would run at forward time; the expert parameters are the same for every backend."""
    from vllm.model_executor.layers.fused_moe import config as moe_config
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    real = moe_config.current_platform

    class AnyActivation:  # the non-gated check asks whether the platform is CUDA-like; nothing else changes
        def __getattr__(self, name):
            return getattr(real, name)

        def is_cuda_alike(self):
            return True

    moe_config.current_platform = AnyActivation()
    select = method.select_unquantized_moe_backend

    def cpu_layout(*a, **k):
        try:
            return select(*a, **k)
        except NotImplementedError:
            return UnquantizedMoeBackend.CPU, None

    method.select_unquantized_moe_backend = cpu_layout


def _stub_flash_varlen(cls_path: str) -> None:
    """An attention that refuses to be built without FlashAttention's varlen kernel (it runs at forward time):
    every module of the draft class's package that took the availability check by name says it is there. Its
    parameters are the same either way."""
    package, _, cls = cls_path.rpartition(".")
    getattr(importlib.import_module(package), cls)  # the class's modules (a package may import them when asked)
    for name, module in list(sys.modules.items()):
        if (name == package or name.startswith(package + ".")) and hasattr(module, FLASH_VARLEN):
            setattr(module, FLASH_VARLEN, lambda: True)


# CPU stand-ins a table may ask for (``vllm.stubs``): each lets a class be BUILT on CPU where its constructor
# reaches for a GPU-only piece; none of them touches load_weights, which is what the check runs
STUBS = {
    "cuda_stream": _stub_cuda_stream,
    "sparse_attention": _stub_sparse_attention,
    "moe_kernel": _stub_moe_kernel,
    "cuda_imports": _stub_cuda_imports,
    "flash_varlen": _stub_flash_varlen,
}
FLASH_VARLEN = "is_flash_attn_varlen_func_available"
TAKES_CLASS = {"flash_varlen"}  # stand-ins that patch the draft class's own package


_INSTALLED: set[str] = set()


def install_stubs(names: list[str], cls_path: str = "") -> None:
    """The stand-ins a table names (``vllm.stubs``), each once per process; ``cls_path``: the table's draft class."""
    for name in names:
        if name not in _INSTALLED:
            STUBS[name](*([cls_path] if name in TAKES_CLASS else []))
            _INSTALLED.add(name)


def inspect_in_process() -> None:
    """vLLM inspects a model class in a fresh subprocess (to keep CUDA out of the parent) unless its cache has
    it: ~10 s of importing vllm per family, and without this process's stand-ins. On CPU there is no CUDA to
    keep out: inspect here."""
    from vllm.model_executor.models import registry

    def inspect(self):
        return registry._ModelInfo.from_model_cls(self.load_model_cls())

    registry._LazyRegisteredModel.inspect_model_cls = inspect


def register_plain_config(model_type: str) -> None:
    """A config class for a model type neither transformers nor vLLM ships (releases bring it as remote
    code): a plain PretrainedConfig holding every field of config.json, nested text / vision configs of a
    known model type built as those, which is what the remote classes are for the fields vLLM reads."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    if model_type in CONFIG_MAPPING or model_type in _CONFIG_REGISTRY:
        return

    def __init__(self, **kwargs):
        for name in ("text_config", "vision_config"):
            sub = kwargs.get(name)
            if isinstance(sub, dict) and sub.get("model_type") in CONFIG_MAPPING:
                kwargs[name] = CONFIG_MAPPING[sub["model_type"]](**sub)
        PretrainedConfig.__init__(self, **kwargs)

    cls = type(f"Plain_{model_type}_Config", (PretrainedConfig,), {"model_type": model_type, "__init__": __init__})
    AutoConfig.register(model_type, cls)


def engine_config(ckpt_dir: str | os.PathLike[str], dtype: str) -> Any:
    """vLLM's engine config for ``ckpt_dir`` with MTP speculation (the draft class is picked from its config.json as
    serving picks it), at a short context, without a tokenizer or real weights."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = json.loads(Path(ckpt_dir, "config.json").read_text())
    text = cfg.get("text_config") or {}
    register_plain_config(cfg["model_type"])
    max_len = min(256, int(text.get("max_position_embeddings", cfg.get("max_position_embeddings", 256))))
    # prefix caching stated off: a load check caches nothing, and vLLM's CPU platform turns it off for MLA models
    # without AMX only after the hybrid-model hook sized mamba_block_size for it being on (then refuses the config)
    args = EngineArgs(model=str(ckpt_dir), skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
                      max_model_len=max_len, load_format="dummy", trust_remote_code=False,
                      enable_prefix_caching=False,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    return args.create_engine_config()


def init_distributed(tmp: str | os.PathLike[str]) -> None:
    """A one-process gloo group (vLLM's layers ask for their tensor-parallel rank), its rendezvous file in ``tmp``."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                    distributed_init_method=f"file://{Path(tmp, 'dist')}", backend="gloo")
    ps.ensure_model_parallel_initialized(1, 1)
