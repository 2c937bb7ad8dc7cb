"""`python -m offload.checkpoint consolidate CKPT_DIR OUT [--max-shard-size 5GB] [--tag TAG] [--overwrite]
    [--config-from HF_MODEL_DIR_OR_CONFIG_JSON]`"""

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
    c.add_argument("--config-from", default=None, metavar="DIR_OR_JSON",
                   help="a Hugging Face model directory (or its config.json): copy config.json and "
                        "generation_config.json and store tied weights once, so that "
                        "from_pretrained(OUT) loads the result")
    args = p.parse_args(argv)
    try:
        out = consolidate(args.ckpt_dir, args.out, args.max_shard_size, tag=args.tag,
                          overwrite=args.overwrite, config_from=args.config_from)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in out:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
