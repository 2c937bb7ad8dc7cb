"""Where bytes live: host memory and files (io, swap, nvme), the tiers a shard lives in, and
the optimizer-state stores. Imports nothing of offload above it."""
