"""A video transformer: tubelet embedding, space-time attention, a classification head.

The model is a flat sequence of layers (embedding, blocks, head), each taking
and returning one tensor, so that DeepSpeed's ``PipelineModule`` can cut it
into stages anywhere between blocks. Attention is joint over all space-time
tokens (ViViT's "joint", VideoMAE) or divided, time then space (TimeSformer).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

# ImageNet statistics, as VideoMAE and torchvision's video models use.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True)
class VideoViTConfig:
    num_classes: int
    frames: int = 16
    image_size: int = 224
    depth: int = 12
    width: int = 768
    heads: int = 12
    mlp_dim: int = 3072
    tubelet: tuple[int, int, int] = (2, 16, 16)
    attention: Literal["joint", "divided"] = "joint"
    position: Literal["learned", "sincos", "sincos-1d"] = "learned"
    """A learned table, fixed sine-cosine codes over (time, height, width), or VideoMAE's fixed codes over the
    flattened token index."""
    pool: Literal["mean", "cls"] = "mean"
    drop_path: float = 0.0
    qkv_bias: Literal["qkv", "qv"] = "qkv"
    """Biases of the attention's input projection: on q, k and v, or on q and v only (VideoMAE: k has none)."""
    head_norm: Literal["tokens", "pooled"] = "tokens"
    """The head's norm before pooling (over every token), or after it (VideoMAE's fc_norm with mean pooling)."""
    layer_scale: float = 0.0
    """Per-channel scales on each residual branch (CaiT's layer scale), starting at this value; 0: none."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon in the blocks (VideoMAE: 1e-6, its Hugging Face port: 1e-12)."""
    head_norm_eps: float | None = None
    """LayerNorm epsilon of the head's norm; None: norm_eps."""

    @property
    def grid(self) -> tuple[int, int, int]:
        t, p, q = self.tubelet
        return self.frames // t, self.image_size // p, self.image_size // q

    @property
    def tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w


# depth, width, heads, MLP width: the ViT sizes (giant as ViT-g/14).
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (12, 192, 3, 768),
    "small": (12, 384, 6, 1536),
    "base": (12, 768, 12, 3072),
    "large": (24, 1024, 16, 4096),
    "huge": (32, 1280, 16, 5120),
    "giant": (40, 1408, 16, 6144),
}


class Embedding(nn.Module):
    """uint8 clips ``[B, T, H, W, 3]`` to tokens ``[B, N(+1), D]``: normalise, tubelets, position."""

    def __init__(self, cfg: VideoViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1, 1) * 255, persistent=False)
        self.proj = nn.Conv3d(3, cfg.width, kernel_size=cfg.tubelet, stride=cfg.tubelet)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.width)) if cfg.pool == "cls" else None
        if cfg.position == "learned":
            self.position = nn.Parameter(torch.randn(1, cfg.tokens, cfg.width) * 0.02)
        else:
            self.register_buffer("position", fixed_positions(cfg, cfg.grid), persistent=False)
        init_weights(self)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        x = clips.permute(0, 4, 1, 2, 3).to(self.proj.weight.dtype)
        x = (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)
        x = self.proj(x)  # [B, D, t, h, w]
        grid = tuple(x.shape[2:])
        x = x.flatten(2).transpose(1, 2)
        x = x + self._position(grid).to(x.dtype)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        return x.contiguous()

    def _position(self, grid: tuple[int, ...]) -> torch.Tensor:
        if grid == self.cfg.grid:
            return self.position
        if self.cfg.position != "learned":  # computed codes: this grid's own
            return fixed_positions(self.cfg, grid).to(self.position.device)
        # Another input size than the training one: interpolate the position table over the new grid.
        return interpolate_positions(self.position, self.cfg.grid, grid)


def interpolate_positions(table: torch.Tensor, grid: tuple[int, ...], new_grid: tuple[int, ...]) -> torch.Tensor:
    """A position table ``[1, t*h*w, D]`` over ``grid``, trilinearly resampled over ``new_grid``."""
    d = table.shape[-1]
    table = table.reshape(1, *grid, d).permute(0, 4, 1, 2, 3)
    table = F.interpolate(table, size=tuple(new_grid), mode="trilinear", align_corners=False)
    return table.permute(0, 2, 3, 4, 1).reshape(1, -1, d)


