"""Train a Hugging Face Transformers causal LM with offload (nothing is downloaded).

The model comes from `AutoModelForCausalLM.from_config` with a config built in code (a
tiny Llama or GPT-2 by default; scale it up with the flags); its decoder layers
(an `nn.ModuleList`) become offload's units with no extra wiring. Install the optional
extra first: `pip install "offload[hf]"` (or `pip install transformers`).

    python examples/hf_causal_lm.py --arch llama --steps 5
    python examples/hf_causal_lm.py --arch gpt2 --layers 4 --hidden 256 --precision bf16
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py
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
    p.add_argument("--arch", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--param-tier", choices=["device", "cpu", "nvme"], default="cpu")
    p.add_argument("--optimizer-tier", choices=["cpu", "nvme"], default="cpu")
    p.add_argument("--nvme-path", default=None)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(args))
    n_params = sum(p.numel() for p in model.parameters())
    config = offload.Config.from_dict({
        "offload": {"param_tier": args.param_tier, "optimizer_tier": args.optimizer_tier,
                    "nvme_path": args.nvme_path},
        "optimizer": {"lr": args.lr, "weight_decay": 0.0},
        "precision": {"dtype": args.precision},
        "gradient_clipping": 1.0,
    })
    engine = offload.initialize(model, config)
    if engine.rank == 0:
        print(f"{type(engine.module).__name__}: {n_params / 1e6:.2f}M parameters in "
              f"{len(engine.units)} units, world size {engine.world_size}", flush=True)
    g = torch.Generator().manual_seed(100 + engine.rank)
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        out = engine(input_ids=ids, labels=ids)  # transformers shifts the labels itself
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
        if engine.rank == 0:
            tok_s = args.batch * args.seq * engine.world_size / (time.perf_counter() - t0)
            print(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f} tok/s {tok_s:,.0f}", flush=True)
    engine.close()
    return {"params": n_params, "losses": losses}


if __name__ == "__main__":
    main()
