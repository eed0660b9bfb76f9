"""Every option of every verb, declared once: a class per verb, an ``Opt`` (flags, default, help) per option.

The CLI builds its typer options from them (cli/options.py), the API functions take their defaults from them
(``stitch(..., mode: str = Stitch.mode)``: a declaration read on its class is its default) and their docstrings'
keywords (``@keywords``), and docs/verbs.md's option tables are generated from them (``python -m tools.docgen``).
The attribute's name is the API keyword; options the API does not take (``--json``) are the CLI's; its annotation is
the type the CLI converts the value to. Plain data only: the CLI imports it at start-up.
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Opt:
    """One option: its default, flags ("-o --out", "--with-embed/--no-embed"), help and the typer extras."""

    default: Any
    flags: str
    help: str = ""
    metavar: str | None = None
    min: int | None = None
    callback: str | None = None  # a function of cli/options.py run on the parsed value
    name: str = ""  # the API keyword: the attribute a verb declares it as

    def __call__(self, *default: Any, **changes: Any) -> Any:
        """This option as a verb declares it (``default``, ``changes``: that verb's own)."""
        return replace(self, **changes, **({"default": default[0]} if default else {}))

    def __set_name__(self, owner: type, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return self.default


def opt(default: Any, flags: str, help: str, **extras: Any) -> Any:
    """A verb's own option."""
    return Opt(default, flags, help, **extras)


def declared(options: type) -> list[Opt]:
    """A verb's options: its own in their order, then those of its base (the tail verbs share) it does not redeclare."""
    found: dict[str, Opt] = {}
    for cls in options.__mro__:
        found |= {name: o for name, o in vars(cls).items() if isinstance(o, Opt) and name not in found}
    return list(found.values())


def keywords(options: type) -> Callable[[F], F]:
    """An API verb's docstring ends with its keywords' help: what its declaration (and ``ckpt VERB --help``) says."""

    def document(fn: F) -> F:
        taken = inspect.signature(fn).parameters
        fn.__doc__ = f"{(fn.__doc__ or '').rstrip()}\n\n    Keywords (the options of ``ckpt``):\n\n" + "".join(
            f"    - ``{o.name}``: {o.help}\n" for o in declared(options) if o.name in taken)
        return fn

    return document


# -- what several verbs share (each verb may word its help for itself) --------------------------------------------

OUT = Opt(..., "-o --out", "Output directory, or an object store's s3://bucket/prefix (new or empty; never an input).")
ARCH = Opt(None, "--arch", "Table to use instead of detecting the family.")
DRY_RUN = Opt(False, "--dry-run", "Print the plan; write nothing.")
PLAN_JSON = Opt(None, "--plan-json", "Write the plan as JSON to this file.")
REPORT = Opt(None, "--report", "Also write the report here.")
JSON = Opt(False, "--json", "Print a JSON report.")
MAX_SHARD_SIZE = Opt("5GB", "--max-shard-size", "e.g. 500MB, 5GB (at most 50GB).")
OVERWRITE = Opt(False, "--overwrite", "Replace an existing output directory.")
RESUME = Opt(False, "--resume", "Finish an interrupted run into the same -o.")
THREADS = Opt(None, "--threads", "Threads decoding quantized weights (default, and at most: every core this process "
              "may use).", min=1, callback="cap_threads")
LINK = Opt("copy", "--link", "Untouched shards: copy | reflink | hardlink | remote (an hf:// target's shards stay on "
           "the Hub)")
ALL = Opt(False, "--all", "List every MTP tensor, unchanged and added ones too (no row limit).")
ALLOW_INVALID = Opt((), "--allow-invalid", "Proceed although the input breaks this consistency rule (repeatable). "
                    "Without it, an inconsistent input is refused; `ckpt validate PATH` lists every problem with its "
                    "rule.", metavar="RULE")
# how --mtp-quant auto / --gguf-type auto measure
PROMPTS_AUTO = Opt(None, "--prompts", "With auto: the prompts the MTP's acceptance is measured on (FILE.jsonl or one "
                   "prompt a line; required).")
MAX_DROP = Opt(0.01, "--max-drop", "With auto: the acceptance drop accepted at each depth.")
DEPTH_AUTO = Opt(1, "--depth", "With auto: acceptance measured at depths 1..K.")
MAX_NEW_TOKENS_AUTO = Opt(32, "--max-new-tokens", "With auto: tokens generated per prompt.")
SHARED = (ALLOW_INVALID, ARCH, DRY_RUN, PLAN_JSON, JSON, MAX_SHARD_SIZE, OVERWRITE, RESUME, THREADS, LINK)

# -- each verb ----------------------------------------------------------------------------------------------------


class Inspect:
    arch: str = ARCH(metavar="NAME", help="Use this family's table instead of detecting it.")
    json: bool = JSON(help="Print the report as JSON (keys documented in ckpt_tools.ops.inspect.inspect).")
    discover: bool = opt(False, "--discover", "Find the MTP tensors from their names and print a draft architecture "
                                              "table (YAML) to refine.")
    write: str = opt(None, "--write", "With --discover: write the draft table to FILE (its name, without "
                                      ".yaml, becomes the family).", metavar="FILE")
    allow_invalid: list[str] = ALLOW_INVALID(
        help="With --discover: proceed although the input breaks this index rule (repeatable). Without --discover it "
             "changes nothing: inspect never refuses a checkpoint it can read, it lists the problems other verbs "
             "refuse as findings.")


class Validate:
    arch: str = ARCH(metavar="NAME", help="Check against this family's table instead of detecting it.")
    json: bool = JSON(help="Print the report as JSON.")
    fix_quant_config: bool = opt(False, "--fix-quant-config", "Write PATH to -o OUT with only its quantization config "
                                 "repaired (rules mtp-quant-config, trunk-quant-config: modules stored otherwise than "
                                 "declared); shards are copied or linked, never rewritten.")
    out: str = OUT(None, help="With --fix-quant-config: the output directory, or s3://bucket/prefix.")
    link: str = LINK(metavar="MODE", help="With --fix-quant-config: how shards reach OUT: copy | reflink (refused "
                                          "where the filesystem has none) | hardlink | remote")
    dry_run: bool = DRY_RUN(help="With --fix-quant-config: print the config diff, write nothing.")
    overwrite: bool = OVERWRITE(help="With --fix-quant-config: replace OUT.")
    engine: str = opt(
        None, "--engine", "vllm: also run vLLM's own MTP loader over the checkpoint's names, shapes and dtypes (no "
        "weight is read): parameters it leaves unloaded (vllm-unloaded), MTP tensors it would drop (vllm-unexpected), "
        "tensors its loader refuses (vllm-load). Run ckpt where vLLM is installed.", metavar="ENGINE")
    gguf_trunk: str = opt(None, "--gguf-trunk", "PATH is an MTP sidecar GGUF: check it goes with this trunk "
                                                "GGUF.", metavar="TRUNK.gguf")


class VerifyManifest:
    json: bool = JSON(help="Print the report as JSON.")


# every scheme table under mappings/quantization/ has a decoder (tests/test_quant_extract.py checks this list)
DEQUANT_HELP = ("bf16 | fp16 | fp32: decode the quantized MTP weights of every scheme in mappings/quantization/ "
                "(block FP8 weight_scale_inv, DeepSeek-V4 FP8 + FP4 experts, compressed-tensors FP8 / INT8 / INT4 / "
                "NVFP4 / MXFP4, ModelOpt FP8 / NVFP4, Quark MXFP4) into this dtype; the config loses "
                "quantization_config. Tensors the source stores unquantized keep their dtype (an F32 router bias "
                "stays F32, as the release and its engines keep it; listed after writing): add --dtype to cast them "
                "too, but for a dtype the family table pins.")


class Extract:
    out: str = OUT()
    arch: str = ARCH()
    layers: str = opt(None, "--layers", "MTP depths to extract, e.g. 0 or 0,1 (default: all).")
    format: str = opt("native", "--format", "native | speculators | angelspec | sglang-nextn | gguf (llama.cpp's MTP "
                                            "sidecar; needs --gguf-trunk)")
    gguf_trunk: str = opt(None, "--gguf-trunk", "--format gguf: the trunk GGUF the sidecar goes with (its "
                          "metadata and vocabulary are copied; its dimensions must be SRC's).")
    gguf_type: str = opt("f16", "--gguf-type", "--format gguf: f32 | f16 | bf16 | q8_0 (norms, 1-D tensors and "
                                               "routers stay F32, as llama.cpp's converter keeps them) | auto (the "
                                               "smallest whose acceptance on --prompts is within --max-drop at every "
                                               "depth).")
    with_embed: bool = opt(None, "--with-embed/--no-embed",
                           "Carry the embedding (per-layer copy, else the shared one).")
    with_head: bool = opt(None, "--with-head/--no-head", "Carry the LM head likewise.")
    dtype: str = opt("keep", "--dtype", "keep | bf16 | fp16 | fp32 (floating tensors; a dtype the family table pins "
                                        "is kept).")
    dequant: str = opt(None, "--dequant", DEQUANT_HELP)
    drop_mtp: bool = opt(False, "--drop-mtp", "Write the trunk: everything but MTP, count 0 (mtp-* rules do not "
                                              "block).")
    verifier_name: str = opt(None, "--verifier-name", "How the draft config names its verifier (default: the "
                             "Hub id of an hf:// or Hub-cache source, else SRC as given).")
    max_shard_size: str = MAX_SHARD_SIZE()
    dry_run: bool = DRY_RUN()
    plan_json: Path = PLAN_JSON()
    overwrite: bool = OVERWRITE()
    resume: bool = RESUME()
    json: bool = JSON()
    allow_invalid: list[str] = ALLOW_INVALID()
    threads: int = THREADS()
    prompts: str = PROMPTS_AUTO()
    max_drop: float = MAX_DROP()
    depth: int = DEPTH_AUTO()
    max_new_tokens: int = MAX_NEW_TOKENS_AUTO()


LAYOUT_HELP = ("per-expert | fused | stacked | stacked-transposed | fused-transposed, with options after ':' "
               "(fused:up-first, fused-transposed:interleaved)")


class _Experts:  # what fuse-experts and unfuse-experts share after -o and --to
    only_mtp: bool = opt(False, "--only-mtp", "Convert the MTP layers' experts only.")
    arch: str = ARCH()
    max_shard_size: str = MAX_SHARD_SIZE()
    dry_run: bool = DRY_RUN()
    plan_json: Path = PLAN_JSON()
    json: bool = JSON()
    overwrite: bool = OVERWRITE()
    dequant: str = opt(None, "--dequant", "Dequantize FP8 block weights to bf16 | fp16 | fp32 (scales dropped).")
    allow_invalid: list[str] = ALLOW_INVALID()
    threads: int = THREADS()


class FuseExperts(_Experts):
    out: str = OUT(None)
    to: str = opt("fused", "--to", LAYOUT_HELP)


class UnfuseExperts(_Experts):
    out: str = OUT(None)
    to: str = opt("per-expert", "--to", LAYOUT_HELP)


class Dequant:
    out: str = OUT(None)
    dtype: str = opt("bf16", "--dtype", "bf16 | fp16 | fp32: what every quantized module of a scheme in "
                     "mappings/quantization/ becomes (block FP8, DeepSeek-V4, compressed-tensors FP8 / INT8 / INT4 / "
                     "NVFP4 / MXFP4, ModelOpt FP8 / NVFP4, Quark MXFP4); scales are dropped, every other tensor is "
                     "copied as it is.")
    only_mtp: bool = opt(False, "--only-mtp", "Decode the MTP layers only; the rest is copied and stays quantized.")
    link: str = LINK(None, help="With --only-mtp: the shards holding no MTP tensor carried whole, copy | "
                     "reflink | hardlink | remote (an hf:// source's shards stay on the Hub); the decoded MTP "
                     "layers go into new model-mtp* shards. Without --link every tensor is copied into new "
                     "shards (a release's whole trunk).")
    arch: str = ARCH()
    max_shard_size: str = MAX_SHARD_SIZE()
    threads: int = THREADS()
    dry_run: bool = DRY_RUN()
    plan_json: Path = PLAN_JSON()
    overwrite: bool = OVERWRITE()
    resume: bool = RESUME()
    json: bool = JSON()
    allow_invalid: list[str] = ALLOW_INVALID()


class _Merge:  # what stitch and graft end with
    plan_json: Path = PLAN_JSON()
    report: Path = REPORT()
    overwrite: bool = OVERWRITE()
    resume: bool = RESUME()
    all: bool = ALL()
    json: bool = JSON()
    allow_invalid: list[str] = ALLOW_INVALID()


class Stitch(_Merge):
    out: str = OUT()
    format: str = opt("auto", "--format", "auto | native | speculators | angelspec | sglang-nextn")
    mode: str = opt("auto", "--mode", "replace (verifier has MTP) | add (it has none; sets the count) | auto")
    link: str = LINK(help="Untouched shards: copy | reflink | hardlink | remote (an hf:// verifier's shards stay on "
                          "the Hub; `ckpt push` copies them server-side)")
    allow_partial: bool = opt(False, "--allow-partial", "Keep verifier tensors the draft lacks.")
    dtype: str = opt("verifier", "--dtype", "verifier (cast to its dtypes) | draft")
    update_copies: bool = opt(False, "--update-copies", "Also replace per-layer embed/head copies.")
    keep_bf16: bool = opt(False, "--keep-bf16", "Write bf16 MTP weights, unquantized.")
    arch: str = ARCH(help="Verifier table instead of detecting it.")
    strip_prefix: str = opt(None, "--strip-prefix", "Strip P from every draft key (a wrapper prefix no table "
                            "knows; module., _orig_mod., draft_model. and the format's own are stripped "
                            "without it). A rename only.", metavar="P")
    layers: str = opt(None, "--layers", "Verifier MTP depth(s) a renumbered draft maps to.")
    max_shard_size: str = MAX_SHARD_SIZE(help="For new MTP shards (add mode).")
    accept_divergent: bool = opt(False, "--accept-divergent", "Stitch even when replaced tensors diverge from the "
                                 "verifier's beyond what finetuning does (cosine < 0.2 or a norm ratio beyond 4x; the "
                                 "report lists them).")
    dry_run: bool = DRY_RUN(help="Plan and compare, print the report, write nothing.")


# the scheme tables whose storage names an encoder (ops.stitch.graft.mtp_quants(); tests/test_quant_encode.py keeps
# this list equal to the shipped tables', read without loading them at start-up)
MTP_QUANTS = " | ".join(("ct-fp8", "ct-int8", "ct-mxfp4", "ct-nvfp4", "ct-pack", "deepseek-v4", "fp8-block",
                         "modelopt-fp8", "modelopt-nvfp4"))


class Graft(_Merge):
    out: str = OUT()
    mtp_dtype: str = opt(None, "--mtp-dtype", "bf16 | fp32 | fp16: MTP values in this dtype (quantized ones "
                         "dequantized); with --mtp-quant, every MTP tensor that option does not encode; a "
                         "dtype the family table pins is kept; default: as the source stores them")
    mtp_quant: str = opt(None, "--mtp-quant", f"{MTP_QUANTS} | auto (every scheme table whose storage names an "
                         "encoder, registered ones included): the linear weights the family table marks "
                         "quantizable in that scheme (a target whose config declares it); the other MTP "
                         "tensors as --mtp-dtype says, else as the source stores them; auto: the smallest scheme "
                         "the target declares whose acceptance on --prompts is within --max-drop at every depth, "
                         "else as stored")
    link: str = LINK()
    arch: str = ARCH(help="Family table for both inputs instead of detecting it.")
    max_shard_size: str = MAX_SHARD_SIZE(help="For the new MTP shards.")
    dry_run: bool = DRY_RUN(help="Plan, print the report, write nothing.")
    prompts: str = PROMPTS_AUTO()
    max_drop: float = MAX_DROP()
    depth: int = DEPTH_AUTO()
    max_new_tokens: int = MAX_NEW_TOKENS_AUTO()


class Diff:
    keys: str = opt(None, "--keys", "Only keys matching this regular expression.")
    stats: bool = opt(False, "--stats", "max |delta|, relative L2 and cosine per changed key.")
    dequant: bool = opt(False, "--dequant", "Compare FP8 block weights by dequantized value.")
    all: bool = ALL(help="List every key, unchanged ones too (no row limit).")
    json: bool = JSON()
    allow_invalid: list[str] = ALLOW_INVALID()


class Probe:
    drafts: list[str] = opt((), "--draft", "A draft in any format stitch accepts; repeatable.")
    prompts: str = opt(None, "--prompts", 'FILE.jsonl ({"prompt": ...} or {"input_ids": [...]} per line) or a '
                                          "text file, one prompt a line.")
    max_new_tokens: int = opt(32, "--max-new-tokens", "Tokens the verifier generates per prompt.")
    depth: int = opt(1, "--depth", "Chain depth K: agreement is measured for depths 1..K.")
    device: str = opt("cpu", "--device", "cpu, cuda or auto (cuda when torch sees a GPU).")
    dtype: str = opt("fp32", "--dtype", "bf16 or fp32.")
    chain: str = opt("sglang", "--chain", "How depth k > 1 is chained: sglang (the post-norm hidden state feeds the "
                     "next step, as SGLang and transformers do) or vllm (the state before the MTP's final norm, as "
                     "vLLM does).")
    min_acceptance: float = opt(None, "--min-acceptance", "Exit 1 when the depth-1 agreement of a draft (of the "
                                "verifier's own MTP when no --draft) is below.")
    arch: str = ARCH(help="The drafts' family when their files do not prove it (a trainer's output without "
                          "config.json), as stitch's --arch.")
    engine: str = opt("transformers", "--engine", "transformers (our table engine around transformers' model: "
                      "agreement, KL, per prompt), vllm (vLLM serves each MTP and counts its own acceptance; needs "
                      "the extra ckpt-tools[vllm]) or llama.cpp (VERIFIER a GGUF file, each --draft an MTP sidecar "
                      "GGUF; llama.cpp's llama-speculative-simple counts its own acceptance).")
    llama_cpp: Path = opt(None, "--llama-cpp", "--engine llama.cpp: a llama.cpp build holding llama-speculative-simple "
                          "(in DIR, DIR/bin or DIR/build/bin; default: PATH).", metavar="DIR")
    threads: int = THREADS(1, help="--engine llama.cpp: llama.cpp's threads (-t).", min=None, callback=None)
    tensor_parallel_size: int = opt(1, "--tensor-parallel-size", "--engine vllm: GPUs per stage.")
    pipeline_parallel_size: int = opt(1, "--pipeline-parallel-size", "--engine vllm: pipeline stages (e.g. nodes).")
    distributed_executor_backend: str = opt(None, "--distributed-executor-backend",
                                            "--engine vllm: mp (one node) or ray (several nodes).")
    work_dir: Path = opt(None, "--work-dir", "--engine vllm: where each --draft is stitched into a hard-linked copy of "
                         "the verifier (default: the system temp directory; same filesystem as the verifier).")
    max_model_len: int = opt(None, "--max-model-len", "--engine vllm: vLLM's context length (default: the config's).")
    attention_backend: str = opt(None, "--attention-backend", "--engine vllm: vLLM's attention backend (e.g. CPU_MLA).")
    mtp_quant: str = opt(None, "--mtp-quant", "Also measure the verifier's own MTP encoded into each scheme (a "
                         "comma list, or all) as graft --mtp-quant writes it, then decoded: bytes, agreement "
                         "and KL per depth, change from as stored.", metavar="SCHEMES")
    json: bool = JSON()
    report: Path = REPORT()
    plot: Path = opt(None, "--plot", "Draw acceptance per depth of every MTP measured (and KL) into this PNG; "
                                     "needs the extra ckpt-tools[plot].", metavar="FILE.png")


class InitDraft:
    out: str = OUT()
    arch: str = ARCH(help="Table (family or template) instead of detecting it.")
    num_layers: int = opt(None, "--num-layers", "MTP layers (default: the config's count, else 1).")
    seed: int = opt(0, "--seed", "Values are a function of (seed, tensor name) only.")
    std: float = opt(None, "--std", "Std of normal projections (default: initializer_range, else 0.02).")
    from_layer: int = opt(None, "--from-layer", "Copy the target's decoder layer L as the block; init only the glue.")
    format: str = opt("native", "--format", "native | speculators | angelspec | sglang-nextn")
    dtype: str = opt("keep", "--dtype", "keep (the table's / config's dtypes) | bf16 | fp16 | fp32")
    dequant: str = opt(None, "--dequant", "Quantized --from-layer (any scheme): dequantize to bf16 / fp32.")
    max_shard_size: str = MAX_SHARD_SIZE()
    dry_run: bool = DRY_RUN()
    plan_json: Path = PLAN_JSON()
    overwrite: bool = OVERWRITE()
    json: bool = JSON()
    allow_invalid: list[str] = ALLOW_INVALID()


class Push:
    revision: str = opt(None, "--revision", "Branch to push to (created if missing).", metavar="BRANCH")
    private: bool = opt(False, "--private", "Create the repository as private.")
    create_pr: bool = opt(False, "--create-pr", "Open a pull request instead of committing.")
    message: str = opt(None, "--message -m", "Commit message.")
    base: str = opt(None, "--base", "Repository whose byte-identical files are copied server-side instead of "
                                    "uploaded.", metavar="REPO[@REV]")
    dry_run: bool = DRY_RUN(help="Print every operation and the bytes to upload; change nothing.")
    force: bool = opt(False, "--force", "Push even if `ckpt validate` finds problems.")
    card: str = opt("keep", "--card", "keep: keep the folder's README.md if it has one; overwrite: always write the "
                                      "generated card.", metavar="keep|overwrite")
    json: bool = JSON(help="Print the plan and result as JSON.")
    allow_invalid: list[str] = ALLOW_INVALID()
    probe_report: Path = opt(None, "--probe-report", "A `ckpt probe --report` of these files whose acceptance "
                             "the card shows (default: probe-report.json in DIR); refused when it measured "
                             "other tensors.", metavar="FILE")
    probe_plot: Path = opt(None, "--probe-plot", "The probe's plot to upload and show (default: the `ckpt "
                           "probe --plot` beside the report).", metavar="FILE.png")


class Tables:
    json: bool = JSON(help="Print JSON.")
    probe: bool = opt(False, "--probe", "Also say which families `ckpt probe` supports, per engine: our table engine "
                      "(transformers) and vLLM's MTP class (asks transformers: a few seconds).")


class Demo:
    family: str = opt(None, "--family", "Table whose tiny fixture to use (default: the table marked `demo: true`).")
    keep: Path = opt(None, "--keep", "Keep the demo files in this (new) directory.")
