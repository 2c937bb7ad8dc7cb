"""A Llama-style safetensors checkpoint of a requested size, written tensor by tensor with
seeded random values (never whole in memory), with a config.json transformers reads, and
`read_stored` to check a loaded weight against the file (tools/load_under_limit.py uses it)."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LlamaShape", "shape_for", "write_checkpoint", "read_stored", "ITEMSIZE", "ST_CODE"]

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
ST_CODE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_ITEMSIZE, _ST_CODE = ITEMSIZE, ST_CODE


@dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder's dimensions (`LlamaConfig`'s names); untied embeddings."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(checkpoint key, shape) in the order transformers' save_pretrained writes them."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = h // self.num_attention_heads * self.num_key_value_heads
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                    (p + "mlp.down_proj.weight", (h, i)),
                    (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
        return out

    def layer_numel(self) -> int:
        return sum(math.prod(s) for k, s in self.tensors() if k.startswith("model.layers.0."))

    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors())

    def config_json(self, dtype: str) -> dict[str, Any]:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(self),
                "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1,
                "eos_token_id": 2, "dtype": dtype}


def shape_for(total_bytes: int, dtype: str, hidden_size: int = 1024, vocab_size: int = 4096) -> LlamaShape:
    """A Llama of about `total_bytes` in `dtype`: `hidden_size` wide (the MLP 2.75x, heads of
    128, GQA 4:1 above 4 heads), as many layers as the size takes (at least 1)."""
    heads = max(1, hidden_size // 128)
    probe = LlamaShape(hidden_size, hidden_size * 11 // 4, 1, heads, heads // 4 if heads >= 4 else heads,
                       vocab_size)
    root = probe.numel() - probe.layer_numel()
    layers = max(1, round((total_bytes / _ITEMSIZE[dtype] - root) / probe.layer_numel()))
    return LlamaShape(**{**asdict(probe), "num_hidden_layers": layers})


_POOL = 1_048_573  # values in the random sequence a checkpoint's tensors are windows onto (a prime:
# no row length divides it, so rows differ too)


def write_checkpoint(path: str, shape: LlamaShape, dtype: str = "float32", seed: int = 0,
                     max_shard_bytes: int = 1 << 30) -> int:
    """Write `shape` with random weights into `path` as save_pretrained does: `config.json`,
    shards of at most `max_shard_bytes` and `model.safetensors.index.json`. Each tensor is
    a window, from a random start and wrapping around, onto one random sequence of `_POOL`
    values (normal, std 0.02 for matrices; around 1 for the norms): no two tensors agree,
    and writing costs the disk's time only (drawing 10^9 normals would take longer than
    the load). Written piece by piece: nothing the model's size is in memory. The files are
    flushed and dropped from the page cache (a load reads the disk). Returns the tensors'
    bytes."""
    import torch

    os.makedirs(path, exist_ok=True)
    itemsize, code = _ITEMSIZE[dtype], _ST_CODE[dtype]
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(_POOL, generator=g)
    pools = {kind: bytes(t.to(getattr(torch, dtype)).view(torch.uint8).numpy())
             for kind, t in (("matrix", normal * 0.02), ("norm", 1.0 + 0.1 * normal))}
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for key, s in shape.tensors():
        n = math.prod(s) * itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, s))
        size += n
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, tensors in zip(names, shards):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, s in tensors:
            n = math.prod(s) * itemsize
            header[key] = {"dtype": code, "shape": list(s), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[key] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
        with open(os.path.join(path, name), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for key, s in tensors:
                pool = pools["norm" if len(s) == 1 else "matrix"]
                left = math.prod(s) * itemsize
                at = int(torch.randint(_POOL, (1,), generator=g)) * itemsize
                while left:
                    piece = memoryview(pool)[at : at + left]
                    f.write(piece)
                    left -= len(piece)
                    at = 0
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        total += offset
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(shape.config_json(dtype), f, indent=1)
    return total


def read_stored(path: str, key: str) -> Any:
    """Tensor `key` of the checkpoint at `path`, read with plain reads and parsed here (an
    independent check of offload's reader)."""
    import torch

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        file = os.path.join(path, json.load(f)["weight_map"][key])
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))[key]
        begin, end = meta["data_offsets"]
        f.seek(8 + n + begin)
        raw = bytearray(f.read(end - begin))
    dtype = {v: k for k, v in _ST_CODE.items()}[meta["dtype"]]
    return torch.frombuffer(raw, dtype=getattr(torch, dtype)).view(meta["shape"]).clone()