def fit_positions(table: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor | None:
    """A learned position table from training at another frame size, resampled over ``grid``.

    The table does not record its grid: as VideoMAE does when it fine-tunes at another resolution,
    it is taken to have the same time steps and square frames. None when its length does not fit that.
    """
    t = grid[0]
    side = round(math.sqrt(table.shape[1] / t))
    if t * side * side != table.shape[1]:
        return None
    return interpolate_positions(table, (t, side, side), grid)


def fixed_positions(cfg: VideoViTConfig, grid: tuple[int, ...]) -> torch.Tensor:
    """The computed position codes of ``cfg.position`` over ``grid``."""
    if cfg.position == "sincos-1d":
        return sincos_1d(math.prod(grid), cfg.width)
    return sincos_3d(tuple(grid), cfg.width)


def sincos_1d(count: int, width: int) -> torch.Tensor:
    """VideoMAE's fixed codes ``[1, count, width]``: channel j of token i is sin (j even) or cos (j odd) of
    i / 10000^(2 floor(j/2) / width), the tokens in (time, height, width) order."""
    position = torch.arange(count, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(width, dtype=torch.float64)
    angle = position / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / width)
    table = torch.where(j.long() % 2 == 0, angle.sin(), angle.cos())
    return table.float().unsqueeze(0)


def sincos_3d(grid: tuple[int, int, int], width: int) -> torch.Tensor:
    """Fixed sine-cosine position codes over (time, height, width), ``[1, t*h*w, width]``."""
    parts = [width // 3 // 2 * 2] * 2
    parts.append(width - sum(parts))
    axes = torch.meshgrid(*[torch.arange(n, dtype=torch.float32) for n in grid], indexing="ij")
    codes = []
    for axis, dim in zip(axes, parts):
        half = dim // 2
        freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / max(half, 1)))
        angle = axis.reshape(-1, 1) * freq
        code = torch.cat([angle.sin(), angle.cos()], dim=1)
        codes.append(F.pad(code, (0, dim - code.shape[1])))
    return torch.cat(codes, dim=1).unsqueeze(0)


class Attention(nn.Module):
    """Multi-head self-attention; ``bias="qv"`` gives q and v a bias and k none, as VideoMAE does."""

    def __init__(self, width: int, heads: int, bias: Literal["qkv", "qv"] = "qkv") -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=bias == "qkv")
        if bias == "qv":
            self.q_bias = nn.Parameter(torch.zeros(width))
            self.v_bias = nn.Parameter(torch.zeros(width))
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        if self.qkv.bias is None:
            bias = torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias]).to(x.dtype)
            qkv = F.linear(x, self.qkv.weight.to(x.dtype), bias)
        else:
            qkv = self.qkv(x)
        q, k, v = qkv.reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """A pre-norm transformer block; ``divided`` attends over time, then over space."""

    def __init__(self, cfg: VideoViTConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
        self.attn = Attention(cfg.width, cfg.heads, cfg.qkv_bias)
        if cfg.attention == "divided":
            self.norm_time = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
            self.attn_time = Attention(cfg.width, cfg.heads, cfg.qkv_bias)
        self.norm2 = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, cfg.mlp_dim), nn.GELU(), nn.Linear(cfg.mlp_dim, cfg.width))
        self.drop_path = drop_path
        if cfg.layer_scale > 0:
            self.gamma_1 = nn.Parameter(torch.full((cfg.width,), cfg.layer_scale))
            self.gamma_2 = nn.Parameter(torch.full((cfg.width,), cfg.layer_scale))
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.attention == "divided":
            x = x + self._drop(self._divided(self.attn_time, self.norm_time(x), over="time"))
            x = x + self._drop(self._scale(self._divided(self.attn, self.norm1(x), over="space"), 1))
        else:
            x = x + self._drop(self._scale(self.attn(self.norm1(x)), 1))
        x = x + self._drop(self._scale(self.mlp(self.norm2(x)), 2))
        return x.contiguous()

    def _scale(self, x: torch.Tensor, branch: int) -> torch.Tensor:
        return x * getattr(self, f"gamma_{branch}").to(x.dtype) if self.cfg.layer_scale > 0 else x

    def _divided(self, attn: Attention, x: torch.Tensor, over: str) -> torch.Tensor:
        cls, tokens = (x[:, :1], x[:, 1:]) if self.cfg.pool == "cls" else (None, x)
        b, _, d = tokens.shape
        _, h, w = self.cfg.grid
        t = tokens.shape[1] // (h * w)
        grid = tokens.reshape(b, t, -1, d)
        if over == "time":
            out = attn(grid.transpose(1, 2).reshape(-1, t, d)).reshape(b, -1, t, d).transpose(1, 2)
        else:
            out = attn(grid.reshape(b * t, -1, d)).reshape(b, t, -1, d)
        out = out.reshape(b, -1, d)
        return out if cls is None else torch.cat([torch.zeros_like(cls), out], dim=1)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_path == 0.0:
            return x
        keep = 1.0 - self.drop_path
        mask = x.new_empty(x.shape[0], 1, 1).bernoulli_(keep)
        return x * mask / keep


