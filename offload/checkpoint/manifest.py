"""The manifest: what a checkpoint holds, and whether it fits the model loading it.

`manifest.json` (written by rank 0, last) records the format version, the model signature
(every unit's layout: parameter names, shapes, optimizer groups, offsets, padding), the
world size it was saved with, dtypes, the config, the keys of `model.state_dict()` and
where each one's value lives, and for every rank its files with sizes and per-chunk
CRC-32s (`offload.checkpoint.shards`). Loading checks the signature before reading a
byte of state, and checks every file's size before trusting it.

Layout offsets do not depend on the world size (only the tail padding does, see
`offload.units.shard.layout_unit`), which is what lets a checkpoint saved with N ranks be
loaded with M: the flat unit is the same, only its cut into shards differs.
"""

from __future__ import annotations

import errno
import json
import os
import time
from typing import Optional, Any

import torch

from offload.checkpoint.files import MANIFEST
from offload.checkpoint.shards import CheckpointCorruptError
from offload.dtypes import name_of
from offload.optim.sharded import ShardedOptimizer
from offload.runtime.view import Location, ShardedState
from offload.units.layout import FROZEN_GROUP

FORMAT = "offload-checkpoint"
VERSION = 2
"""2: a unit's master covers its shard only up to its frozen parameters, whose values are
saved from the parameter shard in the compute dtype (record "frozen"; [Note: frozen
parameters cost their shard only] in offload/units/layout.py). Version 1 (masters over
whole shards, frozen values in them) still loads: see `value_records`."""
READABLE = (1, 2)


def model_signature(sharded: ShardedState) -> dict[str, Any]:
    """The engine's units and state-dict keys, as plain JSON values."""
    units = []
    for unit in sharded.units:
        layout = unit.layout
        units.append({
            "index": unit.index,
            "name": unit.name,
            "padded_numel": layout.padded_numel,
            "shard_numel": layout.shard_numel,
            "optimized_numel": layout.optimized_numel,
            "master_end": layout.master_end,
            "slots": [
                {"name": s.name, "shape": list(s.shape), "group": s.group,
                 "offset": s.offset, "numel": s.numel}
                for s in layout.slots
            ],
        })
    keys = []
    # The manifest's "kind" is the file format's word for a Location (its value).
    for entry in sharded.state_dict_index:
        key, where = entry.key, entry.where
        if entry.location is Location.PARAM:
            keys.append({"key": key, "kind": "param", "unit": where[0], "slot": where[1]})
        elif entry.location is Location.BUFFER:
            dtype = sharded.buffer_dtypes.get(id(where), where.dtype)
            keys.append({"key": key, "kind": "buffer", "dtype": name_of(dtype),
                         "shape": list(where.shape)})
        else:
            keys.append({"key": key, "kind": "other"})
    return {"units": units, "state_dict": keys}


def value_records(saved_unit: dict[str, Any]) -> list[tuple[str, int, int]]:
    """Where a saved unit's parameter values lie: (record name, flat start, flat end) runs
    of its flat buffer. Version 2: "master" (fp32) up to `master_end`, then "frozen" (the
    parameter shards' frozen suffixes, compute dtype); version 1 (no `master_end`): the
    masters hold every value."""
    end = saved_unit["padded_numel"]
    split = saved_unit.get("master_end", end)
    return [(name, lo, hi) for name, lo, hi in (("master", 0, split), ("frozen", split, end)) if lo < hi]


