"""`offload.checkpointing`: activation checkpointing with the checkpoints in host memory
(ZeRO-R's CPU checkpointing), DeepSpeed's `deepspeed.checkpointing` for offload.

    import offload.checkpointing as ckpt
    ckpt.configure(cpu_offload=True)       # process-wide; or the config's activation_checkpointing.cpu_offload,
                                           # in force while that engine's forward runs
    x = ckpt.checkpoint(block, x)          # torch's non-reentrant checkpoint; inputs kept on the host

What it saves and how: offload/runtime/activations.py.
"""

from offload.runtime.activations import checkpoint, configure, in_force, is_configured, reset

__all__ = ["checkpoint", "configure", "in_force", "is_configured", "reset"]