class Head(nn.Module):
    """Norm, pool (mean of tokens or the class token), linear classifier."""

    def __init__(self, cfg: VideoViTConfig) -> None:
        super().__init__()
        self.pool, self.after_pool = cfg.pool, cfg.head_norm == "pooled"
        self.norm = nn.LayerNorm(cfg.width, eps=cfg.norm_eps if cfg.head_norm_eps is None else cfg.head_norm_eps)
        self.fc = nn.Linear(cfg.width, cfg.num_classes)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.after_pool:
            x = self.norm(x)
        x = x[:, 0] if self.pool == "cls" else x.mean(dim=1)
        return self.fc(self.norm(x) if self.after_pool else x)


def layer_specs(cfg: VideoViTConfig) -> list[tuple[type[nn.Module], tuple]]:
    """The model as (layer class, constructor arguments), in order: what a pipeline stage builds."""
    rates = [cfg.drop_path * i / max(cfg.depth - 1, 1) for i in range(cfg.depth)]
    return [(Embedding, (cfg,))] + [(Block, (cfg, r)) for r in rates] + [(Head, (cfg,))]


class VideoViT(nn.Sequential):
    """The whole model in one process: the layers of :func:`layer_specs` in sequence."""

    def __init__(self, cfg: VideoViTConfig) -> None:
        super().__init__(*[cls(*args) for cls, args in layer_specs(cfg)])
        self.cfg = cfg


def init_weights(module: nn.Module) -> None:
    """ViT initialisation, applied by each layer to itself (a pipeline stage builds only its own layers)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def flops_per_clip(cfg: VideoViTConfig) -> int:
    """Forward FLOPs for one clip (a multiply-add counts 2), from the shapes alone."""
    n = cfg.tokens + (1 if cfg.pool == "cls" else 0)
    d, m = cfg.width, cfg.mlp_dim
    t, p, q = cfg.tubelet
    embed = 2 * cfg.tokens * (3 * t * p * q) * d
    tt, hh, ww = cfg.grid
    if cfg.attention == "joint":
        attention = 2 * n * d * 3 * d + 2 * 2 * n * n * d + 2 * n * d * d
    else:
        tokens = cfg.tokens
        per_attn = lambda seq, count: count * (2 * seq * d * 3 * d + 2 * 2 * seq * seq * d + 2 * seq * d * d)  # noqa: E731
        attention = per_attn(tt, hh * ww) + per_attn(hh * ww, tt)
        n = tokens + (1 if cfg.pool == "cls" else 0)
    mlp = 2 * 2 * n * d * m
    head = 2 * d * cfg.num_classes
    return int(embed + cfg.depth * (attention + mlp) + head)


def check_input(cfg: VideoViTConfig, frames: int, size: tuple[int, int]) -> str | None:
    """Why clips of ``frames`` x ``size`` cannot go through this model, or None if they can."""
    t, p, q = cfg.tubelet
    if frames % t or size[0] % p or size[1] % q:
        return f"clips of {frames}x{size[0]}x{size[1]} do not divide into {t}x{p}x{q} tubelets"
    return None


def parameters_estimate(cfg: VideoViTConfig) -> int:
    """Parameter count from the shapes (for describe, without building a 1B model)."""
    d, m = cfg.width, cfg.mlp_dim
    t, p, q = cfg.tubelet
    attention = 4 * d * d + (4 * d if cfg.qkv_bias == "qkv" else 3 * d)
    block = attention + 2 * d * m + m + d + 4 * d + (2 * d if cfg.layer_scale > 0 else 0)
    if cfg.attention == "divided":
        block += attention + 2 * d
    embed = (
        3 * t * p * q * d + d + (cfg.tokens * d if cfg.position == "learned" else 0) + (d if cfg.pool == "cls" else 0)
    )
    return embed + cfg.depth * block + 2 * d + d * cfg.num_classes + cfg.num_classes
