"""Where a job's starting weights come from: a registry version (``--model.weights registry:NAME@REF``), or a local
weights file, finished run or imported model. The training and federated jobs both start from them."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from clipforge.jobs import config
from clipforge.registry.repo import Ref, Registry
from clipforge.train.inputs import ModelSettings

log = logging.getLogger("clipforge.start_weights")


def registry_version(model: ModelSettings) -> tuple[Registry, Ref]:
    """The registry and the concrete version that ``--model.weights registry:NAME@REF`` names."""
    remote = model.registry or os.environ.get("CLIPFORGE_REGISTRY")
    if not remote:
        raise config.ConfigError(
            f"--model.weights {model.weights}: no registry to take it from; pass --model.registry PATH_OR_URL "
            "or set CLIPFORGE_REGISTRY"
        )
    registry = Registry(remote)
    return registry, registry.resolve(Ref.parse(model.registry_reference() or ""))


def registry_architecture(model: ModelSettings) -> tuple[str, dict]:
    """The model and architecture options of the registry version ``--model.weights`` names (its model.yaml)."""
    registry, ref = registry_version(model)
    architecture = dict(registry.record(ref)["architecture"])
    for key in ("input", "crop"):  # what the version was trained on, not how it is built
        architecture.pop(key, None)
    return architecture.pop("model"), architecture


def fetch_registry_weights(model: ModelSettings, folder: Path) -> Path:
    """Copy the registry version's files (weights verified by their sha256) into ``folder``, once."""
    weights = folder / "model.safetensors"
    if not weights.exists():
        registry, ref = registry_version(model)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        registry.pull(ref, partial)
        partial.rename(folder)
        log.info("starting from registry version %s (%s), copied to %s", ref, model.weights, folder)
    return weights


def adopt(model: ModelSettings) -> None:
    """The starting weights bring their architecture: a registry version's model.yaml, or the record beside a
    finished run's or an imported model's weights (:meth:`ModelSettings.adopt_start`, which also points
    ``weights`` at the file). An option asked for that differs is refused in one line."""
    if model.registry_reference() is not None:
        name, overrides = registry_architecture(model)  # the version exists, and its architecture is this run's
        model.adopt(name, overrides, str(model.weights))
    else:
        model.adopt_start()
