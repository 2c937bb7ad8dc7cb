"""Parameter shards split between host memory and NVMe, unit by unit (`Placement`).

`SplitTier` answers the tier interface of offload/storage/tiers.py for all units by passing
each call to the tier that holds the key's shard; the calls that concern every shard
(accounting, settling, failed writes, copies held) go to both. Each unit is built with its
own part (`tier_of(key)`), so the code that branches on a tier's properties (`addressable`,
`device`: the prefetcher's fetch mode, the optimizer's scratch) asks the unit's tier, and
sees a plain host tier or a plain NVMe tier.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Iterator, Optional

import torch

from offload.storage.tiers import Fetch, Handle, Tier

__all__ = ["SplitTier"]


class SplitTier(Tier):
    """Shards of some keys in `host`, the others in `nvme` (the keys `nvme` was made with)."""

    kind = "split"
    addressable = False
    """Not every shard is addressable: ask `tier_of(key).addressable`."""

    def __init__(self, host: Tier, nvme: Tier, nvme_keys: Iterable[Hashable]) -> None:
        self.host = host
        self.nvme = nvme
        self._nvme_keys = frozenset(nvme_keys)
        self.parts: tuple[Tier, Tier] = (host, nvme)

    @property
    def device(self) -> torch.device:
        return self.host.device

    def tier_of(self, key: Hashable) -> Tier:
        return self.nvme if key in self._nvme_keys else self.host

    # -- one shard: its tier's ----------------------------------------------------------------

    def allocate(self, key: Hashable, numel: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        return self.tier_of(key).allocate(key, numel, dtype)

    def adopt(self, key: Hashable, tensor: torch.Tensor) -> None:
        self.tier_of(key).adopt(key, tensor)

    def view(self, key: Hashable) -> Optional[torch.Tensor]:
        return self.tier_of(key).view(key)

    def fetch(self, key: Hashable, out: torch.Tensor) -> Handle:
        return self.tier_of(key).fetch(key, out)

    def store(self, key: Hashable, src: torch.Tensor) -> Handle:
        return self.tier_of(key).store(key, src)

    def store_prefix(self, key: Hashable, src: torch.Tensor) -> Handle:
        return self.tier_of(key).store_prefix(key, src)

    def free(self, key: Hashable) -> None:
        self.tier_of(key).free(key)

    def fetch_ahead(self, key: Hashable, block: bool = False) -> Optional[Fetch]:
        return self.tier_of(key).fetch_ahead(key, block)

    def take_held(self, key: Hashable) -> Optional[Fetch]:
        return self.tier_of(key).take_held(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.tier_of(key)

    # -- every shard: both parts --------------------------------------------------------------

    def keep_after_store(self, keys: Iterable[Hashable]) -> None:
        keys = list(keys)
        for part in self.parts:
            part.keep_after_store([k for k in keys if self.tier_of(k) is part])

    def release_held(self, key: Optional[Hashable] = None) -> None:
        if key is not None:
            self.tier_of(key).release_held(key)
            return
        for part in self.parts:
            part.release_held(None)

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for part in self.parts:
            yield from part.memory_tensors()

    def bytes_on_disk(self) -> int:
        return sum(part.bytes_on_disk() for part in self.parts)

    def bytes_allocated(self) -> int:
        return sum(part.bytes_allocated() for part in self.parts)

    def settle(self) -> None:
        for part in self.parts:
            part.settle()

    def write_failure(self) -> Optional[BaseException]:
        for part in self.parts:
            failure = part.write_failure()
            if failure is not None:
                return failure
        return None
