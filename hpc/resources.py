"""What a job asks the scheduler for, checked before anything is submitted.

One ``Resources`` value has two renderings: keyword parameters for submitit's
``SlurmExecutor`` (:meth:`Resources.submitit_parameters`) and ``#SBATCH``
lines for a job script (:meth:`Resources.sbatch_lines`). Both come from one
table, :meth:`Resources._flags`, so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import re

from clipforge.base.errors import UserError


class ResourceError(UserError):
    """A resource request the scheduler would refuse; the message names the field."""


# The forms sbatch --time accepts: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME_FORMS = [
    (re.compile(r"^(\d+)$"), ("m",)),
    (re.compile(r"^(\d+):(\d{1,2})$"), ("m", "s")),
    (re.compile(r"^(\d+):(\d{1,2}):(\d{1,2})$"), ("h", "m", "s")),
    (re.compile(r"^(\d+)-(\d+)$"), ("d", "h")),
    (re.compile(r"^(\d+)-(\d+):(\d{1,2})$"), ("d", "h", "m")),
    (re.compile(r"^(\d+)-(\d+):(\d{1,2}):(\d{1,2})$"), ("d", "h", "m", "s")),
]
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_MEMORY = re.compile(r"^(\d+)([KMGT]?)B?$", re.IGNORECASE)


def parse_time(text: str) -> int:
    """Slurm time string to whole minutes (rounded up, as Slurm does).

    >>> parse_time("1-02:30:00")
    1590
    """
    for pattern, units in _TIME_FORMS:
        match = pattern.match(text.strip())
        if match:
            seconds = sum(int(v) * _SECONDS[u] for v, u in zip(match.groups(), units))
            return max(1, -(-seconds // 60))
    raise ResourceError(f"time: {text!r} is not a Slurm time; use minutes ('30'), 'HH:MM:SS' or 'D-HH:MM:SS'")


def parse_memory_mb(text: str) -> int:
    """Slurm memory string ('500M', '64G', '64GB', '1024') to megabytes."""
    match = _MEMORY.match(text.strip())
    if not match:
        raise ResourceError(f"mem: {text!r} is not a memory size; use e.g. '64G' or '500M'")
    value, unit = int(match.group(1)), match.group(2).upper() or "M"
    return value * {"K": 1, "M": 1024, "G": 1024**2, "T": 1024**3}[unit] // 1024


@dataclasses.dataclass
class Resources:
    """Scheduler resources of one job (the flags of `sbatch`)."""

    nodes: int = 1
    """Number of nodes."""
    min_nodes: int | None = None
    """Fewest nodes the job may start, or restart after a node loss, on (``--nodes MIN-MAX``); empty: exactly nodes."""
    ntasks_per_node: int = 1
    """Tasks (processes, MPI ranks) per node; one per GPU for training."""
    gpus_per_node: int = 0
    """GPUs per node; 0 for CPU jobs."""
    gpu_type: str | None = None
    """GPU model for the gres form (`gpu:a100:4`); empty to take any GPU."""
    cpus_per_task: int = 1
    """CPU cores per task (data loader workers live here)."""
    mem: str | None = None
    """Memory per node, as Slurm writes it ('64G'); empty for the partition default."""
    time: str = "01:00:00"
    """Wall-clock limit, as Slurm writes it ('30', 'HH:MM:SS', 'D-HH:MM:SS')."""
    partition: str | None = None
    """Partition; empty for the cluster profile's default."""
    account: str | None = None
    """Account to charge; empty for the profile's or your default."""
    qos: str | None = None
    """Quality of service."""
    constraint: str | None = None
    """Node features the job needs (`--constraint`)."""
    exclusive: bool = False
    """Ask for whole nodes."""
    signal_delay_s: int = 120
    """Seconds before the time limit at which the job is told to checkpoint (USR2)."""
    job_name: str = "clipforge"
    """Name shown by squeue."""
    extra: list[str] = dataclasses.field(default_factory=list)
    """Further sbatch flags, each as 'key=value' or 'flag' (e.g. 'mail-type=END')."""

    def validate(self) -> Resources:
        """Raise :class:`ResourceError` naming the first field the scheduler would refuse."""
        for name in ("nodes", "ntasks_per_node", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise ResourceError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise ResourceError(f"min_nodes: must be between 1 and nodes ({self.nodes}), got {self.min_nodes}")
        if self.gpus_per_node < 0:
            raise ResourceError(f"gpus_per_node: must be 0 or more, got {self.gpus_per_node}")
        if self.signal_delay_s < 0:
            raise ResourceError(f"signal_delay_s: must be 0 or more, got {self.signal_delay_s}")
        if self.gpu_type is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", self.gpu_type):
            raise ResourceError(f"gpu_type: {self.gpu_type!r} is not a GPU model name such as 'a100'")
        limit_s = parse_time(self.time) * 60
        if 0 < limit_s <= self.signal_delay_s:
            raise ResourceError(
                f"signal_delay_s: {self.signal_delay_s} s is not below the time limit ({self.time}): the checkpoint "
                "signal would come as the job starts, before it can checkpoint; give a longer time or a smaller "
                "signal_delay_s"
            )
        if self.mem is not None:
            parse_memory_mb(self.mem)
        if not re.fullmatch(r"[\w.+-]+", self.job_name):
            raise ResourceError(f"job_name: {self.job_name!r} may hold only letters, digits and . _ + -")
        for flag in self.extra:
            if not re.fullmatch(r"[a-z][a-z-]*(=\S+)?", flag):
                raise ResourceError(f"extra: {flag!r} is not an sbatch flag; write 'mail-type=END', without '--'")
        return self

    @property
    def time_minutes(self) -> int:
        return parse_time(self.time)

    @property
    def ntasks(self) -> int:
        return self.nodes * self.ntasks_per_node

    def _flags(self) -> dict[str, object]:
        """sbatch long flags (without '--') and their values; True marks a bare flag."""
        flags: dict[str, object] = {
            "job-name": self.job_name,
            "nodes": f"{self.min_nodes}-{self.nodes}" if self.min_nodes else self.nodes,
            "ntasks-per-node": self.ntasks_per_node,
            "cpus-per-task": self.cpus_per_task,
            "time": self.time_minutes,
            "signal": f"USR2@{self.signal_delay_s}",
        }
        if self.gpus_per_node:
            if self.gpu_type:
                flags["gres"] = f"gpu:{self.gpu_type}:{self.gpus_per_node}"
            else:
                flags["gpus-per-node"] = self.gpus_per_node
        for name in ("mem", "partition", "account", "qos", "constraint"):
            if getattr(self, name) is not None:
                flags[name] = getattr(self, name)
        if self.exclusive:
            flags["exclusive"] = True
        for flag in self.extra:
            key, _, value = flag.partition("=")
            flags[key] = value or True
        return flags

    def sbatch_lines(self) -> list[str]:
        """The ``#SBATCH`` lines of a job script asking for these resources."""
        return [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={v}" for k, v in self._flags().items()]

    def submitit_parameters(self) -> dict[str, object]:
        """Keyword parameters for ``submitit.SlurmExecutor.update_parameters``."""
        flags = self._flags()
        # submitit renders these itself from its own parameter names.
        params: dict[str, object] = {
            "job_name": flags.pop("job-name"),
            "nodes": flags.pop("nodes"),
            "ntasks_per_node": flags.pop("ntasks-per-node"),
            "cpus_per_task": flags.pop("cpus-per-task"),
            "time": flags.pop("time"),
            "signal_delay_s": self.signal_delay_s,
        }
        flags.pop("signal")
        for key in ("gres", "gpus-per-node", "mem", "partition", "account", "qos", "constraint", "exclusive"):
            if key in flags:
                params[key.replace("-", "_")] = flags.pop(key)
        if flags:
            params["additional_parameters"] = {k.replace("-", "_"): v for k, v in flags.items()}
        return params
