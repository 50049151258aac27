"""A training loop shaped like nanoGPT's ``train.py``, small enough for a CPU: a GPT with tied
embeddings, AdamW with decay and no-decay groups, a cosine learning rate, gradient accumulation by
assigning ``require_backward_grad_sync``, ``GradScaler``, ``clip_grad_norm_`` and an evaluation that
averages the loss over ranks. ``--overlap`` wraps with OverlapDDP instead of DDP.

    torchrun --standalone --nproc-per-node 2 -m overlapddp.sanitize tests/sanitize/scripts/nanogpt_loop.py
"""

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout's overlapddp

from overlapddp import OverlapDDP  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--overlap", action="store_true")
parser.add_argument("--iters", type=int, default=4)
args = parser.parse_args()

block_size, vocab_size, n_embd, n_head, n_layer = 16, 64, 32, 4, 2
batch_size, gradient_accumulation_steps, grad_clip = 4, 2, 1.0
learning_rate, min_lr, warmup_iters, lr_decay_iters = 6e-4, 6e-5, 2, 10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = min(1.0, (it - warmup_iters) / (lr_decay_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def get_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(vocab_size, (batch_size, block_size + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
torch.manual_seed(1337)
model = GPT()
optimizer = model.configure_optimizers()
scaler = torch.amp.GradScaler("cpu", enabled=False)
model = OverlapDDP(model) if args.overlap else DistributedDataParallel(model)
raw_model = model.module
generator = torch.Generator().manual_seed(1337 + rank)

X, Y = get_batch(generator)
for iter_num in range(args.iters):
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num)
    if iter_num % 2 == 1:  # evaluate: every rank's mean loss, averaged
        model.eval()
        with torch.no_grad():
            losses = torch.stack([raw_model(*get_batch(generator)) for _ in range(2)])
        mean = losses.mean()
        dist.all_reduce(mean)
        model.train()
    for micro_step in range(gradient_accumulation_steps):
        model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        loss = model(X, Y) / gradient_accumulation_steps
        X, Y = get_batch(generator)
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

dist.destroy_process_group()
