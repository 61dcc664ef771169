"""What a finished run records about itself: the typed contents of ``final/run.json``.

Evaluation, prediction and the registry rebuild the model and judge it from
this record alone: the architecture and its overrides, the classes, the input
the model expects, the data it saw and how well it did.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clipforge.hpc.distenv import DistEnv
    from clipforge.preprocess.store import ClipStore

HEADLINE_METRICS = ("clip_top1", "clip_top5", "video_top1", "video_top5", "loss")


@dataclasses.dataclass(frozen=True)
class InputShape:
    """The clips a model takes: frames x height x width, before any crop."""

    frames: int
    height: int
    width: int


@dataclasses.dataclass
class RunRecord:
    """A finished run, as evaluation, prediction and the registry need it."""

    model: str
    """Model builder name."""
    architecture: dict[str, Any]
    """Overrides of the builder's defaults (depth, tubelet, attention, ...)."""
    classes: list[str]
    input: InputShape
    crop: int | None
    """Centre crop applied before the model (None: the full frame)."""
    store: str
    """The clip store the model trained on."""
    data_fingerprint: dict[str, Any]
    """Format version, index checksum, classes and clip parameters of that store."""
    metrics: dict[str, float]
    """Headline figures of the final evaluation (clip/video top-1 and top-5, loss)."""
    metrics_split: str
    per_class_accuracy: dict[str, float | None]
    steps: int
    world_size: int
    code_commit: str | None = None
    slurm_job_id: str | None = None
    """The scheduler's job id (Slurm or submitit local) the run finished in."""
    parameter_server: dict[str, Any] | None = None
    """Parameter-server figures (mode, updates, staleness), for runs of that mode."""
    federated: dict[str, Any] | None = None
    """Federated-averaging figures (rounds, clients), for runs of that mode."""
    imported: dict[str, Any] | None = None
    """Where imported weights came from (format, file, its sha256), for ``clipforge models import``."""
    pretraining: dict[str, Any] | None = None
    """The self-supervised objective (masked autoencoding, its mask ratio), for pretraining runs."""

    @property
    def encoder_only(self) -> bool:
        """Weights without a classifier (a pretraining run, an imported pretraining checkpoint): fine-tune first."""
        return self.pretraining is not None or bool((self.imported or {}).get("encoder_only"))

    @classmethod
    def of_run(
        cls,
        model: str,
        overrides: dict[str, Any],
        store: ClipStore,
        crop: int | None,
        metrics: dict[str, Any],
        steps: int,
        dist: DistEnv,
    ) -> RunRecord:
        """The record of a run that trained ``model`` on ``store`` and was evaluated as ``metrics``."""
        p = store.params
        return cls(
            model=model,
            architecture=dict(overrides),
            classes=list(store.classes),
            input=InputShape(p["clip_frames"], p["height"], p["width"]),
            crop=crop,
            store=str(store.root),
            data_fingerprint=store.fingerprint(),
            metrics={k: float(metrics[k]) for k in HEADLINE_METRICS if k in metrics},
            metrics_split=metrics["split"],
            per_class_accuracy=metrics.get("per_class_accuracy", {}),
            steps=steps,
            world_size=dist.world_size,
            code_commit=code_commit(),
            slurm_job_id=dist.job_id,
        )

    @property
    def model_size(self) -> int:
        """The spatial size the model takes: the crop, or the full frame height."""
        return self.crop or self.input.height

    def model_overrides(self) -> dict[str, Any]:
        """The architecture overrides as the builders take them (JSON has no tuples)."""
        overrides = dict(self.architecture)
        if "tubelet" in overrides:
            overrides["tubelet"] = tuple(overrides["tubelet"])
        return overrides

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {k: v for k, v in data.items() if v is not None or k in ("crop", "code_commit", "slurm_job_id")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["input"] = InputShape(**data["input"])
        return cls(**values)


def code_commit() -> str | None:
    """The commit of the code that ran, when it runs from a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
