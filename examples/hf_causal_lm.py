"""Train a Hugging Face Transformers causal LM with offload (nothing is downloaded).

The model comes from `AutoModelForCausalLM.from_config` with a config built in code (a
tiny Llama or GPT-2 by default; scale it up with the flags); its decoder layers
(an `nn.ModuleList`) become offload's units with no extra wiring. Install the optional
extra first: `pip install "offload[hf]"` (or `pip install transformers`).

    python examples/hf_causal_lm.py --arch llama --steps 5
    python examples/hf_causal_lm.py --arch gpt2 --layers 4 --hidden 256 --precision bf16
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py
    python examples/hf_causal_lm.py --param-tier nvme --optimizer-tier nvme --nvme-path /mnt/nvme/swap

Progress is a tqdm bar on a terminal and one line every --log-every steps elsewhere
(examples/progress.py); the engine's errors (a --nvme-path that cannot be created or
written, a budget too small) are one line, `error: ...`, exit status 2 (examples/cli.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

try:
    import offload
except ImportError:  # pragma: no cover - running from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import offload

from cli import add_tier_flags, engine_errors, make_swap_dir  # examples/cli.py
from progress import Progress  # examples/progress.py


def build_config(args: argparse.Namespace):
    """A transformers config object for the chosen architecture, tiny by default."""
    from transformers import GPT2Config, LlamaConfig

    if args.arch == "llama":
        return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                           intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.heads,
                           max_position_embeddings=args.seq, tie_word_embeddings=True)
    return GPT2Config(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers,
                      n_head=args.heads, n_positions=args.seq)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Train a transformers causal LM with offload")
    p.add_argument("--arch", choices=["llama", "gpt2"], default="llama",
                   help="model family, built from a config (no download)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (offload's units)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    p.add_argument("--seq", type=int, default=64, help="sequence length, tokens")
    p.add_argument("--batch", type=int, default=4, help="micro-batch size per rank")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="training precision (bf16 is for GPUs: slower than fp32 on most CPUs)")
    add_tier_flags(p)
    p.add_argument("--log-every", type=int, default=1,
                   help="steps between progress lines when stdout is not a terminal")
    args = p.parse_args(argv)
    with engine_errors():  # before the model is built: a bad path fails in a second
        if args.nvme_path and "nvme" in (args.param_tier, args.optimizer_tier):
            make_swap_dir(args.nvme_path, "--nvme-path")  # created here, checked by the engine

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(args))
    n_params = sum(p.numel() for p in model.parameters())
    with engine_errors():  # the engine's checks at the door: `error: ...`, exit 2
        config = offload.Config.from_dict({
            "offload": {"param_tier": args.param_tier, "optimizer_tier": args.optimizer_tier,
                        "nvme_path": args.nvme_path, "pinned_budget_bytes": args.pinned_budget,
                        "ram_budget_bytes": args.ram_budget},
            "optimizer": {"lr": args.lr, "weight_decay": 0.0},
            "precision": {"dtype": args.precision},
            "gradient_clipping": 1.0,
        })
        engine = offload.initialize(model, config)
    if engine.rank == 0:
        print(f"{type(engine.module).__name__}: {n_params / 1e6:.2f}M parameters in "
              f"{len(engine.units)} units, world size {engine.world_size}", flush=True)
    progress = Progress(args.steps, every=args.log_every) if engine.rank == 0 else None
    g = torch.Generator().manual_seed(100 + engine.rank)
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        out = engine(input_ids=ids, labels=ids)  # transformers shifts the labels itself
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
        if progress is not None:
            tok_s = args.batch * args.seq * engine.world_size / (time.perf_counter() - t0)
            mem = engine.memory_bytes()
            tiers = " ".join(f"{k} {v / 2**20:.1f}MiB" for k, v in mem.items())
            progress.update(step + 1, [f"loss {losses[-1]:.4f}", f"tok/s {tok_s:,.0f}", f"mem {tiers}"])
    if progress is not None:
        progress.close()
    engine.close()
    return {"params": n_params, "losses": losses}


if __name__ == "__main__":
    main()
