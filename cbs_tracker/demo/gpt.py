"""A small GPT for the demo, the examples, the benchmarks and the proof experiment.

A nanoGPT / GPT-2 style decoder (pre-LayerNorm blocks, causal
``scaled_dot_product_attention``, head tied to the token embedding) with GPT-2's
initialisation. ``GPT(GPTConfig())`` is the small default; ``GPTConfig.preset("10m")``
the larger model of the overhead benchmark; :func:`make_adamw` the optimizer the
examples use. ``docs/design.md`` (Demo data) describes the architecture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "make_adamw"]

PresetName = Literal["demo", "10m", "gpt2-small", "gpt2-medium"]


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"GPTConfig: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"GPTConfig: {name}={value!r} is not allowed; it must be >= {minimum}")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`; checked at construction.

    Attributes:
        vocab_size: tokens in the vocabulary (256 for bytes).
        context_length: longest sequence the model accepts (positions embedded).
        n_layer: transformer blocks.
        d_model: residual stream width; must be divisible by ``n_head``.
        n_head: attention heads.
        dropout: dropout probability in ``[0, 1)`` on attention, residual
            outputs and embeddings (0 in every experiment here).
        bias: biases in Linear and LayerNorm layers.
        tie_weights: share the output head's weight with the token embedding.
    """

    vocab_size: int = 256
    context_length: int = 128
    n_layer: int = 2
    d_model: int = 128
    n_head: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "n_layer", "d_model", "n_head"):
            _check_int(name, getattr(self, name), 1)
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise TypeError(
                f"GPTConfig: dropout must be a float, got {type(self.dropout).__name__} "
                f"{self.dropout!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"GPTConfig: dropout={self.dropout!r} is not allowed; it must be in [0, 1)"
            )
        for name in ("bias", "tie_weights"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GPTConfig: {name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def preset(cls, name: PresetName, **overrides: Any) -> GPTConfig:
        """A named configuration, optionally with fields overridden.

        Args:
            name: ``"demo"`` (the defaults: 2 layers, width 128, 4 heads,
                context 128; 0.45M parameters) or ``"10m"`` (6 layers, width
                384, 6 heads, context 256; 10.8M parameters, for benchmarks
                that need at least 10M); ``"gpt2-small"`` (12 layers, width 768, 12
                heads, context 1,024, GPT-2's vocabulary of 50,257: 124.4M parameters)
                or ``"gpt2-medium"`` (24 layers, width 1,024, 16 heads: 354.8M), GPT-2's
                shapes for measuring the tracker at the sizes people pretrain.
            **overrides: fields to change, e.g. ``context_length=512``.
        """
        presets: dict[str, dict[str, Any]] = {
            "demo": {},
            "10m": {"n_layer": 6, "d_model": 384, "n_head": 6, "context_length": 256},
            "gpt2-small": {"vocab_size": 50257, "context_length": 1024, "n_layer": 12, "d_model": 768, "n_head": 12},
            "gpt2-medium": {"vocab_size": 50257, "context_length": 1024, "n_layer": 24, "d_model": 1024, "n_head": 16},
        }
        if name not in presets:
            raise ValueError(
                f"GPTConfig.preset: name={name!r} is not allowed; choose one of {sorted(presets)}"
            )
        return cls(**{**presets[name], **overrides})

    def num_parameters(self) -> int:
        """The parameters :class:`GPT` of this configuration has (a tied weight once), counted from the
        shape without building the model."""
        d, bias = self.d_model, int(self.bias)
        per_block = (
            2 * d * (1 + bias)  # ln_1, ln_2
            + d * 3 * d + bias * 3 * d + d * d + bias * d  # attention: c_attn, c_proj
            + d * 4 * d + bias * 4 * d + 4 * d * d + bias * d  # MLP: c_fc, c_proj
        )
        embeddings = (self.vocab_size + self.context_length) * d
        head = 0 if self.tie_weights else self.vocab_size * d
        return embeddings + self.n_layer * per_block + d * (1 + bias) + head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (one fused QKV projection)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.c_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """``Linear(d, 4d) -> GELU -> Linear(4d, d)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model (see the module docstring).

    Args:
        config: the shape; ``GPTConfig()`` when ``None``.
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        config = GPTConfig() if config is None else config
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT: config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.context_length, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual output projections by 1/sqrt(2 * n_layer) so the
        # residual stream's variance at init does not grow with depth.
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Distinct trainable parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        ignore_index: int = -100,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position and, given targets, the mean cross-entropy.

        Args:
            idx: token ids, integer tensor of shape ``(B, T)`` with
                ``T <= context_length``.
            targets: next-token ids, shape ``(B, T)``; positions equal to
                ``ignore_index`` do not contribute.
            ignore_index: target value that marks a position without a label.

        Returns:
            ``(logits, loss)``: logits of shape ``(B, T, vocab_size)``;
            ``loss = mean over positions with targets != ignore_index of
            -log softmax(logits)[target]`` in nats (NaN if every position is
            ignored, as :func:`torch.nn.functional.cross_entropy`), or ``None``
            without targets.
        """
        if idx.dim() != 2:
            raise ValueError(f"GPT.forward: idx must have shape (B, T), got {tuple(idx.shape)}")
        b, t = idx.shape
        if t > self.config.context_length:
            raise ValueError(
                f"GPT.forward: sequence length {t} exceeds context_length="
                f"{self.config.context_length}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        if targets.shape != idx.shape:
            raise ValueError(
                f"GPT.forward: targets shape {tuple(targets.shape)} differs from idx shape "
                f"{tuple(idx.shape)}"
            )
        loss = F.cross_entropy(
            logits.reshape(b * t, -1), targets.reshape(b * t), ignore_index=ignore_index
        )
        return logits, loss


def make_adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    *,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (nanoGPT's grouping).

    Parameters with ``dim >= 2`` (Linear weights, embeddings, the tied head)
    get ``weight_decay``; biases and LayerNorm parameters get 0. Group 0 is the
    decayed group, group 1 the other.

    Args:
        model: the model whose trainable parameters are optimised.
        lr: learning rate (``> 0``).
        weight_decay: decoupled weight decay for the matrices (``>= 0``).
        betas: Adam's moment decays (nanoGPT's ``(0.9, 0.95)`` by default).
        eps: Adam's denominator term.

    Returns:
        A :class:`torch.optim.AdamW` with two parameter groups.
    """
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"make_adamw: {name} must be a float, got {type(value).__name__} {value!r}"
            )
    if not lr > 0:
        raise ValueError(f"make_adamw: lr={lr!r} is not allowed; it must be > 0")
    if not weight_decay >= 0:
        raise ValueError(
            f"make_adamw: weight_decay={weight_decay!r} is not allowed; it must be >= 0"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": float(weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=float(lr), betas=betas, eps=eps)
