"""The run directory: one owner writes and reads it; nobody else knows its file names.

A run directory, as every training mode leaves it (DeepSpeed or parameter server)::

    config.yaml              the resolved job config
    metrics.jsonl            a row per step, evaluation and checkpoint ({"kind": "train" | "eval" | "checkpoint" | ...};
                             an evaluation's row has its scalars, not its per-class figures)
    tensorboard/             TensorBoard events
    checkpoints/step-N/      DeepSpeed checkpoints, each with complete.json (see checkpoints.py)
    ps/server-K.pt           parameter-server shard checkpoints
    rounds/round-N.safetensors  the global model after federated round N (the last few)
    final/model.safetensors  consolidated fp32 weights of the plain model
    final/run.json           the RunRecord: what evaluation, prediction and the registry need
    eval.json                the final evaluation in full (per-class accuracy and confusion matrix included)
    eval-<split>.json        later evaluations on other splits
    plots/                   loss and accuracy curves, confusion matrix (PNG)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from clipforge.base.errors import UserError
from clipforge.base.files import replacing, write_json, write_text

from .checkpoints import CheckpointIndex
from .plots import plot_run
from .record import RunRecord

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
FINAL = "final"
WEIGHTS = "model.safetensors"
RECORD = "run.json"
EVALUATION = "eval.json"
ROUNDS = "rounds"
PER_CLASS = ("confusion", "per_class_accuracy")
"""What an evaluation's row in metrics.jsonl leaves to eval.json (see :meth:`RunDir.append_metrics`)."""


class RunDirError(UserError):
    """A path that is not the run directory the command needs."""


class RunDir:
    """One run's directory on the shared filesystem."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @classmethod
    def find(cls, path: Path) -> RunDir:
        """The finished run that ``path`` names: its directory, its ``final/`` folder or its weights file."""
        path = Path(path)
        for root in (path, path.parent, path.parent.parent):
            run = cls(root)
            if run.is_finished():
                return run
        raise RunDirError(
            f"{path}: no finished run there (no {FINAL}/{RECORD}); give a finished run directory or its {FINAL}/ folder"
        )

    def __str__(self) -> str:
        return str(self.root)

    # -- where things go -----------------------------------------------------------
    @property
    def checkpoints(self) -> CheckpointIndex:
        return CheckpointIndex(self.root / "checkpoints")

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def weights(self) -> Path:
        """The consolidated weights of a finished run."""
        return self.root / FINAL / WEIGHTS

    @property
    def start_weights(self) -> Path:
        """Where the weights a run starts from are copied when they come from elsewhere (a registry version)."""
        return self.root / "start"

    def server_checkpoint(self, rank: int) -> Path:
        """Where parameter server ``rank`` keeps its shard and optimizer state."""
        folder = self.root / "ps"
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"server-{rank}.pt"

    def prepare(self) -> RunDir:
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    # -- federated rounds --------------------------------------------------------------
    def save_round(self, index: int, state: dict[str, Any], keep: int = 2) -> Path:
        """The global model after federated round ``index`` (written whole or not at all); older ones pruned."""
        from safetensors.torch import save_file

        folder = self.root / ROUNDS
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"round-{index:05d}.safetensors"
        with replacing(path) as tmp:
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        for old in sorted(folder.glob("round-*.safetensors"))[:-keep]:
            old.unlink(missing_ok=True)
        return path

    def last_round(self) -> tuple[int, dict[str, Any] | None]:
        """The last saved federated round and its global model; (0, None) when none was saved."""
        from safetensors.torch import load_file

        for path in sorted((self.root / ROUNDS).glob("round-*.safetensors"), reverse=True):
            try:
                return int(path.stem.split("-")[1]), load_file(str(path))
            except (OSError, ValueError):
                continue
        return 0, None

    # -- the config ----------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> Path:
        """The resolved config, as plain data, that the run was started with."""
        self.prepare()
        return write_text(self.root / CONFIG, yaml.safe_dump(config, sort_keys=False))

    def config(self) -> dict[str, Any]:
        """The resolved config (empty when the run has none, e.g. one made by hand)."""
        path = self.root / CONFIG
        return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}

    # -- metrics -------------------------------------------------------------------
    def append_metrics(self, *rows: dict[str, Any]) -> None:
        """Rows of metrics.jsonl, in one append (rank 0 only: the file has one writer).

        An evaluation's row keeps its scalars. Its confusion matrix and per-class accuracy grow with the square of
        the class count (2.9 MiB a row at 1000 classes: gigabytes over a long run, all read back at its end), so
        only the final evaluation keeps them, in eval.json.
        """
        self.prepare()
        rows = tuple({k: v for k, v in r.items() if k not in PER_CLASS} if r.get("kind") == "eval" else r for r in rows)
        with open(self.root / METRICS, "a") as f:
            f.write("".join(json.dumps(row, default=float) + "\n" for row in rows))

    def metrics(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Rows of metrics.jsonl, all of them or those of one ``kind`` (train, eval, ...)."""
        path = self.root / METRICS
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in rows if kind is None or r.get("kind") == kind]

    # -- the end of a run ----------------------------------------------------------
    def write_final(self, state: dict[str, Any], record: RunRecord, metrics: dict[str, Any]) -> Path:
        """Consolidated weights, the final evaluation, the record and the plots; returns the weights' path."""
        from safetensors.torch import save_file

        final = self.root / FINAL
        final.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(self.weights))
        write_json(self.root / EVALUATION, metrics)
        write_json(final / RECORD, record.to_dict())
        plot_run(self.metrics(), record.classes, self.root / "plots", metrics.get("confusion"))
        return self.weights

    def write_imported(self, state: dict[str, Any], record: RunRecord) -> Path:
        """Weights and record of a model that was not trained here (an imported checkpoint); returns the weights."""
        from safetensors.torch import save_file

        final = self.root / FINAL
        final.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(self.weights))
        write_json(final / RECORD, record.to_dict())
        return self.weights

    def is_finished(self) -> bool:
        return (self.root / FINAL / RECORD).is_file() and self.weights.is_file()

    def record(self) -> RunRecord:
        """The record of a finished run."""
        path = self.root / FINAL / RECORD
        if not path.exists():
            raise RunDirError(f"{self.root} is not a finished run: {FINAL}/{RECORD} is missing")
        return RunRecord.from_dict(json.loads(path.read_text()))

    def evaluation_path(self, split: str | None = None) -> Path:
        """Where the final evaluation (``split`` None) or a later one on ``split`` is kept."""
        return self.root / (EVALUATION if split is None else f"eval-{split}.json")

    def write_evaluation(self, split: str, metrics: dict[str, Any]) -> Path:
        """A later evaluation of the finished model on ``split``."""
        return write_json(self.evaluation_path(split), metrics)

    def evaluation(self, split: str | None = None) -> dict[str, Any]:
        """The final evaluation (``split`` None) or a later one on ``split``."""
        path = self.evaluation_path(split)
        if not path.exists():
            raise RunDirError(f"{path} does not exist: the run has not been evaluated on {split or 'its eval split'}")
        return json.loads(path.read_text())

    def contents(self) -> list[str]:
        """What is in the run directory, as a person would list it (folders with a slash)."""
        return sorted(p.name + ("/" if p.is_dir() else "") for p in self.root.iterdir()) if self.root.is_dir() else []
