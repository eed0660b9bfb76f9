"""``extract-s3``: the synthetic checkpoint on a local S3 server (moto, tests/s3server.py), and its baseline.

``serve(ctx, variant)`` starts the server in the benchmark process (a thread), uploads the
checkpoint once and puts the endpoint and dummy credentials in this process's environment, so
every contender (a child process) finds them the way users configure them. The baseline job
reads the MTP tensors' byte ranges with one plain s3fs ``cat_ranges`` call and writes them end to
end into one fsync'd file: the same bytes ``ckpt extract s3://...`` must move.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

BUCKET = "bench"
_SERVER = None
_URLS: dict[str, str] = {}


def serve(ctx, variant: str) -> str:
    """``s3://bench/<variant>``: the variant uploaded to this process's local S3 server."""
    global _SERVER
    key = f"{ctx.root}:{variant}"
    if key in _URLS:
        return _URLS[key]
    if _SERVER is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from s3server import S3Server

        _SERVER = S3Server().start()
        os.environ.update(_SERVER.env())
        _SERVER.client().create_bucket(Bucket=BUCKET)
    src = ctx.variant(variant).path
    prefix = f"{Path(ctx.root).name}-{variant}"
    client = _SERVER.client()
    for p in sorted(src.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(src)}")
    _URLS[key] = f"s3://{BUCKET}/{prefix}"
    return _URLS[key]


def cat_ranges_job(variant: str):
    def job(ctx, out: Path) -> dict:
        url = serve(ctx, variant)
        src = ctx.variant(variant).path
        ranges = [[f"{url}/{Path(e.file).relative_to(src)}", e.offset, e.offset + e.length]
                  for e in ctx.mtp_extents(variant)]
        return {"op": "s3-cat-ranges", "ranges": ranges, "out": str(out / "model.safetensors")}

    return job


def run_cat_ranges(job: dict) -> None:
    """The baseline: one ``cat_ranges`` over every range (s3fs runs them concurrently), written end to end."""
    import s3fs

    fs = s3fs.S3FileSystem()
    paths, starts, ends = zip(*job["ranges"], strict=True)
    blobs = fs.cat_ranges(list(paths), list(starts), list(ends))
    out = Path(job["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())


if __name__ == "__main__":  # python -m benchmarks.s3bench JOB.json
    run_cat_ranges(json.loads(Path(sys.argv[1]).read_text()))
