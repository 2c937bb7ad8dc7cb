"""Reading a Hugging Face checkpoint directory one tensor at a time, without mapping it.

    reader = SafetensorsDir("path/to/dir")     # headers read and checked, nothing else
    reader.keys()                              # every tensor's name, in file order
    reader.info("model.embed_tokens.weight")   # file, dtype, shape, byte range
    t = reader.read("model.embed_tokens.weight")   # a fresh CPU tensor the caller owns
    reader.close()

The directory is what `save_pretrained` writes (and `engine.save_pretrained`,
`consolidate --config-from`): `model.safetensors.index.json` (`{"weight_map": {key: file}}`)
beside `model-0000i-of-0000N.safetensors`, or one `model.safetensors`. A safetensors file
is an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape
and byte range (relative to the end of the header), then the bytes (consolidate.py writes
the same format).

Why not `safetensors.safe_open` or `torch.load(mmap=True)`: both map the file, and the
pages of a mapping that were read count in the process's resident set until it is
unmapped, so reading a model through one map costs its full size in RSS. Here each tensor's
byte range is read with `preadv` into a tensor allocated for it, and dropping that tensor
gives the memory back: reading a model costs one tensor at a time (the page cache, which is
not the process's memory, is told the range is no longer needed).

What is guaranteed:
- every header is parsed and checked when the reader is made: each tensor's dtype is known,
  its byte count equals its shape times its item size, and its byte range lies inside the
  file; a truncated or corrupt file is a `ValueError` naming the file (and the tensor),
  never garbage values later. A file that shrinks after that is an `OSError` naming it.
- with an index, every key it lists is in the file it names, and every file exists.
- `read` returns exactly the stored bytes as a tensor of the stored dtype and shape.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import weakref
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from offload.checkpoint.consolidate import INDEX_FILE, SINGLE_FILE, ST_DTYPES
from offload.dtypes import from_name

__all__ = ["SafetensorsDir", "TensorInfo", "RenamedSource"]

_CODES: dict[str, torch.dtype] = {code: from_name(name) for name, code in ST_DTYPES.items()}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
_OWN_MAPPING_BYTES = 1 << 16  # tensors this large get their own mapping (`_fresh`)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are."""

    file: str
    """Absolute path of the safetensors file."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset of the first byte in the file."""
    nbytes: int


