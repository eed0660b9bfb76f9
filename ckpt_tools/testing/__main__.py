"""Write a tiny fixture checkpoint: ``python -m ckpt_tools.testing FAMILY OUT [options]``."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import CkptError
from . import FixtureOptions, make_checkpoint
from .quantized import EXCLUDE_STYLES, MTP_MODES, SCHEMES, QuantOptions, make_quantized_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckpt_tools.testing", description=__doc__)
    p.add_argument("family", help="table name (list them with `ckpt tables`)")
    p.add_argument("out", help="directory to create")
    p.add_argument("--fp8", action="store_true", help="block-FP8 weights with weight_scale_inv")
    p.add_argument("--no-optional", action="store_true", help="leave optional tensors out (e.g. per-layer copies)")
    p.add_argument("--expert-layout", help="write experts in this layout (fused, stacked, ...)")
    p.add_argument("--shards", type=int, default=4, help="number of shards (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp-sidecar", help="put the MTP tensors into this file, e.g. mtp.safetensors")
    p.add_argument("--drop-mtp", action="store_true", help="a trunk: no MTP tensors, MTP count 0")
    p.add_argument("--config", default="{}", help="JSON object of config overrides")
    g = p.add_argument_group("quantized fixtures (need the quant extra: compressed-tensors)")
    g.add_argument("--quant", choices=sorted(SCHEMES), metavar="SCHEME",
                   help="quantize as this tool stores it: " + ", ".join(sorted(SCHEMES)))
    g.add_argument("--mtp", choices=MTP_MODES, default="quantized", help="how MTP is stored (default quantized)")
    g.add_argument("--mtp-count", choices=("kept", "zero"), default="kept", help="dropped MTP: the config's count")
    g.add_argument("--mtp-exclude", choices=EXCLUDE_STYLES, help="how the config excludes MTP modules")
    g.add_argument("--drop-key", action="append", default=[], metavar="GLOB", help="leave these output keys out")
    a = p.parse_args(argv)
    try:
        opts = FixtureOptions(
            fp8=a.fp8, with_optional=not a.no_optional, expert_layout=a.expert_layout, num_shards=a.shards,
            seed=a.seed, config_overrides=json.loads(a.config), mtp_sidecar=a.mtp_sidecar, drop_mtp=a.drop_mtp)
        if a.quant:
            quant = QuantOptions(a.quant, mtp=a.mtp, mtp_count=a.mtp_count, mtp_exclude=a.mtp_exclude,
                                 drop_keys=tuple(a.drop_key))
            out = make_quantized_checkpoint(a.family, a.out, quant, opts)
        else:
            out = make_checkpoint(a.family, a.out, opts)
    except (CkptError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
