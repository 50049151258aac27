"""Train a small causal transformer LM on random tokens with OverlapDDP (or stock DDP, for comparison).

Launch (gloo on CPU, nccl when CUDA is available; --standalone picks a free port):

    torchrun --standalone --nproc-per-node 2 examples/train_lm.py --steps 2

Gradient accumulation is written as in nanoGPT: the loop assigns
``model.require_backward_grad_sync = (micro == last)`` instead of entering ``model.no_sync()``,
and the raw model is reached through ``model.module``. ``--ddp`` runs the same loop with torch's
DistributedDataParallel. Rank 0 prints its own loss each step.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# Make the checkout's ``overlapddp`` importable without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import setup  # noqa: E402

from overlapddp import OverlapDDP  # noqa: E402

# Either wrapper: the loop below uses only what they share.
Wrapped = OverlapDDP | DistributedDataParallel


@dataclass(frozen=True)
class LMConfig:
    """Model shape; the defaults train in well under a second per step on one CPU thread."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2


class TinyLM(nn.Module):
    """Token and position embeddings, causal encoder layers, a vocabulary head."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.token_embed = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embed = nn.Embedding(config.seq_len, config.d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                config.d_model, config.n_heads, 4 * config.d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab); position t only sees positions <= t."""
        seq_len = tokens.size(1)
        positions = torch.arange(seq_len, device=tokens.device)
        # Built per call, not registered as a buffer, so that the wrapper has no buffer to broadcast.
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len, device=tokens.device)
        hidden = self.token_embed(tokens) + self.position_embed(positions)
        for layer in self.layers:
            hidden = layer(hidden, src_mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per rank")
    parser.add_argument(
        "--token-weighted",
        action="store_true",
        help="uneven batches per rank, reduced as the global per-token mean (OverlapDDP.count_tokens)",
    )
    parser.add_argument("--seq-len", type=int, default=LMConfig.seq_len)
    parser.add_argument("--layers", type=int, default=LMConfig.n_layers)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ddp", action="store_true", help="use torch's DistributedDataParallel instead")
    args = parser.parse_args()
    if args.token_weighted and args.ddp:
        parser.error("--token-weighted needs OverlapDDP (stock DDP has no token-weighted reduction)")
    if args.grad_accum < 1:
        parser.error(f"--grad-accum must be at least 1, got {args.grad_accum}")
    return args


def build_model(args: argparse.Namespace, config: LMConfig, device: torch.device) -> Wrapped:
    """The LM, wrapped; the wrapper broadcasts rank 0's initial weights."""
    torch.manual_seed(args.seed)
    net = TinyLM(config).to(device)
    wrapper = DistributedDataParallel if args.ddp else OverlapDDP
    device_ids = [device.index] if device.type == "cuda" else None
    return wrapper(net, device_ids=device_ids)


def get_batch(
    config: LMConfig, batch_size: int, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences; the targets are the inputs shifted left by one."""
    tokens = torch.randint(config.vocab_size, (batch_size, config.seq_len + 1), generator=generator)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(
    model: Wrapped,
    optimizer: torch.optim.Optimizer,
    config: LMConfig,
    args: argparse.Namespace,
    generator: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """One optimizer step over ``args.grad_accum`` micro-batches; returns the mean loss, detached."""
    total = torch.zeros((), device=device)
    tokens = 0
    last = args.grad_accum - 1
    # With --token-weighted, rank r reads r more sequences per micro-batch: uneven token counts.
    batch_size = args.batch_size + (dist.get_rank() if args.token_weighted else 0)
    for micro in range(args.grad_accum):
        # Only the last micro-batch's backward reduces; the others accumulate into .grad locally.
        model.require_backward_grad_sync = micro == last
        inputs, targets = get_batch(config, batch_size, generator, device)
        if args.token_weighted:
            # Sum of token losses; the wrapper divides by the token count summed over all ranks.
            model.count_tokens(targets.numel())
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
            tokens += targets.numel()
        else:
            # Every micro-batch has the same token count, so this mean of means is the per-token mean.
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()) / args.grad_accum
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / tokens if args.token_weighted else total


def train(args: argparse.Namespace, device: torch.device) -> None:
    """Build, wrap and train; rank 0 prints its loss per step."""
    rank = dist.get_rank()
    config = LMConfig(seq_len=args.seq_len, n_layers=args.layers)
    model = build_model(args, config, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # A different token stream on each rank, as if each read its own shard.
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    if rank == 0:
        n_params = sum(p.numel() for p in model.module.parameters())
        wrapper = type(model).__name__
        print(f"{wrapper}(TinyLM, {n_params / 1e6:.2f}M parameters) on {dist.get_world_size()} x {device.type}")
    model.train()
    for step in range(args.steps):
        began = time.perf_counter()
        loss = train_step(model, optimizer, config, args, generator, device).item()
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}, {1000 * (time.perf_counter() - began):.0f} ms", flush=True)


def main() -> None:
    args = parse_args()
    device = setup()
    train(args, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
