"""Consolidate a checkpoint into full-model safetensors, streaming unit by unit.

    python -m offload.checkpoint consolidate CKPT_DIR OUT [--max-shard-size 5GB] [--config-from HF_DIR]

writes `OUT/model.safetensors`, or, past the size limit, `OUT/model-00001-of-0000N.safetensors`
... plus `OUT/model.safetensors.index.json` (Hugging Face's layout: {"metadata":
{"total_size": bytes}, "weight_map": {key: file}}). Keys are exactly `model.state_dict()`'s,
parameters in fp32 (the masters), buffers in their original dtype, so

    model.load_state_dict(safetensors.torch.load_file("OUT/model.safetensors"))

works on a plain `nn.Module`.

How it streams: safetensors is an 8-byte header length, a JSON header giving every
tensor's dtype, shape and byte range, then the bytes. Every shape and dtype is in the
manifest, so all headers are written first and each file is preallocated; then each unit's
full flat master is assembled from the rank files (checksums verified, as `load_checkpoint`
does) and its parameters are written at their offsets. Memory: one unit's fp32 flat buffer
(plus the reader's window of chunks), whatever the model's size. The unit-by-unit walk is
`full_weights.stream_full_weights`, which `engine.full_state_dict()` runs too (over the live
engine's shards instead of the files).

Tied parameters: safetensors cannot store two names over one storage (`save_file` refuses
shared tensors; `save_model` keeps one name and drops the others). We write the value
under every name `model.state_dict()` has, so `load_state_dict(strict=True)` needs no
re-tying step; the header's metadata lists the tied groups (`"offload.tied"`). With
`--config-from` the directory is Hugging Face's instead (config.json, each tied parameter
once): [Note: Hugging Face layout]. `engine.save_pretrained` (pretrained.py) writes the same
layout from a live engine.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import uuid
from typing import Any, Optional, Union

import torch

from offload.checkpoint import files, full_weights, manifest
from offload.checkpoint.load import read_rank_state
from offload.checkpoint.shards import DEFAULT_WINDOW
from offload.dtypes import name_of
from offload.sizes import parse_bytes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = "5GB"

ST_DTYPES = {  # safetensors' dtype codes, by `offload.dtypes.name_of`
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}


def parse_size(size: Union[int, str]) -> int:
    """`max_shard_size` in bytes, from an int or a size read by `offload.sizes.parse_bytes`:
    '5GB' (10**9, as Hugging Face writes it), '500MiB' (2**20)."""
    try:
        value = parse_bytes(size)
    except ValueError as exc:
        raise ValueError(f"max_shard_size: {exc}") from None
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def checkpoint_dir(path: str, tag: Optional[str] = None) -> str:
    """A checkpoint directory from either itself or its save_dir (+ tag, or `latest`)."""
    path = os.fspath(path)
    if tag is None and os.path.isfile(os.path.join(path, files.MANIFEST)):
        return path
    return files.resolve_tag(path, tag)


def consolidate(
    ckpt: str,
    out_dir: str,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    *,
    tag: Optional[str] = None,
    window: int = DEFAULT_WINDOW,
    overwrite: bool = False,
    config_from: Optional[str] = None,
) -> list[str]:
    """Write the checkpoint's full weights as safetensors in `out_dir`; returns the files
    written (the index last, when there is one). One process; no engine needed.

    `out_dir` must be new or empty: an existing directory with anything in it is refused
    (FileExistsError) unless `overwrite`, and then replaced whole, see [Note: replacing OUT].

    `config_from` (a Hugging Face model directory, or its `config.json`): write a directory
    `from_pretrained` loads, see [Note: Hugging Face layout]."""
    limit = parse_size(max_shard_size)
    hf_files = read_hf_config(config_from) if config_from is not None else {}
    out_dir = os.path.abspath(out_dir)
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        entries = sorted(os.listdir(out_dir))
        raise FileExistsError(
            f"output directory {out_dir!r} exists and is not empty ({len(entries)} entries, e.g. "
            f"{entries[0]!r}); pass --overwrite (consolidate(..., overwrite=True)) to replace it, "
            "or name a new directory")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"output {out_dir!r} exists and is not a directory; name a directory")
    path = checkpoint_dir(ckpt, tag)
    saved = manifest.read(path)
    manifest.verify_files(path, saved)
    small = read_rank_state(path, saved, 0)
    units = {u["index"]: u for u in saved["model"]["units"]}

    # Plan: (key, safetensors dtype, shape, bytes) in state-dict order, cut into files.
    plan = []
    tied = full_weights.param_keys(saved["model"])
    for entry in saved["model"]["state_dict"]:
        if entry["kind"] == "param":
            if hf_files and tied[(entry["unit"], entry["slot"])][0] != entry["key"]:
                continue  # a tied parameter's later name: Hugging Face stores it once
            slot = units[entry["unit"]]["slots"][entry["slot"]]
            plan.append((entry["key"], "F32", slot["shape"], slot["numel"] * 4))
        elif entry["kind"] == "buffer":
            value = small["buffers"][entry["key"]]
            code = ST_DTYPES.get(name_of(value.dtype))
            if code is None:
                raise ValueError(f"buffer {entry['key']!r} has dtype {value.dtype}, which safetensors cannot store")
            plan.append((entry["key"], code, list(value.shape), value.numel() * value.element_size()))
    names, shards = split_files(plan, limit)
    n = len(shards)
    tied_groups = [keys for keys in tied.values() if len(keys) > 1]

    # [Note: replacing OUT] A non-empty out_dir (only reached with overwrite) is not written
    # into: old shards of another split would survive beside the new ones and the index
    # would mix runs. The new files go to a sibling staging directory (same filesystem) and
    # the two are swapped by renames at the end, so OUT is always either the old directory
    # or the complete new one; a failure leaves the old one untouched.
    final_dir = out_dir
    tmp_tag = uuid.uuid4().hex[:12]
    replacing = os.path.isdir(out_dir) and bool(os.listdir(out_dir))
    if replacing:
        out_dir = f"{final_dir}.consolidate-{tmp_tag}"
    os.makedirs(out_dir, exist_ok=True)
    where: dict[str, tuple[int, int]] = {}  # key -> (fd index, absolute byte offset)
    fds: list[int] = []
    written = []
    # Every file is written under a temporary name and renamed into place only once all of
    # them are complete and on disk: a consolidation that fails (a torn checkpoint, a full
    # disk) leaves no half-written file that loads as zeros, and never touches the files a
    # previous run left in out_dir.
    temps: list[str] = []
    try:
        for fi, (name, items) in enumerate(zip(names, shards)):
            fpath = os.path.join(out_dir, name)
            tmp = os.path.join(out_dir, f".{name}.{tmp_tag}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            temps.append(tmp)
            fds.append(fd)
            written.append(fpath)
            offsets = preallocate(fd, items, {"format": "pt", "offload.tied": json.dumps(tied_groups)})
            for key, offset in offsets.items():
                where[key] = (fi, offset)

        # buffers straight from the small state
        for entry in saved["model"]["state_dict"]:
            if entry["kind"] == "buffer":
                fi, off = where[entry["key"]]
                pwrite_tensor(fds[fi], small["buffers"][entry["key"]], off)

        # parameters, one unit at a time (the path engine.full_state_dict() takes too)
        def put(keys: list[str], value: torch.Tensor) -> None:
            for key in keys:
                if key in where:
                    fi, off = where[key]
                    pwrite_tensor(fds[fi], value, off)

        full_weights.stream_full_weights(
            saved["model"], full_weights.checkpoint_units(path, saved, window), put
        )
        for fd in fds:
            os.fsync(fd)
    except BaseException:
        for tmp in temps:
            _unlink_quietly(tmp)
        if replacing:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    for tmp, fpath in zip(temps, written):
        os.replace(tmp, fpath)
    if n > 1:
        index = {
            "metadata": {"total_size": sum(item[3] for item in plan)},
            "weight_map": {key: names[where[key][0]] for key, *_ in plan},
        }
        ipath = os.path.join(out_dir, INDEX_FILE)
        files.replace_file_durably(ipath, json.dumps(index, indent=2).encode())
        written.append(ipath)
    for name, data in hf_files.items():
        files.write_file_durably(os.path.join(out_dir, name), data)
        written.append(os.path.join(out_dir, name))
    files.fsync_path(out_dir)
    if replacing:
        old = f"{final_dir}.old-{tmp_tag}"
        os.rename(final_dir, old)
        os.rename(out_dir, final_dir)
        files.fsync_path(os.path.dirname(final_dir))
        shutil.rmtree(old, ignore_errors=True)
        written = [os.path.join(final_dir, os.path.basename(w)) for w in written]
    return written


# [Note: Hugging Face layout] `from_pretrained` needs `config.json` beside the weights, and
# stores a tied parameter once: under the name it keeps when it saves (for GPT-2 and Llama
# with tied embeddings, the embedding's, which comes first in `state_dict()`), re-tying the
# others on load. With `config_from`, consolidation does both; the copied config's `dtype`
# says float32 (what is written), since `from_pretrained` loads in the config's dtype.
HF_CONFIG_FILES = ("config.json", "generation_config.json")


def read_hf_config(config_from: str) -> dict[str, bytes]:
    """The files `config_from` (a model directory, or a config.json) gives: config.json
    (required) and generation_config.json (when beside it), the config's dtype set to
    float32. Read before anything is written, so a bad path fails early."""
    path = os.fspath(config_from)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config = path if not os.path.isdir(path) else os.path.join(path, HF_CONFIG_FILES[0])
    try:
        with open(config, "rb") as f:
            parsed = json.loads(f.read())
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, f"config_from {path!r}: no {config!r}; name a Hugging Face model "
            "directory (holding config.json) or a config.json file", config) from None
    except ValueError as exc:
        raise ValueError(f"config_from {config!r} is not valid JSON ({exc}); name a config.json") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"config_from {config!r} is not a JSON object; name a model's config.json")
    for key in ("dtype", "torch_dtype"):
        if key in parsed:
            parsed[key] = "float32"
    out = {HF_CONFIG_FILES[0]: (json.dumps(parsed, indent=2, sort_keys=True) + "\n").encode()}
    gen = os.path.join(folder, HF_CONFIG_FILES[1])
    if os.path.isdir(path) and os.path.isfile(gen):
        with open(gen, "rb") as f:
            out[HF_CONFIG_FILES[1]] = f.read()
    return out


def split_files(plan: list[tuple], limit: int) -> tuple[list[str], list[list[tuple]]]:
    """Cut `plan` ((key, safetensors dtype, shape, bytes) in order) into files of at most
    `limit` bytes (a larger tensor gets a file of its own, as Hugging Face does); returns
    the file names (`model.safetensors`, or `model-0000i-of-0000N.safetensors`) and each
    file's items."""
    shards: list[list[tuple]] = [[]]
    size = 0
    for item in plan:
        if shards[-1] and size + item[3] > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[3]
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return names, shards


def preallocate(fd: int, items: list[tuple], metadata: dict[str, str]) -> dict[str, int]:
    """Write the safetensors header of `items` (as `split_files` gives them) to the open
    file `fd` and size it for the data; returns each key's absolute byte offset, where
    `pwrite_tensor` puts its value later."""
    header: dict[str, Any] = {"__metadata__": metadata}
    pos = 0
    for key, code, shape, nbytes in items:
        header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    pwrite_all(fd, struct.pack("<Q", len(raw)) + raw, 0)
    data_start = 8 + len(raw)
    os.ftruncate(fd, data_start + pos)
    return {key: data_start + header[key]["data_offsets"][0] for key, *_ in items}


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def pwrite_tensor(fd: int, t: torch.Tensor, offset: int) -> None:
    t = t.detach().contiguous().cpu()
    if t.numel():
        pwrite_all(fd, t.reshape(-1).view(torch.uint8).numpy().data, offset)


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
