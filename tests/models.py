"""Small models and batches for the parity tests, built the same on every rank."""

from __future__ import annotations

import torch
from torch import nn


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


def _floats(*shape: int):
    return lambda g, n: torch.randn(n, *shape, generator=g)


def _tokens(vocab: int, length: int):
    return lambda g, n: torch.randint(0, vocab, (n, length), generator=g)


# name -> (constructor, batch maker(generator, batch size), loss of the output)
MODELS = {
    "mlp": (MLP, _floats(32), lambda out, batch: out.pow(2).mean()),
    "conv": (ConvNet, _floats(3, 8, 8), lambda out, batch: out.pow(2).mean()),
    "tied": (
        TiedLM,
        _tokens(50, 6),
        lambda out, batch: nn.functional.cross_entropy(out[:, :-1].reshape(-1, 50), batch[:, 1:].reshape(-1)),
    ),
    "encoder": (Encoder, _floats(5, 16), lambda out, batch: out.pow(2).mean()),
    "wide": (WideMLP, _floats(256), lambda out, batch: out.pow(2).mean()),
}