class SafetensorsDir:
    """A checkpoint directory's tensors by name (module docstring). Holds one open
    descriptor per file until `close()` (or garbage collection)."""

    def __init__(self, path: str) -> None:
        if sys.byteorder != "little":
            raise NotImplementedError(
                f"safetensors stores little-endian values; this machine is {sys.byteorder}-endian")
        self.path = os.path.abspath(os.fspath(path))
        files = _checkpoint_files(self.path)
        self._fds: dict[str, int] = {}
        self._close = weakref.finalize(self, _close_fds, self._fds)
        self._info: dict[str, TensorInfo] = {}
        try:
            wanted = files if isinstance(files, dict) else None
            for f in (sorted(set(files.values())) if isinstance(files, dict) else files):
                fd = os.open(f, os.O_RDONLY)
                self._fds[f] = fd
                for key, info in _parse_header(f, fd).items():
                    if wanted is None or wanted.get(key) == f:
                        self._info[key] = info
            if wanted is not None:
                absent = [(k, f) for k, f in wanted.items() if k not in self._info]
                if absent:
                    key, f = absent[0]
                    raise ValueError(
                        f"{os.path.join(self.path, INDEX_FILE)} lists {len(absent)} tensor(s) that "
                        f"are not in the file it names, e.g. {key!r} in {f}: the directory mixes "
                        "two saves; save the model again into an empty directory")
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        """Every tensor's name, file by file in each header's order."""
        return list(self._info)

    def __contains__(self, key: object) -> bool:
        return key in self._info

    def info(self, key: str) -> TensorInfo:
        try:
            return self._info[key]
        except KeyError:
            raise KeyError(f"{key!r} is not in the checkpoint {self.path}") from None

    def read(self, key: str) -> torch.Tensor:
        """The tensor `key` as stored, in a fresh CPU tensor (the caller owns it; nothing
        here keeps a reference)."""
        info = self.info(key)
        fd = self._fds.get(info.file)
        if fd is None:
            raise ValueError(f"the reader of {self.path} is closed; make a new one")
        t = _fresh(info)
        if info.nbytes == 0:
            return t
        view = t.reshape(-1).view(torch.uint8).numpy().data
        done = 0
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:]], info.offset + done)
            if n == 0:
                raise OSError(
                    f"{info.file}: tensor {key!r} ends at byte {info.offset + info.nbytes}, but "
                    f"the file ends at byte {info.offset + done}: it was truncated after it was "
                    "opened")
            done += n
        try:  # the bytes are ours now; the page cache need not keep them (not our RSS anyway)
            os.posix_fadvise(fd, info.offset, info.nbytes, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass  # advice only
        return t

    def close(self) -> None:
        """Close every file (idempotent)."""
        self._close()


class RenamedSource:
    """A `offload.units.materialize.WeightSource` over a `SafetensorsDir`: the model's
    parameter name -> the checkpoint key holding its value (`key_of`), read on demand.
    `close()` closes the reader."""

    def __init__(self, reader: SafetensorsDir, key_of: Mapping[str, str]) -> None:
        missing = [k for k in key_of.values() if k not in reader]
        if missing:
            raise KeyError(f"keys {missing[:4]} are not in the checkpoint {reader.path}")
        self.reader = reader
        self.key_of = dict(key_of)

    def __contains__(self, name: object) -> bool:
        return name in self.key_of

    def get(self, name: str) -> Optional[torch.Tensor]:
        key = self.key_of.get(name)
        return None if key is None else self.reader.read(key)

    def close(self) -> None:
        self.reader.close()


def _fresh(info: TensorInfo) -> torch.Tensor:
    """An uninitialized tensor for `info`'s bytes. A large one gets an anonymous mapping of
    its own, unmapped when the tensor is dropped: from malloc it would come, past glibc's
    adaptive mmap threshold, from the heap, which a stream of differently-sized tensors
    fragments, and the process's memory would creep up unit after unit (measured: ~0.5 MB
    per unit on a 64-layer model) instead of going back to the system."""
    if info.nbytes < _OWN_MAPPING_BYTES:
        return torch.empty(info.shape, dtype=info.dtype)
    region = mmap.mmap(-1, info.nbytes)  # anonymous, private: no file behind it
    return torch.frombuffer(region, dtype=info.dtype).view(info.shape)


def _close_fds(fds: dict[str, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass  # already closed; nothing to give back
    fds.clear()


def _checkpoint_files(path: str) -> "list[str] | dict[str, str]":
    """[the single file] or {key: file} from the index; a clear error for anything else."""
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{path!r} is not a directory: from_pretrained into shards reads a local directory "
            "written by save_pretrained, and downloads nothing; download a Hub model first "
            "(huggingface_hub.snapshot_download(repo_id)) and pass its path")
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a safetensors index ({exc}); save the model again") from None
        out = {}
        for key, name in weight_map.items():
            file = os.path.join(path, str(name))
            if not os.path.isfile(file):
                raise FileNotFoundError(
                    f"{index} names {name!r} (for {key!r}), which is not in {path}: the "
                    "directory is incomplete; copy or save the whole model again")
            out[str(key)] = file
        return out
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    present = sorted(os.listdir(path))
    if any(n.endswith(".bin") or n.endswith(".bin.index.json") for n in present):
        raise ValueError(
            f"{path} holds pickled PyTorch weights ({[n for n in present if '.bin' in n][:3]}), "
            "which are read whole into memory; load them once with transformers and re-save "
            "as safetensors: model.save_pretrained(dir, safe_serialization=True)")
    raise FileNotFoundError(
        f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE} (it holds {present[:8]}); "
        "pass a directory written by save_pretrained")


def _parse_header(file: str, fd: int) -> dict[str, TensorInfo]:
    size = os.fstat(fd).st_size

    def bad(why: str) -> ValueError:
        return ValueError(f"{file} is not a valid safetensors file: {why}; it is truncated or "
                          "corrupt: save or copy it again")

    if size < 8:
        raise bad(f"it has {size} bytes, fewer than the 8 of the header length")
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > _MAX_HEADER_BYTES or 8 + n > size:
        raise bad(f"the header length {n} runs past the end of the file ({size} bytes)")
    try:
        header = json.loads(os.pread(fd, n, 8))
        if not isinstance(header, dict):
            raise TypeError("not an object")
    except (ValueError, TypeError) as exc:
        raise bad(f"its JSON header does not parse ({exc})") from None
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = meta["dtype"], [int(d) for d in meta["shape"]], meta["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise bad(f"the header entry of {key!r} is malformed ({meta!r})") from None
        dtype = _CODES.get(code)
        if dtype is None:
            raise NotImplementedError(
                f"{file}: tensor {key!r} has safetensors dtype {code!r}, which this reader does not "
                f"read (it reads {sorted(_CODES)}); convert the checkpoint with transformers")
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
            raise bad(f"tensor {key!r} has shape {shape} ({code}) but bytes [{begin}, {end})")
        if data_start + end > size:
            raise bad(f"tensor {key!r} ends at byte {data_start + end}, past the end of the "
                      f"file ({size} bytes)")
        out[str(key)] = TensorInfo(file, dtype, tuple(shape), data_start + begin, end - begin)
    return out
