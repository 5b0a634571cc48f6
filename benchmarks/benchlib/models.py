"""The benchmark models and their batches, built identically on every rank from a seed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MODEL_NAMES = ("mlp", "gpt", "small")  # bench_ddp.py's default set
# asked for by name: host time per tensor (bench_ddp.py)
EXTRA_MODEL_NAMES = ("tiny",)
MODEL_TITLES = {
    "mlp": "MLP 8x Linear(1024,1024)",
    "gpt": "GPT 6L d256 V8192 (tied)",
    "small": "64x (Linear(128)+LayerNorm)",
    "tiny": "600x Linear(16,16) (1,200 tensors)",
}

GPT_SEQ = 64
GPT_BATCH = 4
GPT_VOCAB = 8192
GPT_SETTINGS = {"tied_embedding": True, "seq": GPT_SEQ, "batch": GPT_BATCH, "vocab": GPT_VOCAB}


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT whose output projection is tied to the token embedding (GPT-2 style)."""

    def __init__(self, vocab: int = GPT_VOCAB, d: int = 256, layers: int = 6, heads: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(GPT_SEQ, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(name: str) -> nn.Module:
    """A fresh model; seed the global generator first for a given init.

    Args:
        name: one of ``MODEL_NAMES``.
    """
    if name == "mlp":
        layers: list[nn.Module] = []
        for i in range(8):
            layers.append(nn.Linear(1024, 1024))
            if i < 7:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)
    if name == "small":
        layers = []
        for _ in range(64):
            layers += [nn.Linear(128, 128), nn.LayerNorm(128)]
        return nn.Sequential(*layers)
    if name == "gpt":
        return GPT()
    if name == "tiny":  # host time per tensor: 1,200 tensors of 16 or 256 elements, compute next to nothing
        return nn.Sequential(*[nn.Linear(16, 16) for _ in range(600)])
    raise ValueError(f"build_model(): unknown model {name!r}; expected one of {MODEL_NAMES + EXTRA_MODEL_NAMES}")


def make_batch(name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed (input, target) batch of ``rank``, different on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    if name == "mlp":
        return torch.randn(32, 1024, generator=g), torch.randn(32, 1024, generator=g)
    if name == "small":
        return torch.randn(16, 128, generator=g), torch.randn(16, 128, generator=g)
    if name == "tiny":
        return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    if name == "gpt":
        tokens = torch.randint(0, GPT_VOCAB, (GPT_BATCH, GPT_SEQ + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()
    raise ValueError(f"make_batch(): unknown model {name!r}; expected one of {MODEL_NAMES + EXTRA_MODEL_NAMES}")


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The model's training loss: cross-entropy for the GPT, MSE otherwise."""
    if name == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target)
    return F.mse_loss(out, target)
