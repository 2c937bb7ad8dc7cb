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
import math
import os
import time
import zlib
from typing import Optional, Any

import torch

from offload.checkpoint.files import MANIFEST
from offload.checkpoint.shards import CheckpointCorruptError
from offload.dtypes import name_of
from offload.optim.sharded import ShardedOptimizer
from offload.runtime.view import Location, ShardedState
from offload.units.layout import FROZEN_GROUP

FORMAT = "offload-checkpoint"
VERSION = 3
"""3: the manifest carries its own checksum ([Note: the manifest's checksum]). 2: a unit's
master covers its shard only up to its frozen parameters, whose values are saved from the
parameter shard in the compute dtype (record "frozen"; [Note: frozen parameters cost their
shard only] in offload/units/layout.py). Version 1 (masters over whole shards, frozen values
in them) still loads: see `value_records`."""
READABLE = (1, 2, 3)
CHECKSUM_KEY = "manifest_crc32"

# [Note: the manifest's checksum]
# Every byte of the shard and state files is CRC-checked against the manifest, so the
# manifest is what the loader trusts: damage to it that still parses as JSON (a digit
# changed, a key renamed, a list cut short) used to surface as an IndexError or KeyError
# from inside the loader, or as "a different model". From version 3 the manifest records the
# CRC-32 of its own canonical form (sorted keys, compact separators, the checksum field
# left out), and `read` refuses a manifest whose content does not match it, naming
# `manifest.json`. Independently of the checksum (versions 1 and 2 have none), `read`
# checks the type and range of every field the loader indexes (`_check_fields`), so a
# manifest that passes is one the loader can walk.


def _canonical_crc(manifest: dict[str, Any]) -> int:
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()) & 0xFFFFFFFF


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
    """The manifest's bytes, its checksum added ([Note: the manifest's checksum])."""
    plain = json.loads(json.dumps(manifest, default=str))  # what a reader will parse
    plain[CHECKSUM_KEY] = _canonical_crc(plain)
    return json.dumps(plain, indent=1).encode()


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
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointCorruptError(
            errno.EIO, f"{path!r} is damaged: its format version is {version!r}; load another tag", path)
    if version not in READABLE:
        raise ValueError(
            f"{path!r} has format version {version}; this offload reads versions "
            f"{', '.join(map(str, READABLE))}: load it with the offload release that wrote it"
        )
    if version >= 3 or CHECKSUM_KEY in data:
        recorded = data.get(CHECKSUM_KEY)
        if recorded != _canonical_crc(data):
            raise CheckpointCorruptError(
                errno.EIO, f"{path!r} is damaged: its content does not match its own checksum "
                f"({CHECKSUM_KEY} {recorded!r}): the file was changed after the save; load another "
                "tag", path,
            )
    problem = _check_fields(data)
    if problem is not None:
        raise CheckpointCorruptError(
            errno.EIO, f"{path!r} is damaged: {problem}; load another tag", path)
    return data


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _check_fields(m: dict[str, Any]) -> Optional[str]:
    """What is wrong with the fields the loader indexes (types, ranges, cross-references),
    or None."""
    for key, lo in (("world_size", 1), ("chunk_bytes", 1), ("param_groups", 0)):
        if not _is_int(m.get(key), lo):
            return f"{key!r} is {m.get(key)!r}, not an integer >= {lo}"
    if "global_steps" in m and not _is_int(m["global_steps"]):
        return f"'global_steps' is {m['global_steps']!r}"
    model = m.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("units"), list) \
            or not isinstance(model.get("state_dict"), list):
        return "'model' lacks its 'units' and 'state_dict' lists"
    slots_of: dict[int, int] = {}
    for i, u in enumerate(model["units"]):
        where = f"model.units[{i}]"
        if not isinstance(u, dict) or not isinstance(u.get("name"), str) or not isinstance(u.get("slots"), list):
            return f"{where} is not a unit record"
        for key in ("index", "padded_numel", "shard_numel", "optimized_numel") + (
                ("master_end",) if "master_end" in u else ()):
            if not _is_int(u.get(key)):
                return f"{where}.{key} is {u.get(key)!r}"
        if u["index"] != i:
            return f"{where}.index is {u['index']}, not {i}"
        for j, sl in enumerate(u["slots"]):
            if not (isinstance(sl, dict) and isinstance(sl.get("name"), str) and isinstance(sl.get("shape"), list)
                    and all(_is_int(d) for d in sl["shape"]) and _is_int(sl.get("group"), FROZEN_GROUP)
                    and _is_int(sl.get("offset")) and _is_int(sl.get("numel"))
                    and sl["offset"] + sl["numel"] <= u["padded_numel"]
                    and math.prod(sl["shape"]) == sl["numel"]):
                return f"{where}.slots[{j}] is not a consistent parameter record"
        slots_of[i] = len(u["slots"])
    for i, e in enumerate(model["state_dict"]):
        where = f"model.state_dict[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("key"), str):
            return f"{where} is not a state-dict record"
        kind = e.get("kind")
        if kind == "param":
            if not (_is_int(e.get("unit")) and _is_int(e.get("slot")) and e["unit"] in slots_of
                    and e["slot"] < slots_of[e["unit"]]):
                return f"{where} ({e['key']!r}) names no saved parameter"
        elif kind == "buffer":
            if not (isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)):
                return f"{where} ({e['key']!r}) is not a buffer record"
        elif kind != "other":
            return f"{where} has kind {kind!r}"
    ranks = m.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != m["world_size"]:
        return (f"'ranks' lists {len(ranks) if isinstance(ranks, list) else ranks!r} rank(s) for world "
                f"size {m['world_size']}")
    for r, entry in enumerate(ranks):
        where = f"ranks[{r}]"
        if not isinstance(entry, dict) or entry.get("rank") != r:
            return f"{where} is not rank {r}'s record"
        for what in ("shards", "state"):
            f = entry.get(what)
            if not (isinstance(f, dict) and isinstance(f.get("file"), str) and f["file"]
                    and os.path.basename(f["file"]) == f["file"] and _is_int(f.get("size"))):
                return f"{where}.{what} does not name a file of this directory with its size"
        if not _is_int(entry["state"].get("crc32")):
            return f"{where}.state has no crc32"
        tensors = entry["shards"].get("tensors")
        if not isinstance(tensors, list):
            return f"{where}.shards has no tensor list"
        for k, t in enumerate(tensors):
            if not (isinstance(t, dict) and _is_int(t.get("unit")) and t["unit"] in slots_of
                    and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
                    and _is_int(t.get("numel")) and _is_int(t.get("offset"))
                    and t["offset"] <= entry["shards"]["size"]
                    and isinstance(t.get("checksums", []), list)):
                return f"{where}.shards.tensors[{k}] is not a tensor record"
    return None


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

