"""Checkpoints: save, resume exactly, survive a crash, consolidate (docs/checkpoint.md).

    engine.save_checkpoint(save_dir, tag=None, client_state=None)   # every rank
    path, client_state = engine.load_checkpoint(load_dir, tag=None)  # every rank
    python -m offload.checkpoint consolidate CKPT_DIR OUT [--max-shard-size 5GB]

| file | holds |
|---|---|
| `files.py` | the directory protocol: tags, `latest`, temp dirs, durable renames |
| `shards.py` | checksummed chunked tensor files over `offload.storage.io` (write and read pipelines) |
| `manifest.py` | the manifest: model signature, files, sizes, checksums; compatibility checks |
| `save.py` / `load.py` | the engine's state out and back in (re-sharding on load) |
| `full_weights.py` | the full fp32 weights unit by unit: consolidation, `full_state_dict`, `load_full_state_dict` |
| `consolidate.py` | full-model safetensors, streamed unit by unit |
| `pretrained.py` | `engine.save_pretrained`: a directory Hugging Face's `from_pretrained` loads |
| `safetensors_dir.py` | reading such a directory tensor by tensor, unmapped (`offload.integrations.hf.from_pretrained`) |

The functions that act on a live engine take its `offload.runtime.view.ShardedState`
(`engine.sharded_state`), never the `Engine`: they read and restore only what it lists.
"""

from offload.checkpoint.consolidate import consolidate
from offload.checkpoint.load import load_checkpoint
from offload.checkpoint.save import save_checkpoint
from offload.checkpoint.shards import CheckpointCorruptError

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "CheckpointCorruptError"]
