"""The text of ``slurm.conf`` and ``slurmdbd.conf`` for a development cluster, from its shape."""

from __future__ import annotations

import socket

from .shape import ClusterShape


def lines(**settings: object) -> str:
    """``key=value`` lines, in the order given."""
    return "".join(f"{k}={v}\n" for k, v in settings.items())


def slurm_conf(shape: ClusterShape) -> str:
    """``slurm.conf`` for ``shape``: one node on the host, or nodes n1..nN in their namespaces."""
    host = socket.gethostname().split(".")[0]
    multi = shape.nodes > 1
    settings: dict[str, object] = dict(
        ClusterName=shape.name,
        SlurmctldHost=f"{host}({shape.network.host_address})" if multi else host,
        SlurmctldPort=shape.ctld_port,
        SlurmdPort=shape.slurmd_port,
        SlurmUser="root",
        SlurmdUser="root",
        AuthType="auth/munge",
        CredType="cred/munge",
        # cred_expire=5: a requeued job may restart 5 s after its requeue instead of 120 s.
        AuthInfo=f"socket={shape.munge_socket},cred_expire=5",
        StateSaveLocation=shape.root / "state",
        # %n: each node's own spool, pid and log file; they share the host's filesystem.
        SlurmdSpoolDir=shape.root / "spool" / ("%n" if multi else ""),
        SlurmctldPidFile=shape.pid_file("slurmctld"),
        SlurmdPidFile=shape.pid_file("slurmd-%n" if multi else "slurmd"),
        SlurmctldLogFile=shape.log_file("slurmctld"),
        SlurmdLogFile=shape.log_file("slurmd-%n" if multi else "slurmd"),
        # No cgroups in our containers: track processes by their parent pids.
        ProctrackType="proctrack/linuxproc",
        TaskPlugin="task/none",
        JobContainerType="job_container/none",
        SelectType="select/cons_tres",
        SelectTypeParameters="CR_Core",
        # Lets the node declare more CPUs than the host has, so `srun -n 8` works on 2 cores.
        SlurmdParameters="config_overrides",
        # PMIx needs libpmix-dev, or slurmd cannot load mpi/pmix.
        MpiDefault="pmix",
        # The scheduler's full pass, which starts a requeued job once its credential expired: every 2 s, not 60.
        SchedulerParameters="sched_interval=2",
        JobRequeue=1,
        ReturnToService=2,
        MinJobAge=86400,
        KillWait=10,
        InactiveLimit=0,
        JobAcctGatherType="jobacct_gather/none",
    )
    if multi:
        settings.update(
            # PMIx makes a per-job folder under TmpFS; with a shared /tmp the second node
            # fails with 'Cannot create directory "/tmp/spmix_appdir_...": File exists'.
            TmpFS=shape.root / "tmp" / "%n",
            # A dead node is NOT_RESPONDING after ~8 s and DOWN (its jobs requeued) after
            # ~15 s; lower values do not help: each ping round takes about 7 s.
            SlurmdTimeout=5,
            MessageTimeout=5,
            KillWait=2,
        )
    if shape.accounting:
        settings.update(
            AccountingStorageType="accounting_storage/slurmdbd",
            AccountingStorageHost="localhost",
            AccountingStoragePort=shape.dbd_port,
            # With slurmdbd, the "password" names the private munge socket.
            AccountingStoragePass=shape.munge_socket,
            # AccountingStorageEnforce=none is fatal on 22.05: leave it out.
        )
    text = lines(**settings)
    names, addresses = shape.network.node_range() if multi else (host, "127.0.0.1")
    text += (
        f"NodeName={names} NodeAddr={addresses} CPUs={shape.cpus} RealMemory={shape.memory_mb} State=UNKNOWN\n"
        f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP\n"
        f"PartitionName=batch Nodes={names} Default=NO MaxTime=INFINITE State=UP\n"
    )
    return text


def slurmdbd_conf(shape: ClusterShape, password: str) -> str:
    """``slurmdbd.conf`` for ``shape``, storing into the MariaDB on its port with ``password``."""
    return lines(
        AuthType="auth/munge",
        AuthInfo=f"socket={shape.munge_socket}",
        DbdHost="localhost",
        DbdPort=shape.dbd_port,
        SlurmUser="root",
        StorageType="accounting_storage/mysql",
        StorageHost="127.0.0.1",
        StoragePort=shape.mysql_port,
        StorageUser="slurm",
        StoragePass=password,
        StorageLoc="slurm_acct_db",
        PidFile=shape.pid_file("slurmdbd"),
        LogFile=shape.log_file("slurmdbd"),
    )
