"""The DeepSpeed sections about storage and I/O -> offload's: `aio` (the NVMe I/O engine),
`checkpoint` (`tag_validation`), and offload's own `prefetch` section, which a DeepSpeed
config may carry at its top level. Called by `translate_deepspeed` (offload/config/deepspeed.py)."""

from __future__ import annotations

import dataclasses

from offload.config.checks import ConfigError
from offload.config.deepspeed_keys import Translation, read_section
from offload.config.sections import PrefetchConfig

__all__ = ["AIO_KEYS", "translate_aio", "translate_checkpoint", "translate_prefetch"]


AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
            "overlap_events", "use_gds")


def translate_aio(t: Translation) -> None:
    """aio -> offload's aio section (the keys that tune speed; the others reported)."""
    aio = read_section("aio", t.ds.get("aio"), AIO_KEYS)
    if "intra_op_parallelism" in aio and "thread_count" in aio:
        raise ConfigError("aio.thread_count", "and aio.intra_op_parallelism (its newer name) are both "
                          "given", "keep only aio.intra_op_parallelism")
    # Keys left out keep offload's defaults, not DeepSpeed's (queue_depth 8, one thread):
    # they tune speed only, and offload's are chosen for its own I/O engine.
    for ds_name, ours in (("block_size", "block_size"), ("queue_depth", "queue_depth"),
                          ("intra_op_parallelism", "threads"), ("thread_count", "threads")):
        if ds_name in aio:
            t.set(f"aio.{ours}", aio[ds_name], f"aio.{ds_name}")
    for name, why in (("single_submit", "offload's I/O engine chooses its own submission batching"),
                      ("overlap_events", "offload's I/O engine always overlaps completions"),
                      ("use_gds", "offload has no GPUDirect Storage path")):
        if name in aio:
            t.ignore(f"aio.{name}", why)


def translate_checkpoint(t: Translation) -> None:
    """checkpoint: {tag_validation} -> checkpoint_tag_validation (DeepSpeed reads it in any case)."""
    sec = read_section("checkpoint", t.ds.get("checkpoint"),
                       ("tag_validation", "use_node_local_storage", "parallel_write", "load_universal"))
    if "tag_validation" in sec:
        value = sec["tag_validation"]
        choices = {"warn": "Warn", "ignore": "Ignore", "fail": "Fail"}
        if not isinstance(value, str) or value.lower() not in choices:
            raise ConfigError("checkpoint.tag_validation", f"= {value!r}, which is not one of Warn, Ignore, Fail",
                              "set it to Warn (DeepSpeed's default), Ignore or Fail")
        t.set("top.checkpoint_tag_validation", choices[value.lower()], "checkpoint.tag_validation")
    if sec.get("load_universal"):
        raise ConfigError("checkpoint.load_universal", "= true: offload reads its own checkpoints (at any "
                          "world size), not DeepSpeed's universal ones", "remove it")
    for name, why in (("use_node_local_storage", "offload's checkpoints work in node-local directories "
                                                 "as they are (docs/checkpoint.md)"),
                      ("parallel_write", "every rank writes its own files in parallel")):
        if name in sec:
            t.ignore(f"checkpoint.{name}", why)


def translate_prefetch(t: Translation) -> None:
    """A DeepSpeed config's top-level `prefetch`: offload's own section, applied last."""
    sec = read_section("prefetch", t.ds.get("prefetch"), [f.name for f in dataclasses.fields(PrefetchConfig)])
    for key, value in sec.items():
        t.set(f"prefetch.{key}", value, f"prefetch.{key}")
