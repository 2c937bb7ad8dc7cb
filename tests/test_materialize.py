"""Models without values reach `initialize` and are materialised unit by unit.

What it pins: a model built on the meta device by the user is replayed one block at a time —
every parameter of block i reaches the engine before any module of block i+1 is
initialized — also when the block itself has no `reset_parameters()` (a plain container of
Linears and LayerNorms, as in most GPTs). Holding every block to the end would need the
whole model in fp32 host memory at `initialize`. (A model built under `offload.init` is
computed parameter by parameter in unit order: tests/test_deferred_init.py pins its bound.)
"""

from __future__ import annotations

import torch

import offload
import offload.units.materialize
from tests.conftest import TinyGPT


def test_meta_model_yields_each_block_before_initializing_the_next(monkeypatch):
    events: list[tuple[str, int]] = []

    def block_of(name: str) -> int:
        parts = name.split(".")
        return int(parts[1]) if parts[0] == "blocks" else -1

    real = offload.units.materialize.materialize_values

    def recording(model, records, slot_of):
        names = {id(r.param): r.name for recs in records for r in recs}
        for pid, value in real(model, records, slot_of):
            events.append(("yield", block_of(names[pid])))
            yield pid, value

    monkeypatch.setattr(offload.units.materialize, "materialize_values", recording)
    cfg = offload.Config(precision=offload.config.sections.PrecisionConfig(dtype="bf16"))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT(n_layer=4)
    for i, blk in enumerate(model.blocks):
        for sub in blk.modules():
            if callable(getattr(sub, "reset_parameters", None)):
                orig = sub.reset_parameters

                def logged(orig=orig, i=i):
                    events.append(("reset", i))
                    orig()

                sub.reset_parameters = logged
    engine = offload.initialize(model, cfg)
    try:
        resets = [i for kind, i in events if kind == "reset"]
        assert sorted(set(resets)) == [0, 1, 2, 3], events
        for i in range(3):
            last_yield_i = max(k for k, (kind, b) in enumerate(events) if kind == "yield" and b == i)
            first_reset_next = min(k for k, (kind, b) in enumerate(events) if kind == "reset" and b == i + 1)
            assert last_yield_i < first_reset_next, (i, events)
    finally:
        engine.close()
