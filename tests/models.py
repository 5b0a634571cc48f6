"""Models and data the test files share, built the same on every rank.

``MODELS``: the parity models, each with its batch maker and loss.
``Branches`` and ``data``: the model whose used parameters change by rank or
by step, for the dynamic-graph, accumulation and random-graph tests.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

# Bucket caps that split the MLP (width 32) into three or more buckets.
TINY_BUCKETS = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0005}
TINY_DIM_BUCKETS = {"bucket_cap_mb": 0.0002, "first_bucket_cap_mb": 0.0001}  # about one DIM-wide Linear per bucket


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class TiedLM(nn.Module):
    """Embedding shared with the output projection (one parameter, two uses)."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


class Encoder(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


class WideMLP(nn.Module):
    """About 1.1 M parameters: several buckets at the default 25 MiB cap."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ModelCase(NamedTuple):
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator, int], torch.Tensor]  # (generator, batch size) -> batch
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, batch) -> loss


def _floats(*shape: int) -> Callable[[torch.Generator, int], torch.Tensor]:
    return lambda g, n: torch.randn(n, *shape, generator=g)


def _tokens(vocab: int, length: int) -> Callable[[torch.Generator, int], torch.Tensor]:
    return lambda g, n: torch.randint(0, vocab, (n, length), generator=g)


def _square_mean(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _next_token_loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out[:, :-1].reshape(-1, 50), batch[:, 1:].reshape(-1))


MODELS = {
    "mlp": ModelCase(MLP, _floats(32), _square_mean),
    "conv": ModelCase(ConvNet, _floats(3, 8, 8), _square_mean),
    "tied": ModelCase(TiedLM, _tokens(50, 6), _next_token_loss),
    "encoder": ModelCase(Encoder, _floats(5, 16), _square_mean),
    "wide": ModelCase(WideMLP, _floats(256), _square_mean),
}


# -- a graph that changes by rank and by step ------------------------------------

DIM = 8


def data(rank: int, step: int, rows: int = 4) -> torch.Tensor:
    """This rank's input at this step (a different seed for every pair)."""
    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(1000 * step + rank))


class Branches(nn.Module):
    """A trunk, two branches, an occasional head and four experts."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(DIM, DIM)
        self.branch_a = nn.Linear(DIM, DIM)
        self.branch_b = nn.Linear(DIM, DIM)
        self.aux_head = nn.Linear(DIM, 1)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))
        self.never = nn.Linear(DIM, DIM)  # no rank ever uses it

    def forward(self, x: torch.Tensor, branch: str = "a", expert: Optional[int] = None) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        h = self.branch_a(h) if branch == "a" else self.branch_b(h)
        if expert is not None:
            h = self.experts[expert](h)
        return h

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.branch_b(torch.tanh(self.trunk(x))))
