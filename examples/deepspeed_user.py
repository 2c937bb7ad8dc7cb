"""A DeepSpeed user's training script, switched to offload by changing one import.

Everything below is written against DeepSpeed's API (`deepspeed.initialize`,
`add_config_arguments`, `init_distributed`, a DeepSpeed JSON config with ZeRO-3 and CPU
offload, `model_engine.backward/step/save_checkpoint`); the only offload-specific line is
the import. Run it as a DeepSpeed user would:

    python examples/deepspeed_user.py --steps 10
    python examples/deepspeed_user.py --deepspeed_config my_ds_config.json
    torchrun --nproc-per-node 2 examples/deepspeed_user.py
    python examples/deepspeed_user.py --nvme-path /mnt/nvme/swap   # ZeRO-Infinity: both on NVMe

Errors of the engine's checks (a --nvme-path that cannot be created or written) are one
line, `error: ...`, exit status 2 (examples/cli.py), not a traceback.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_gpt's GPT
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout

import offload.compat.deepspeed as deepspeed  # was: import deepspeed
from cli import engine_errors, make_swap_dir  # examples/cli.py
from train_gpt import GPT

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    # bf16 on a GPU; fp32 on a CPU, where torch's bf16 matmuls without AMX are tens of times
    # slower than fp32 (the README: "fp32 on a CPU, bf16 on a GPU").
    "bf16": {"enabled": torch.cuda.is_available()},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                 "warmup_num_steps": 4}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "steps_per_print": 100,
}


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="GPT with DeepSpeed ZeRO-3 + CPU offload")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=64, help="width (4 heads)")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    parser.add_argument("--seq", type=int, default=32, help="sequence length, tokens")
    parser.add_argument("--samples", type=int, default=256, help="synthetic dataset size")
    parser.add_argument("--save-dir", default=None, help="save a training checkpoint here at the end")
    parser.add_argument("--save-model", default=None,
                        help="save the consolidated weights (pytorch_model.bin) here at the end")
    parser.add_argument("--nvme-path", default=None,
                        help="put parameters and optimizer state on NVMe under this directory "
                             "(the built-in config's offload_param/offload_optimizer device "
                             "'nvme'); created if missing")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.nvme_path and args.deepspeed_config:
        parser.error("--nvme-path changes the built-in config; with --deepspeed_config set "
                     "zero_optimization.offload_param/offload_optimizer.nvme_path in that file")
    return args


def ds_config(args: argparse.Namespace) -> dict:
    """DS_CONFIG, with both offloads on NVMe under --nvme-path when it is given."""
    config = copy.deepcopy(DS_CONFIG)
    if args.nvme_path:
        for key in ("offload_param", "offload_optimizer"):
            config["zero_optimization"][key] = {"device": "nvme", "nvme_path": args.nvme_path,
                                                "pin_memory": True}
    return config


def make_dataset(args: argparse.Namespace) -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, args.vocab, (args.samples, args.seq + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def main(argv=None):
    args = get_args(argv)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d_model, args.layers, n_head=4, seq=args.seq, qkv_bias=True)
    with engine_errors():  # the engine's checks at the door: `error: ...`, exit 2
        if args.nvme_path:
            make_swap_dir(args.nvme_path, "--nvme-path")  # created here, checked by the engine
        model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
            args=args,
            model=model,
            model_parameters=model.parameters(),
            training_data=make_dataset(args),
            config=None if args.deepspeed_config else ds_config(args),
        )
    rank = model_engine.global_rank
    if rank == 0:
        print(f"train batch size {model_engine.train_batch_size()} = micro "
              f"{model_engine.train_micro_batch_size_per_gpu()} x accumulation "
              f"{model_engine.gradient_accumulation_steps()} x world {model_engine.world_size}")
    model_engine.train()
    done = False
    epoch = 0
    while not done:
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(model_engine.device), labels.to(model_engine.device)
            loss = model_engine(inputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            if model_engine.was_step_applied() and rank == 0:
                print(f"step {model_engine.global_steps} loss {loss.item():.4f} "
                          f"lr {model_engine.get_lr()[0]:.2e}", flush=True)
            if model_engine.global_steps >= args.steps:
                done = True
                break
        epoch += 1
    if args.save_dir:
        model_engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch})
    if args.save_model:  # needs zero_optimization.stage3_gather_16bit_weights_on_model_save
        model_engine.save_16bit_model(args.save_model)
    return model_engine


if __name__ == "__main__":
    main()
