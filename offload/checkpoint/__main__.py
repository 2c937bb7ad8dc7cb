"""`python -m offload.checkpoint consolidate CKPT_DIR OUT [--max-shard-size 5GB] [--tag TAG] [--overwrite]`"""

from __future__ import annotations

import argparse
import sys

from offload.checkpoint.consolidate import DEFAULT_MAX_SHARD_SIZE, consolidate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m offload.checkpoint", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "consolidate",
        help="write the full model weights (fp32) as safetensors, streaming unit by unit",
    )
    c.add_argument("ckpt_dir", help="a checkpoint directory, or the save_dir holding `latest`")
    c.add_argument("out", help="output directory (created; an existing one must be empty unless --overwrite)")
    c.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help="split into files of at most this size plus an index, e.g. 5GB, 500MB "
                        f"(default {DEFAULT_MAX_SHARD_SIZE})")
    c.add_argument("--tag", default=None, help="the tag to consolidate when ckpt_dir is a save_dir")
    c.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty output directory (swapped in whole once complete)")
    args = p.parse_args(argv)
    try:
        out = consolidate(args.ckpt_dir, args.out, args.max_shard_size, tag=args.tag,
                          overwrite=args.overwrite)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in out:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
