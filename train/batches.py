"""The training input: the step sampler's clips through a DataLoader, onto the device, augmented there.

Every random choice is seeded by (seed, step, micro-batch, data-parallel rank), so a
resumed run sees the same batches as one that never stopped.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from clipforge.models.clips import mix_batch, random_crop_flip
from clipforge.preprocess.jpeg import decode_jpeg_batch
from clipforge.preprocess.reader import ClipDataset, collate_encoded

from .inputs import DataSettings
from .sampler import StepSampler
from .throughput import Throughput

Batch = tuple[torch.Tensor, torch.Tensor]


def train_batches(
    dataset: ClipDataset,
    sampler: StepSampler,
    data: DataSettings,
    classes: int,
    seed: int,
    grad_accum: int,
    first_step: int,
    steps: int,
    dp_rank: int,
    device: torch.device,
    throughput: Throughput,
) -> Iterator[Batch]:
    """Micro-batches from ``first_step`` on, augmented on the device with per-step seeds.

    uint8 clips travel to a GPU from pinned memory without blocking the host; the model
    normalises them there (its first layer), so the copy is a quarter of a float one.
    ``throughput`` counts the time spent waiting for the loader.
    """
    cuda = device.type == "cuda"
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler.batches(first_step, steps),
        num_workers=data.workers,
        persistent_workers=False,
        prefetch_factor=4 if data.workers else None,
        pin_memory=cuda and not dataset.encoded,
        collate_fn=collate_encoded if dataset.encoded else None,
        # Its own generator: starting the loader draws a seed, which from the global generator would shift the
        # dropout, drop-path and masks of a resumed run's first step (the trainer seeds the global one per step).
        generator=torch.Generator().manual_seed(seed),
    )
    for n, (clips, labels) in enumerate(throughput.timed(loader)):
        step, micro = first_step + n // grad_accum, n % grad_accum
        if dataset.encoded:
            clips = decode_jpeg_batch(clips, device)
        clips, labels = clips.to(device, non_blocking=cuda), labels.to(device, non_blocking=cuda)
        # Seeded by data-parallel rank: the stages of one pipeline must crop their shared batch alike.
        g = torch.Generator().manual_seed(hash((seed, step, micro, dp_rank)) % (2**63))
        clips = random_crop_flip(clips, data.crop, data.flip, g)
        if data.mixup or data.cutmix:
            clips, labels = mix_batch(clips, labels, classes, data.mixup, data.cutmix, g)
        yield clips, labels