def build(sharded: ShardedState, tag: str, chunk_bytes: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest of a checkpoint of `sharded` with tag `tag`, whose rank files are
    described by `ranks` (one entry per rank, as `save` gathers them)."""
    cfg = sharded.config
    master = torch.float32  # always: see docs/engine.md, Precision
    moments = sharded.optimizer.specs[0].dtype if sharded.optimizer.specs else master
    return {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "created_unix_s": time.time(),
        "torch": torch.__version__,
        "world_size": sharded.world_size,
        "chunk_bytes": chunk_bytes,
        "dtypes": {
            "master": name_of(master),
            "moments": name_of(moments),
            "compute": name_of(sharded.dtype),
        },
        "param_groups": len(sharded.optimizer.param_groups),
        "optimizer": {"type": sharded.optimizer.kind,
                      "state": list(sharded.optimizer.state_names),
                      "moments": sharded.optimizer.moments},
        "global_steps": sharded.counters.global_steps,
        "config": cfg.to_dict(),
        "model": model_signature(sharded),
        "ranks": ranks,
    }


def dumps(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1, default=str).encode()


def read(ckpt_dir: str) -> dict[str, Any]:
    """The manifest of checkpoint directory `ckpt_dir`; a missing, unreadable or foreign
    one is an error naming the file."""
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointCorruptError(
            errno.ENOENT, f"{path!r} is missing: {ckpt_dir!r} is not a complete checkpoint "
            "(a save killed part way leaves no manifest); load another tag", path,
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            errno.EIO, f"{path!r} is not valid JSON ({exc}): the checkpoint is corrupt; "
            "load another tag", path,
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointCorruptError(
            errno.EIO, f"{path!r} is not an offload checkpoint manifest", path
        )
    if data.get("version") not in READABLE:
        raise ValueError(
            f"{path!r} has format version {data.get('version')}; this offload reads versions "
            f"{', '.join(map(str, READABLE))}: load it with the offload release that wrote it"
        )
    return data


def verify_files(ckpt_dir: str, manifest: dict[str, Any], ranks: Optional[list[int]] = None) -> None:
    """Every file of the saved `ranks` (default: all) exists with its recorded size."""
    for entry in manifest["ranks"]:
        if ranks is not None and entry["rank"] not in ranks:
            continue
        for what in ("shards", "state"):
            f = entry[what]
            path = os.path.join(ckpt_dir, f["file"])
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise FileNotFoundError(
                    errno.ENOENT, f"checkpoint {ckpt_dir!r} is missing rank {entry['rank']}'s "
                    f"{what} file {f['file']!r} (saved with world size "
                    f"{manifest['world_size']}); the checkpoint is incomplete, copy the whole "
                    "directory or load another tag (a checkpoint saved to node-local "
                    "directories loads at its own world size; to load it at another, copy every "
                    "node's files into one directory)", path,
                ) from None
            if size != f["size"]:
                raise CheckpointCorruptError(
                    errno.EIO, f"checkpoint file {path!r} is {size} bytes, the manifest says "
                    f"{f['size']}: it is truncated or was overwritten; load another tag", path,
                )


def records_by_rank(ckpt_dir: str, manifest: dict[str, Any]) -> list[tuple[str, dict]]:
    """Per saved rank, in rank order: the path of its shard file and its tensor records by
    (unit index, tensor name), as `shards.assemble_jobs` takes them."""
    out = []
    for entry in manifest["ranks"]:
        shards = entry["shards"]
        by_key = {(r["unit"], r["name"]): r for r in shards["tensors"]}
        out.append((os.path.join(ckpt_dir, shards["file"]), by_key))
    return out


def check_compatible(saved: dict[str, Any], sharded: ShardedState) -> None:
    """Raise ValueError naming the first difference between the saved model and `sharded`'s."""
    mine = model_signature(sharded)
    old = {s["name"]: (u["name"], s) for u in saved["model"]["units"] for s in u["slots"]}
    new = {s["name"]: (u["name"], s) for u in mine["units"] for s in u["slots"]}
    for name, (unit, s) in new.items():
        if name not in old:
            raise ValueError(
                f"checkpoint is of a different model: parameter {name!r} (shape "
                f"{tuple(s['shape'])}) is not in it"
            )
        if list(old[name][1]["shape"]) != list(s["shape"]):
            raise ValueError(
                f"checkpoint is of a different model: parameter {name!r} has shape "
                f"{tuple(old[name][1]['shape'])} in the checkpoint and {tuple(s['shape'])} in "
                "this model"
            )
    for name, (_, s) in old.items():
        if name not in new:
            raise ValueError(
                f"checkpoint is of a different model: it has parameter {name!r} (shape "
                f"{tuple(s['shape'])}), which this model lacks"
            )
    if [u["name"] for u in saved["model"]["units"]] != [u["name"] for u in mine["units"]]:
        raise ValueError(
            f"checkpoint units {[u['name'] for u in saved['model']['units']]} differ from this "
            f"engine's {[u['name'] for u in mine['units']]}: use the same unit_modules setting"
        )
    # before the offsets: 8-bit moments lay parameters out on 256-element blocks
    check_optimizer(saved, sharded.optimizer)
    version_1 = {u["name"] for u in saved["model"]["units"] if "master_end" not in u}
    for name, (unit, s) in new.items():
        ounit, o = old[name]
        if (ounit in version_1 and o["group"] == s["group"] == FROZEN_GROUP
                and o["offset"] != s["offset"]):
            raise ValueError(
                f"checkpoint {saved.get('tag')!r} was saved by an earlier offload (format version "
                f"{saved.get('version')}), whose layout put frozen parameters right after the "
                f"trained ones in a unit: parameter {name!r} of unit {unit!r} sits at offset "
                f"{o['offset']} there and at {s['offset']} here. Its weights still load: "
                "consolidate it (python -m offload.checkpoint consolidate CKPT OUT) and pass them "
                "to engine.load_full_state_dict; its optimizer state cannot be carried over"
            )
        if (ounit, o["offset"], o["group"]) != (unit, s["offset"], s["group"]):
            raise ValueError(
                f"parameter {name!r} sits in unit {ounit!r} at offset {o['offset']} in optimizer "
                f"group {o['group']} in the checkpoint, but in unit {unit!r} at offset "
                f"{s['offset']} in group {s['group']} here: build the optimizer param groups "
                "the way the saving run did"
            )
    if saved["param_groups"] != len(sharded.optimizer.param_groups):
        raise ValueError(
            f"checkpoint has {saved['param_groups']} optimizer param groups, this engine "
            f"{len(sharded.optimizer.param_groups)}"
        )


def saved_optimizer(saved: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """(type, state tensor names) of the optimizer that saved `saved`. A checkpoint from
    before other optimizers ran names none: Adam/AdamW, as its config says."""
    entry = saved.get("optimizer")
    if entry is not None:
        return str(entry["type"]), tuple(entry["state"])
    kind = saved.get("config", {}).get("optimizer", {}).get("type", "AdamW")
    return str(kind), ("exp_avg", "exp_avg_sq")


def check_optimizer(saved: dict[str, Any], optimizer: ShardedOptimizer) -> None:
    """A checkpoint's optimizer state is another optimizer's (Lion's exp_avg is not Adam's,
    Adagrad's sum is no moment): refused, naming both. Adam and AdamW share their state."""
    kind, names = saved_optimizer(saved)
    moments = saved.get("optimizer", {}).get("moments", "fp32")
    if names != tuple(optimizer.state_names) and "8bit" in (moments, optimizer.moments):
        raise ValueError(
            f"checkpoint {saved.get('tag')!r} holds {kind} state with optimizer.moments_dtype="
            f"{moments!r}, this engine keeps {optimizer.moments!r}: 8-bit moments (codes and "
            "per-block scales, parameters laid out on 256-element blocks) do not convert to or "
            f"from float moments; set optimizer.moments_dtype={moments!r} to resume it, or carry "
            "over only its weights: python -m offload.checkpoint consolidate CKPT OUT, then "
            "engine.load_full_state_dict"
        )
    if names != tuple(optimizer.state_names):
        raise ValueError(
            f"checkpoint {saved.get('tag')!r} holds the state of a {kind} optimizer "
            f"({', '.join(names)}), but this engine runs {optimizer.kind} "
            f"({', '.join(optimizer.state_names)}): set optimizer.type={kind!r} (or pass that "
            "optimizer to offload.initialize) to resume it, or carry over only its weights: "
            "python -m offload.checkpoint consolidate CKPT OUT, then engine.load_full_state_dict"
        )

