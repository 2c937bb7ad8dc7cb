"""Fine-tune a Llama-shaped model from a local pretrained directory with the Hugging Face
Trainer and offload.

The script is a plain Trainer script with two changes (the lines marked `# offload`): the
model is loaded straight into the engine's shards (`from_pretrained` from
`offload.integrations.hf`, so no process ever holds the whole model), and the Trainer class
is `OffloadTrainer`, given an offload or DeepSpeed config. Everything else (accumulation,
clipping, the schedule, logging, save_steps, resume, save_model, LoRA) is the Trainer's.

    pip install -e ".[hf]"
    python examples/hf_trainer.py --model ./llama --make-model          # a random Llama-shaped checkpoint first
    python examples/hf_trainer.py --model ./llama --output-dir ./out --steps 20 --save-steps 10
    python examples/hf_trainer.py --model ./llama --output-dir ./out --steps 30 --resume
    python examples/hf_trainer.py --model ./llama --lora                # PEFT LoRA on q_proj/v_proj
    python examples/hf_trainer.py --model ./llama --config ds_config.json   # DeepSpeed's, "auto" values too
    python examples/hf_trainer.py --model ./llama --param-tier nvme --optimizer-tier nvme --nvme-path /mnt/nvme/swap
    torchrun --nproc-per-node 2 examples/hf_trainer.py --model ./llama

`--model` is any local Hugging Face causal-LM directory with safetensors weights (a
downloaded Llama, say); `--make-model` writes a random one of the size the flags give, a
stand-in when there is nothing to download. Nothing is downloaded: the text is a local file
(`--text`, this repository's README by default), tokenized as bytes (the made model's
vocabulary is the 256 byte values plus padding; a real model would bring its tokenizer).
The engine's errors are one line, `error: ...`, exit status 2 (examples/cli.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

try:
    import offload  # noqa: F401 - installed, or:
except ImportError:  # pragma: no cover - running from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cli import add_tier_flags, engine_errors, make_swap_dir  # examples/cli.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 256 + 1  # bytes + a padding id


def make_model(args: argparse.Namespace) -> None:
    """A random Llama-shaped pretrained directory at args.model (config.json + safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 128),
                      tie_word_embeddings=True, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                      pad_token_id=VOCAB - 1)
    LlamaForCausalLM(cfg).save_pretrained(args.model, max_shard_size="200MB")
    n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    print(f"wrote a random Llama-shaped checkpoint, {n / 1e6:.1f}M parameters: {args.model}", flush=True)


class ByteChunks(torch.utils.data.Dataset):
    """A text file as training samples: its bytes cut into sequences of `seq` tokens."""

    def __init__(self, path: str, seq: int) -> None:
        with open(path, "rb") as f:
            data = torch.tensor(list(f.read()), dtype=torch.long)
        n = len(data) // seq
        if n == 0:
            raise ValueError(f"--text {path} is shorter than one sequence of --seq {seq} bytes")
        self.samples = data[: n * seq].view(n, seq)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.samples[i]
        return {"input_ids": ids, "labels": ids.clone()}  # the model shifts the labels itself


def offload_config(args: argparse.Namespace) -> dict:
    """--config's contents (offload's or DeepSpeed's), else the tier flags' settings; the
    loop's settings (accumulation, clipping, precision, optimizer) come from the Trainer's
    arguments either way."""
    if args.config:
        return args.config  # a path: read by the trainer (JSON or YAML)
    return {"offload": {"param_tier": args.param_tier, "optimizer_tier": args.optimizer_tier,
                        "nvme_path": args.nvme_path, "pinned_budget_bytes": args.pinned_budget,
                        "ram_budget_bytes": args.ram_budget}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Fine-tune a local pretrained causal LM with the "
                                "Hugging Face Trainer and offload")
    p.add_argument("--model", required=True, help="local pretrained directory (config.json + safetensors)")
    p.add_argument("--make-model", action="store_true",
                   help="write a random Llama-shaped checkpoint at --model (sizes below) and exit")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (of the --make-model checkpoint)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (of the --make-model checkpoint)")
    p.add_argument("--intermediate", type=int, default=688, help="MLP size (of the --make-model checkpoint)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (of the --make-model checkpoint)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (of the --make-model checkpoint)")
    p.add_argument("--output-dir", default="hf_trainer_out", help="checkpoints and the saved model")
    p.add_argument("--text", default=os.path.join(ROOT, "README.md"), help="training text (bytes as tokens)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sample")
    p.add_argument("--batch", type=int, default=2, help="micro-batch size per rank")
    p.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (max_steps)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (cosine, 10%% warm-up)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: none)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute (for GPUs; slower on most CPUs)")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    p.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter (r=8 on q_proj, v_proj)")
    p.add_argument("--config", default=None,
                   help="offload or DeepSpeed config file (JSON/YAML; overrides the tier flags)")
    add_tier_flags(p)
    args = p.parse_args(argv)

    if args.make_model:
        make_model(args)
        return {"made": args.model}
    with engine_errors():  # a bad path or config fails here, in a second
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise FileNotFoundError(f"--model {args.model} has no config.json: pass a pretrained "
                                    "directory, or create one with --make-model")
        if args.nvme_path and "nvme" in (args.param_tier, args.optimizer_tier):
            make_swap_dir(args.nvme_path, "--nvme-path")
        dataset = ByteChunks(args.text, args.seq)

    from transformers import TrainingArguments

    from offload.integrations.hf import OffloadTrainer, from_pretrained  # offload

    with engine_errors():
        model = from_pretrained(args.model)  # offload: meta parameters, read into shards by the engine
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"]))
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="cosine", warmup_steps=0.1, max_grad_norm=args.max_grad_norm,
        weight_decay=0.01, bf16=args.bf16, logging_steps=1,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=[], use_cpu=not torch.cuda.is_available(), seed=0, disable_tqdm=not sys.stdout.isatty(),
    )
    trainer = OffloadTrainer(model=model, args=training_args, train_dataset=dataset,  # offload
                             offload_config=offload_config(args))
    with engine_errors():  # the engine is built (and a checkpoint loaded) when training starts
        result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(args.output_dir)  # config.json + safetensors (the adapter with --lora)
    engine = trainer.engine
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    summary = {"steps": trainer.state.global_step, "engine_steps": engine.global_steps,
               "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
               "train_loss": result.training_loss, "units": len(engine.units),
               "world_size": engine.world_size, "saved": os.path.abspath(args.output_dir)}
    if engine.rank == 0:
        print("done: " + json.dumps(summary), flush=True)
    engine.close()
    return summary


if __name__ == "__main__":
    main()
