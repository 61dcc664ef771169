"""Masked-autoencoder pretraining of videovit on clips without labels, as VideoMAE does it.

``train.py --objective mae`` trains :class:`MaskedAutoencoder` through the same
loop, engine, checkpoints and requeue as classification; only the model and its
loss differ. Tube masking hides the same ``mask_ratio`` of the spatial patches in
every frame (90%: a tubelet cannot be copied from its neighbour in time); random
masking (``--mae.masking random``, VideoMAE's ablation) hides that share of all the
tokens, so a hidden tubelet is inferred from where its content was a moment before; the
encoder sees only the visible tokens, which is where the speed comes from; a light
decoder fills in the masked ones from a shared mask token and fixed position codes;
the loss is the mean squared error on the masked tubelets' pixels, each normalised
by its own mean and deviation per channel (VideoMAE's normalised-pixel target).

The run ends with the encoder alone, under the classifier's names (embedding ``0.``,
blocks ``1.`` to ``depth.``): ``train.py --model.weights RUN`` fine-tunes it with a
new head, as VideoMAE fine-tunes from its pretraining.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import videovit
from .builders import Architecture, InputSpec, videovit_config


@dataclasses.dataclass
class MaeSettings:
    mask_ratio: float = 0.9
    """Share of the tokens hidden from the encoder (VideoMAE: 0.9)."""
    masking: Literal["tube", "random"] = "tube"
    """``tube``: the same spatial patches hidden in every time step (VideoMAE's); ``random``: tokens hidden
    independently (VideoMAE's ablation), so a hidden tubelet can be inferred from its place a moment before."""
    decoder_depth: int = 4
    """Decoder blocks (VideoMAE: 4)."""
    decoder_width: int | None = None
    """Decoder width; default: half the encoder's (VideoMAE ViT-B: 384)."""
    decoder_heads: int | None = None
    """Decoder attention heads; default: one per 64 channels."""
    norm_pixels: bool = True
    """Predict each tubelet's pixels normalised by its own mean and deviation (VideoMAE's default)."""

    def decoder(self, width: int) -> tuple[int, int]:
        dw = self.decoder_width or max(width // 2, 32)
        return dw, self.decoder_heads or max(dw // 64, 1)

    def problem(self) -> str | None:
        if not 0.0 < self.mask_ratio < 1.0:
            return f"--mae.mask-ratio {self.mask_ratio}: give a share between 0 and 1 (VideoMAE: 0.9)"
        if self.decoder_depth < 1:
            return f"--mae.decoder-depth {self.decoder_depth}: at least one block"
        return None


class MaskedAutoencoder(nn.Module):
    """A videovit encoder over the visible tokens, a light decoder over all of them; ``forward`` returns the loss."""

    def __init__(self, cfg: videovit.VideoViTConfig, mae: MaeSettings) -> None:
        super().__init__()
        self.cfg, self.mae = cfg, mae
        rates = [cfg.drop_path * i / max(cfg.depth - 1, 1) for i in range(cfg.depth)]
        self.encoder = nn.Sequential(videovit.Embedding(cfg), *[videovit.Block(cfg, r) for r in rates])
        self.norm = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
        width, heads = mae.decoder(cfg.width)
        t, p, q = cfg.tubelet
        decoder = dataclasses.replace(cfg, depth=mae.decoder_depth, width=width, heads=heads, mlp_dim=4 * width)
        decoder = dataclasses.replace(decoder, drop_path=0.0, layer_scale=0.0, attention="joint", qkv_bias="qkv")
        self.to_decoder = nn.Linear(cfg.width, width, bias=False)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        self.register_buffer("decoder_position", videovit.sincos_3d(cfg.grid, width), persistent=False)
        self.decoder = nn.Sequential(*[videovit.Block(decoder) for _ in range(mae.decoder_depth)])
        self.decoder_norm = nn.LayerNorm(width, eps=cfg.norm_eps)
        self.predict = nn.Linear(width, 3 * t * p * q)
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        videovit.init_weights(self.to_decoder)
        videovit.init_weights(self.predict)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        tokens = self.encoder[0](clips)  # normalised, embedded, with positions: [B, N, D]
        b, n, _ = tokens.shape
        draw = tube_mask if self.mae.masking == "tube" else random_mask
        visible, masked = draw(b, self.grid_of(clips), self.mae.mask_ratio, tokens.device)
        x = _take(tokens, visible)
        for block in self.encoder[1:]:
            x = block(x)
        x = self.to_decoder(self.norm(x))
        position = self.positions(clips).to(x.dtype).expand(b, -1, -1)
        mask = self.mask_token.to(x.dtype).expand(b, masked.shape[1], -1)
        x = torch.cat([x + _take(position, visible), mask + _take(position, masked)], dim=1)
        for block in self.decoder:
            x = block(x)
        predicted = self.predict(self.decoder_norm(x[:, visible.shape[1] :]))
        return F.mse_loss(predicted.float(), _take(self.targets(clips), masked))

    def grid_of(self, clips: torch.Tensor) -> tuple[int, int, int]:
        t, p, q = self.cfg.tubelet
        return clips.shape[1] // t, clips.shape[2] // p, clips.shape[3] // q

    def positions(self, clips: torch.Tensor) -> torch.Tensor:
        grid = self.grid_of(clips)
        if grid == self.cfg.grid:
            return self.decoder_position
        return videovit.sincos_3d(grid, self.decoder_position.shape[-1]).to(clips.device)

    @torch.no_grad()
    def targets(self, clips: torch.Tensor) -> torch.Tensor:
        """Each tubelet's pixels ``[B, N, t*p*q*3]`` in 0-1, normalised per channel over the tubelet when asked."""
        t, p, q = self.cfg.tubelet
        b, frames, h, w, c = clips.shape
        x = clips.float().div(255).reshape(b, frames // t, t, h // p, p, w // q, q, c)
        x = x.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(b, -1, t * p * q, c)
        if self.mae.norm_pixels:
            x = (x - x.mean(dim=2, keepdim=True)) / (x.var(dim=2, unbiased=True, keepdim=True).sqrt() + 1e-6)
        return x.reshape(b, x.shape[1], -1)


def tube_mask(batch: int, grid: tuple[int, int, int], ratio: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Token indices ``[B, visible]`` and ``[B, masked]``: per clip, the same spatial patches in every time step.

    Drawn from the global generator, which the trainer seeds per step: a resumed run masks alike.
    """
    t, h, w = grid
    spatial = h * w
    keep = max(1, min(spatial - 1, round(spatial * (1.0 - ratio))))
    order = torch.rand(batch, spatial, device=device).argsort(dim=1)
    steps = torch.arange(t, device=device).view(1, t, 1) * spatial

    def tubes(cells: torch.Tensor) -> torch.Tensor:
        return (steps + cells.sort(dim=1).values.unsqueeze(1)).reshape(batch, -1)

    return tubes(order[:, :keep]), tubes(order[:, keep:])


def random_mask(batch: int, grid: tuple[int, int, int], ratio: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Token indices ``[B, visible]`` and ``[B, masked]``: per clip, ``ratio`` of all the tokens, drawn alike."""
    tokens = math.prod(grid)
    keep = max(1, min(tokens - 1, round(tokens * (1.0 - ratio))))
    order = torch.rand(batch, tokens, device=device).argsort(dim=1)
    return order[:, :keep].sort(dim=1).values, order[:, keep:].sort(dim=1).values


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.gather(x, 1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def mae_architecture(name: str, frames: int, image_size: int, mae: MaeSettings, **overrides) -> Architecture:
    """The masked autoencoder around videovit ``name``: one layer (not cut into pipeline stages)."""
    cfg = videovit_config(name, 1, frames, image_size, **overrides)
    t, p, q = cfg.tubelet
    spec = InputSpec(frames_multiple=t, size_multiple=max(p, q), min_size=max(p, q))
    return Architecture(name, [(MaskedAutoencoder, (cfg, mae))], spec, splittable=False, flops=lambda: flops(cfg, mae))


def flops(cfg: videovit.VideoViTConfig, mae: MaeSettings) -> int:
    """Forward FLOPs per clip: the encoder over the visible tokens, the decoder over all of them."""
    t, h, w = cfg.grid
    if mae.masking == "tube":
        visible = t * max(1, min(h * w - 1, round(h * w * (1.0 - mae.mask_ratio))))
    else:
        visible = max(1, min(cfg.tokens - 1, round(cfg.tokens * (1.0 - mae.mask_ratio))))
    tokens = cfg.tokens
    width, _ = mae.decoder(cfg.width)
    tp = math.prod(cfg.tubelet)
    embed = 2 * tokens * 3 * tp * cfg.width
    encoder = cfg.depth * _block_flops(visible, cfg.width, cfg.mlp_dim)
    decoder = mae.decoder_depth * _block_flops(tokens, width, 4 * width)
    return int(embed + encoder + 2 * visible * cfg.width * width + decoder + 2 * (tokens - visible) * width * 3 * tp)


def _block_flops(n: int, d: int, m: int) -> int:
    return 2 * n * d * 3 * d + 2 * 2 * n * n * d + 2 * n * d * d + 2 * 2 * n * d * m


def encoder_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's weights of a trained autoencoder (``0.encoder.i.*``) under the classifier's names (``i.*``)."""
    prefix = "0.encoder."
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
