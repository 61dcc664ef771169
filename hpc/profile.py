"""Cluster profiles: what differs between the clusters a user submits to.

A profile is a YAML file named after the cluster. It is chosen by ``--cluster
NAME`` or ``CLIPFORGE_CLUSTER``, looked up in ``$CLIPFORGE_PROFILES`` (a
colon-separated list of folders), then ``~/.config/clipforge/clusters``, then
the profiles shipped with clipforge (``local``, ``dev``, ``example-gpu``). A
path to a YAML file works too.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Literal

import yaml

from clipforge.base.errors import UserError
from clipforge.base.settings import refuse_unknown

from .resources import ResourceError, Resources, parse_time

SHIPPED = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "local"


class ProfileError(UserError):
    """A cluster profile that cannot be found or read; the message names the file."""


@dataclasses.dataclass(frozen=True)
class Partition:
    gpus_per_node: int = 0
    """GPUs on each node of this partition (0: a CPU partition)."""
    max_time: str | None = None
    """The partition's time limit, as Slurm writes it; empty for none."""


@dataclasses.dataclass(frozen=True)
class ClusterProfile:
    name: str
    executor: Literal["slurm", "local", "debug"] = "slurm"
    """How jobs run on this cluster: Slurm, local processes, or in this process."""
    partition: str | None = None
    """Partition used when a job names none."""
    account: str | None = None
    """Account charged when a job names none."""
    gpu_type: str | None = None
    """GPU model for the gres form when a job names none."""
    partitions: dict[str, Partition] = dataclasses.field(default_factory=dict)
    """Known partitions; when given, jobs are checked against them before submission."""
    modules: list[str] = dataclasses.field(default_factory=list)
    """Environment modules loaded before each job step (``module load ...``)."""
    setup: list[str] = dataclasses.field(default_factory=list)
    """Shell lines run in the batch script before the job step."""
    environment: str | None = None
    """The Python environment jobs run in: a venv or conda env folder, the same path on every node (its
    bin/python runs the job, its bin/ comes first on PATH). Default: the Python that submits."""
    scratch: str | None = None
    """Parallel filesystem path for clip stores and runs (Lustre scratch)."""
    max_requeues: int = 3
    """How often a job may be requeued after a timeout or preemption before it gives up."""

    def apply(self, resources: Resources) -> Resources:
        """Fill what the job left empty from the profile's defaults, then validate."""
        filled = dataclasses.replace(
            resources,
            partition=resources.partition or self.partition,
            account=resources.account or self.account,
            gpu_type=resources.gpu_type or (self.gpu_type if resources.gpus_per_node else None),
        )
        self.check(filled.validate())
        return filled

    def check(self, resources: Resources) -> None:
        """Refuse what this cluster's partitions cannot give (``resources`` already valid on their own)."""
        if not self.partitions or resources.partition is None:
            return
        part = self.partitions.get(resources.partition)
        if part is None:
            raise ResourceError(
                f"partition: {resources.partition!r} is not a partition of cluster {self.name!r}; "
                f"choose one of {', '.join(sorted(self.partitions))}"
            )
        if resources.gpus_per_node > part.gpus_per_node:
            raise ResourceError(
                f"gpus_per_node: partition {resources.partition!r} of {self.name!r} has "
                f"{part.gpus_per_node} GPUs per node, the job asks for {resources.gpus_per_node}"
            )
        if part.max_time and resources.time_minutes > parse_time(part.max_time):
            raise ResourceError(
                f"time: {resources.time} is over partition {resources.partition!r}'s limit of {part.max_time}"
            )

    def setup_lines(self) -> list[str]:
        """Shell lines for the batch script, before the job step starts."""
        lines = [f"module load {m}" for m in self.modules] + list(self.setup)
        if self.environment:
            lines.append(f'export PATH={shlex.quote(str(Path(self.environment) / "bin"))}:"$PATH"')
        return lines

    @property
    def python(self) -> str:
        """The interpreter of the job steps: the profile's environment's, else the one running now."""
        return str(Path(self.environment) / "bin" / "python") if self.environment else sys.executable


def search_path() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("CLIPFORGE_PROFILES", "").split(":") if p]
    return dirs + [Path.home() / ".config" / "clipforge" / "clusters", SHIPPED]


def load_profile(name: str | None = None) -> ClusterProfile:
    """The profile named (or ``$CLIPFORGE_CLUSTER``, or ``local``), read and checked."""
    name = name or os.environ.get("CLIPFORGE_CLUSTER") or DEFAULT_PROFILE
    candidates = [Path(name)] if name.endswith((".yaml", ".yml")) else [d / f"{name}.yaml" for d in search_path()]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        known = sorted({p.stem for d in search_path() if d.is_dir() for p in d.glob("*.yaml")})
        raise ProfileError(f"cluster profile {name!r} not found; known profiles: {', '.join(known)}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile is a mapping of settings, got {type(data).__name__}")
    return _from_dict(data, path)


def _from_dict(data: dict, path: Path) -> ClusterProfile:
    refuse_unknown(data, ClusterProfile, str(path), ProfileError)
    data = dict(data)
    data.setdefault("name", path.stem)
    if data.get("executor", "slurm") not in ("slurm", "local", "debug"):
        raise ProfileError(f"{path}: executor must be slurm, local or debug, got {data['executor']!r}")
    if data.get("environment"):
        env = Path(os.path.expandvars(str(data["environment"]))).expanduser()
        if not (env / "bin" / "python").exists():
            raise ProfileError(
                f"{path}: environment {env} has no bin/python; give the folder of the venv or conda env "
                "clipforge is installed in (the one `which python` shows inside it, less /bin/python)"
            )
        data["environment"] = str(env)
    try:
        parts = {}
        for key, value in (data.pop("partitions", None) or {}).items():
            refuse_unknown(value or {}, Partition, f"{path}: partition {key}", ProfileError)
            parts[str(key)] = Partition(**(value or {}))
        return ClusterProfile(partitions=parts, **data)
    except TypeError as exc:
        raise ProfileError(f"{path}: {exc}") from None
