"""Small models the shipped plan specs use (factories named by dotted path in specs/plans)."""

from __future__ import annotations

import torch
from torch import nn


class LinearChain(nn.Module):
    """Linear-Linear: a two-layer MLP without an activation (handlers for linear only)."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class MLPBlock(nn.Module):
    """Linear-GELU-Linear."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_in, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def linear_chain(d_in: int = 32, d_hidden: int = 64, d_out: int = 32) -> nn.Module:
    return LinearChain(d_in, d_hidden, d_out)


def mlp_block(d_in: int = 32, d_hidden: int = 64) -> nn.Module:
    return MLPBlock(d_in, d_hidden)


class TransformerBlock(nn.Module):
    """Pre-norm block: LayerNorm, multi-head attention written with matmul/softmax, a residual
    add, LayerNorm, Linear-GELU-Linear, a residual add. The projections that end a parallel
    region (out, fc2) have no bias, so row-parallel strategies apply to them."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, d_hidden: int = 64) -> None:
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_model, bias=False)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.reshape(b, s, self.n_heads, self.d_head).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        h = self.ln1(x)
        q, k, v = self._heads(self.q(h)), self._heads(self.k(h)), self._heads(self.v(h))
        scores = torch.matmul(q, k.transpose(-2, -1)) / (self.d_head ** 0.5)
        attn = torch.matmul(torch.softmax(scores, dim=-1), v)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, c))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class SmallCNN(nn.Module):
    """Conv-ReLU-MaxPool-Flatten-Linear."""

    def __init__(self, channels: int = 8, classes: int = 16, size: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels * (size // 2) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(self.relu(self.conv(x)))))


def transformer_block(d_model: int = 32, n_heads: int = 4, d_hidden: int = 64) -> nn.Module:
    return TransformerBlock(d_model, n_heads, d_hidden)


def small_cnn(channels: int = 8, classes: int = 16, size: int = 8) -> nn.Module:
    return SmallCNN(channels, classes, size)


class RecurrentLM(nn.Module):
    """A recurrent language model: token embedding, an LSTM (batch first), a linear head. The
    exported ``aten.lstm.input`` has no spec: it is decomposed into its cell's core ops
    (linear, sigmoid, tanh, mul, add, slices) and those are planned and verified."""

    def __init__(self, vocab: int = 128, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))
        return self.head(hidden)


def recurrent_lm(vocab: int = 128, width: int = 128) -> nn.Module:
    return RecurrentLM(vocab, width)
