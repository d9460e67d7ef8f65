"""Train the small character-level LaCT language model that ``ttt2la demo`` converts.

The text is the Python standard library's own source files (every Python install has them),
split into train and validation by file (``ttt2la.zoo.trained.split_stdlib``); tokens are bytes.
The model is ``ttt2la.zoo.TinyLaCTLM``: its only token mixers are LaCT layers, so everything a
token knows about the text before its own chunk comes through the fast weights the TTT loop
writes. Seeded and deterministic on one machine; the defaults (400 steps of 16 x 256 bytes, one
thread) take about ten minutes on an idle CPU core — the committed weights took 26 minutes on a
2-core machine other jobs were loading to a load average of 10-17. Writes ``NAME.safetensors``,
``NAME.config.json`` (the factory's keyword arguments) and ``NAME.json`` (the card: factory,
vocabulary, data, training facts, validation loss).

    python examples/train_char_lm.py                       # into ttt2la/zoo/weights/
    python examples/train_char_lm.py --steps 50 --out /tmp/lm   # a quick try
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time

from pathlib import Path

import torch
import torch.nn.functional as F

from ttt2la.zoo import TinyLaCTLM
from ttt2la.zoo.trained import (SPLIT_SEED, VOCAB_SIZE, WEIGHTS_DIR, next_token_loss,
                                read_tokens, split_stdlib, stdlib_root, unigram_loss,
                                validation_sequences)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=WEIGHTS_DIR, help="output directory")
    p.add_argument("--name", default="char_lm", help="checkpoint name (char_lm)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256, help="training sequence length")
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=16, help="TTT chunk size")
    p.add_argument("--lr", type=float, default=4e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: reproducible, and fastest on a shared machine)")
    return p.parse_args(argv)


def model_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``TinyLaCTLM``: LaCT layers with momentum and weight norm, Θ updated,
    no Muon (tracing Newton–Schulz makes conversion slow, and the demo converts at start-up)."""
    return dict(vocab_size=VOCAB_SIZE, d_model=args.d_model, n_layers=args.layers,
                num_heads=args.heads, chunk_size=args.chunk, muon=False, momentum=True,
                weight_norm=True, update_theta=True)


def batches(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator):
    """Endless ``[batch, length + 1]`` windows of ``stream`` at seeded random offsets."""
    offsets = torch.arange(length + 1)
    while True:
        starts = torch.randint(0, stream.numel() - length - 1, (batch, 1), generator=generator)
        yield stream[starts + offsets].long()


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_files, val_files = split_stdlib(seed=SPLIT_SEED)
    stream = read_tokens(train_files)
    val = validation_sequences(args.eval_sequences, args.length)
    print(f"standard library {stdlib_root()}: {len(train_files)} training files "
          f"({stream.numel():,} bytes), {len(val_files)} held out; validating on "
          f"{val.shape[0]} held-out sequences of {args.length}", flush=True)

    model = TinyLaCTLM(**model_kwargs(args))
    # the embedding is tied to the LM head: unit-variance rows would start with logits of
    # standard deviation sqrt(d_model), and a loss of tens of nats
    torch.nn.init.normal_(model.embed.weight, std=0.02)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"TinyLaCTLM: {n_params:,} parameters, chunk {args.chunk} "
          f"({args.length // args.chunk} chunks per sequence)", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    data = batches(stream, args.batch, args.length, torch.Generator().manual_seed(args.seed))
    history, start, running = [], time.perf_counter(), None
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        rows = next(data)
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), rows[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % 25 == 0:
            elapsed = time.perf_counter() - start
            print(f"step {step + 1:5d}/{args.steps}  train loss {running:.3f}  "
                  f"lr {learning_rate(step, args):.2e}  {elapsed:6.0f} s", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            v = next_token_loss(model, val)
            model.train()
            history.append({"step": step + 1, "validation_loss": round(v, 4)})
            print(f"step {step + 1:5d}  validation loss {v:.4f} nats/byte "
                  f"(perplexity {math.exp(v):.2f})", flush=True)
    seconds = time.perf_counter() - start
    return {"model": model.eval(), "parameters": n_params, "seconds": seconds,
            "history": history, "validation": val, "train_files": len(train_files),
            "validation_files": len(val_files), "train_bytes": stream.numel()}


def loss_without_ttt_updates(model: torch.nn.Module, val: torch.Tensor) -> float:
    """Validation loss with every per-token learning rate pushed to zero (softplus of a very
    negative number), so the fast weights keep their initial values: what the TTT loop adds."""
    frozen = copy.deepcopy(model)
    for block in frozen.blocks:
        block.ttt.base_lr_inv = -1e4
    return next_token_loss(frozen, val)


def save(result: dict, args: argparse.Namespace) -> None:
    from safetensors.torch import save_model

    args.out.mkdir(parents=True, exist_ok=True)
    weights, config = f"{args.name}.safetensors", f"{args.name}.config.json"
    save_model(result["model"], str(args.out / weights))
    (args.out / config).write_text(json.dumps(model_kwargs(args), indent=2) + "\n")
    val = result["validation"]
    final = result["history"][-1]["validation_loss"]
    card = {
        "factory": "ttt2la.zoo:TinyLaCTLM",
        "config": config,
        "weights": weights,
        "parameters": result["parameters"],
        "vocabulary": {"kind": "bytes", "size": VOCAB_SIZE,
                       "description": "UTF-8 bytes; files joined by byte 0"},
        "data": {"text": "the Python standard library's .py files (site-packages excluded)",
                 "split": "by file: crc32(f'{seed}:{path relative to the standard library}') "
                          "% 10 == 0 is held out",
                 "split_seed": SPLIT_SEED, "python": platform.python_version(),
                 "train_files": result["train_files"], "train_bytes": result["train_bytes"],
                 "validation_files": result["validation_files"]},
        "training": {"steps": args.steps, "batch": args.batch, "sequence_length": args.length,
                     "tokens": args.steps * args.batch * args.length, "optimizer": "AdamW",
                     "peak_lr": args.lr, "warmup": args.warmup, "schedule": "cosine to 0.1",
                     "seed": args.seed, "threads": args.threads,
                     "seconds": round(result["seconds"]), "torch": torch.__version__,
                     "script": "examples/train_char_lm.py"},
        "validation": {"sequences": int(val.shape[0]), "sequence_length": args.length,
                       "loss": final, "perplexity": round(math.exp(final), 3),
                       "unigram_loss": round(unigram_loss(val), 4),
                       "loss_without_ttt_updates": round(
                           loss_without_ttt_updates(result["model"], val), 4),
                       "history": result["history"]},
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(card, indent=2) + "\n")
    print(f"wrote {args.out / weights}, {config} and {args.name}.json: validation loss "
          f"{final:.4f} nats/byte against {card['validation']['unigram_loss']:.4f} for the "
          f"held-out text's own unigram distribution", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    save(train(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
