"""Sample-level differential privacy on a federated client: DP-SGD through Opacus (``--dp.sample-*``).

Client-level privacy (:mod:`privacy`) hides whether a client took part, from anyone who sees the global model.
This hides each clip of a client's own data, from the server too, even without SecAgg+: every local step
draws a Poisson sample of the client's clips (each one with probability batch / clips), Opacus clips each clip's
gradient to the clipping norm and adds Gaussian noise of noise multiplier x clipping norm to their sum, and
Opacus's RDP accountant turns noise, sampling rate and steps into epsilon at delta.

The epsilon a client reports after round r assumes it took part in every round up to r, so it is an upper bound
for a client that was not always sampled.
"""

from __future__ import annotations

import dataclasses
import secrets
import warnings
from collections.abc import Iterator

import numpy as np
import torch


@dataclasses.dataclass
class SampleDP:
    """DP-SGD on a client: its per-clip clipping norm, noise multiplier and the delta epsilon is stated at."""

    noise_multiplier: float
    clipping_norm: float
    delta: float


def problem(model: torch.nn.Module) -> str | None:
    """Why Opacus cannot train ``model`` with DP-SGD, in a sentence (None: it can). BatchNorm is the usual one."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    return str(errors[0]).split(". ")[0] if errors else None


class PrivateSteps:
    """``model``'s optimizer made private, and the Poisson-sampled batches of ``clips`` clips it steps on."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, clips: int, batch: int, dp: SampleDP
    ) -> None:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler

        register_videovit()
        # Opacus's hooks fire on the first layer, whose input (uint8 clips) needs no gradient; torch warns each time.
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        # strict=False: Opacus refuses any layer that holds buffers, for BatchNorm's running statistics; videovit's
        # embedding holds only constants (the pixel mean and std, a fixed position table). problem() still
        # refuses BatchNorm.
        self.module = GradSampleModule(model, strict=False)
        self.sample_rate = min(1.0, batch / clips)
        # The noise and the Poisson sampling must be secret from the server, which knows the run's seed, or it
        # could draw the same noise and subtract it: a seed from the OS each round, never from the config.
        generator = torch.Generator().manual_seed(secrets.randbits(63))
        self.optimizer = DPOptimizer(
            optimizer,
            noise_multiplier=dp.noise_multiplier,
            max_grad_norm=dp.clipping_norm,
            expected_batch_size=batch,
            generator=generator,
        )
        self.sampler = UniformWithReplacementSampler(
            num_samples=clips, sample_rate=self.sample_rate, generator=generator
        )

    def batches(self) -> Iterator[np.ndarray]:
        """One epoch: positions into the client's clips, a Poisson sample each (some may be empty)."""
        for drawn in self.sampler:
            yield np.asarray(drawn, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.sampler)

    def close(self) -> None:
        """Take Opacus's hooks off the model, which goes on as a plain module."""
        self.module._close()


def share_epsilon(noise_multiplier: float, clips: int, batch: int, epochs: int, delta: float) -> float:
    """Epsilon at ``delta`` of a client that made ``epochs`` passes over ``clips`` in Poisson batches of ``batch``
    (each pass as many steps as :class:`PrivateSteps` takes: Opacus's sampler, 1 / rate of them)."""
    rate = min(1.0, batch / clips)
    return epsilon(noise_multiplier, rate, epochs * int(1 / rate), delta)


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``steps`` DP-SGD steps, from Opacus's RDP accountant."""
    from opacus.accountants import RDPAccountant

    if steps <= 0:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sample_rate, steps)]
    return float(accountant.get_epsilon(delta))


_registered = False


def register_videovit() -> None:
    """Teach Opacus the per-clip gradients of videovit's embedding.

    Opacus has a rule for each layer it knows (its Conv3d is the tubelet projection, inside the embedding) and
    none for a module whose own parameters are a class token and a learned position table added to the tokens.
    Both enter the output by addition, so a clip's gradient of each is the slice of its output gradient where
    it was added.
    """
    global _registered
    if _registered:
        return
    from opacus.grad_sample import register_grad_sampler

    from clipforge.models.videovit import Embedding

    @register_grad_sampler(Embedding)
    def embedding_grad_sample(layer: Embedding, activations, backprops: torch.Tensor) -> dict:
        out, first = {}, 0
        if layer.cls is not None:
            if layer.cls.requires_grad:
                out[layer.cls] = backprops[:, None, :1, :]
            first = 1
        if isinstance(layer.position, torch.nn.Parameter) and layer.position.requires_grad:
            tokens = backprops[:, None, first:, :]
            if tokens.shape[2] != layer.position.shape[1]:
                raise ValueError("DP-SGD trains videovit at its own input size only (the position table's grid)")
            out[layer.position] = tokens
        return out

    _registered = True
