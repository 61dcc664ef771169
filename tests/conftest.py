"""Shared fixtures: a real single-node Slurm cluster, isolated job folders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import submitit

from clipforge.hpc.devcluster import LocalCluster
from clipforge.hpc.mpi import mpiexec_prefix

from . import early as early_work
from . import federations, few_labels, helpers
from .early import Early
from .helpers import VENV_BIN, options, pack_argv

if TYPE_CHECKING:
    from clipforge.registry.repo import Registry


@pytest.fixture(scope="session")
def slurm() -> LocalCluster:
    """The local Slurm cluster, started if it is not running (it is left running for the next run)."""
    cluster = LocalCluster()
    if not cluster.is_up():
        cluster.up()
    os.environ.update(cluster.env)  # batch scripts start `python3` from PATH: the venv's (session_environment)
    return cluster


@pytest.fixture(scope="session")
def multinode() -> LocalCluster:
    """A 3-node Slurm cluster on this host (nodes n1..n3 in network namespaces), beside the single-node one.

    Its own folder, ports and address range, so both run at once; taken down at the end of the session.
    Clients reach it with ``env=helpers.multinode_env(cluster)``, never through os.environ.
    """
    cluster = LocalCluster.beside(3)
    cluster.up()
    yield cluster
    cluster.down()


@pytest.fixture(autouse=True)
def jobs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's submitit job folders live in its own temporary directory."""
    folder = tmp_path / "jobs"
    monkeypatch.setenv("CLIPFORGE_JOBS_DIR", str(folder))
    return folder


@pytest.fixture(scope="session")
def mpiexec() -> list[str]:
    """The MPI launcher that came with the openmpi package, with the flags root and oversubscription need."""
    return mpiexec_prefix()


SAMPLE_VIDEOS = Path(__file__).resolve().parents[1] / ".cache" / "sample-videos"


@pytest.fixture(scope="session")
def sample_videos() -> list[Path]:
    """The real sample videos unpacked by ./dev.sh test (bikes.mp4, bigbuckbunny.mp4, carphone_pristine.mp4)."""
    videos = sorted(SAMPLE_VIDEOS.glob("*.mp4"))
    assert len(videos) == 3, f"sample videos missing from {SAMPLE_VIDEOS}: run ./dev.sh test, which fetches them"
    return videos


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory, sample_videos: list[Path]) -> Path:
    """A class-per-folder corpus: synthetic videos of every codec, odd files, broken files and the real samples."""
    from clipforge.preprocess import synthetic

    root = tmp_path_factory.mktemp("corpus")
    synthetic.make_corpus(root, videos_per_class=3, frames=(30, 60), classes=synthetic.CLASSES[:4])
    synthetic.add_broken_files(root, "move_left")
    rotated = synthetic.write_video(root / "move_up" / "rotated.mp4", synthetic.VideoSpec("move_up", frames=40, seed=5))
    synthetic.tag_rotation(rotated, 90)
    synthetic.write_video(
        root / "move_up" / "no_duration.h264",
        synthetic.VideoSpec("move_up", frames=40, seed=6),
        container_format="h264",
    )
    synthetic.write_video(root / "move_down" / "short.mp4", synthetic.VideoSpec("move_down", frames=6, seed=7))
    (root / "move_down" / "notes.txt").write_text("not a video")
    shutil.copy(root / "move_down" / "short.mp4", root / "move_down" / os.fsdecode(b"caf\xe9.mp4"))  # Latin-1 name
    for video in sample_videos:
        (root / "samples").mkdir(exist_ok=True)
        shutil.copy(video, root / "samples" / video.name)
    return root


@pytest.fixture
def pack(mpiexec):
    """Run the packing job under ``mpiexec -n N``; returns the completed process."""

    def run(videos: Path, out: Path, ranks: int = 2, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        argv = pack_argv(
            mpiexec,
            ranks,
            videos,
            out,
            *extra,
            clip_frames=8,
            height=32,
            width=32,
            clips_per_video=3,
            max_shard_clips=12,
        )
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if check:
            assert result.returncode == 0, result.stderr[-3000:]
        return result

    return run


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory: pytest.TempPathFactory, mpiexec) -> Path:
    """A small clip store of all six synthetic classes: 8 frames of 32x32 per clip."""
    from clipforge.preprocess import synthetic

    root = tmp_path_factory.mktemp("tiny")
    synthetic.make_corpus(root / "videos", videos_per_class=5, frames=(40, 60))
    out = root / "store"
    argv = pack_argv(
        mpiexec,
        2,
        root / "videos",
        out,
        clip_frames=8,
        frame_stride=2,
        height=32,
        width=32,
        clips_per_video=4,
        max_shard_clips=16,  # several shards, for locality-aware sampling
        split__train=0.6,
        split__val=0.4,
        split__test=0.0,
    )
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="session", autouse=True)
def session_environment(tmp_path_factory: pytest.TempPathFactory) -> None:
    """What every process the tests start sees, set before the first one starts.

    Jobs submitted outside a test (by module and session fixtures) keep their folders in the session's own
    directory, never in the user's ``~/.clipforge/jobs``: the test clusters number their jobs from 1 each time.

    DeepSpeed JIT-builds one op on its first init (20-40 s): it is kept for the whole run. It is built by the
    ``ninja`` first on PATH, and the venv's (1.13) and Debian's (1.11) record a build's command differently, so a
    switch between them rebuilds it, every other DeepSpeed start waiting on its lock: the venv's first, from the start.
    Batch scripts also start ``python3`` from PATH: the venv's.
    """
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions")
    )
    os.environ["CLIPFORGE_JOBS_DIR"] = str(tmp_path_factory.mktemp("session-jobs"))
    if not os.environ["PATH"].startswith(f"{VENV_BIN}:"):
        os.environ["PATH"] = f"{VENV_BIN}:{os.environ['PATH']}"


HEAVY_FIXTURES = {
    "slurm",
    "multinode",
    "mpiexec",
    "tiny_store",
    "corpus",
    "clean_store",
    "pack",
    "registry",
    "lfs_server",
    "one_round",
    "resumed",
    "hostile",
    "trained",
    "zero_runs",
    "late_trained",
    "non_iid",
    "ps_runs",
    "few_labels",
    "time_limited",
    "device_check",
}
"""Fixtures that start a cluster, MPI ranks, git remotes or the early work: a test that uses one is not fast."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="only the tests that need no training, federation, cluster, MPI or git remote (units, configs, "
        "refusals, formats): a few minutes",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier alone with --fast; otherwise the modules marked ``waits`` first and ``checks_early`` last.

    ``waits``: modules that mostly wait (on Slurm noticing a node or a requeue, or on one git process at a time),
    which run first, while the early work (:func:`early`) needs CPU, so it takes their idle cores instead of the
    busy tests' time. ``checks_early``: modules that check the work run beside the suite, last, so it is done by
    then. A stable sort keeps the order within each group. test_preprocess.py waits too but is not marked: a rank
    of its 3-node packing has segfaulted in Open MPI's MPI_Init beside busy early work (a fragment that arrived
    while the rank was still starting).
    """
    if config.getoption("--fast"):
        slow = [i for i in items if i.get_closest_marker("slow") or HEAVY_FIXTURES & set(i.fixturenames)]
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if i not in set(slow)]
    items.sort(key=lambda i: 2 if i.get_closest_marker("checks_early") else 0 if i.get_closest_marker("waits") else 1)


@pytest.fixture(scope="session", autouse=True)
def early(request, tmp_path_factory, session_environment) -> Early:
    """The collected tests' slow work that needs no cluster, started with the session (see early.Early)."""
    needs = set().union(*(item.fixturenames for item in request.session.items))
    work = Early(tmp_path_factory.mktemp("early"))
    if needs & {"one_round", "resumed"}:
        store = request.getfixturevalue("tiny_store")
        for name in federations.ONE_ROUND:
            work.start(name, federations.one_round, store, name)
        work.start("killed", federations.killed_after_round_one, store)
    if "hostile" in needs:
        for name in federations.HOSTILE:
            work.start(f"hostile-{name}", federations.hostile, request.getfixturevalue("tiny_store"), name)
    if any(item.path.name == "test_gpu_check.py" for item in request.session.items):
        work.start("device-check", early_work.device_check)  # after the federations: the pool takes work in order
    if "time_limited" in needs:
        request.getfixturevalue("time_limited")  # submitted now: its two runs mostly wait on Slurm
    wanted = set(helpers.EARLY_TRAININGS) if "trained" in needs else set()
    wanted |= {f"zero{stage}" for stage in range(4)} if "zero_runs" in needs else set()
    wanted |= {"cropped"} if "cropped_run" in needs else set()  # test_evaluate.py's alone

    def train(name: str, spec: tuple) -> None:  # each training on its own, waited for by name
        store, mpiexec = request.getfixturevalue("tiny_store"), request.getfixturevalue("mpiexec")
        work.start(f"train-{name}", early_work.training, mpiexec, store, name, spec)

    for name in (name for name in helpers.EARLY_TRAININGS if name in wanted):  # in this order
        train(name, helpers.EARLY_TRAININGS[name])
    if "non_iid" in needs:  # after the trainings, which test_evaluate.py waits for: test_fl.py checks it later
        work.start("non-iid", federations.non_iid, request.getfixturevalue("mpiexec"))
    if "ps_runs" in needs:  # after the trainings: test_ps.py runs last, test_evaluate.py before them
        work.start("ps", early_work.ps_runs, request.getfixturevalue("tiny_store"))
    for name in helpers.LATE_TRAININGS if "late_trained" in needs else ():
        train(name, helpers.LATE_TRAININGS[name])
    if "few_labels" in needs:  # last: test_pretrain_few_labels.py checks it at the end
        work.start("few-labels", few_labels.few_labels, request.getfixturevalue("mpiexec"))
    yield work
    work.stop()


@pytest.fixture(scope="session")
def time_limited(slurm, tmp_path_factory: pytest.TempPathFactory) -> tuple[submitit.Job, Path]:
    """A selftest job that reaches its one-minute time limit twice, submitted with the session (:func:`early`) and
    checked by test_slurm.py: its two runs mostly wait on Slurm, so the other tests run meanwhile."""
    from clipforge.hpc.launch import run_script

    root = tmp_path_factory.mktemp("time-limit")
    # Slurm's shortest limit is a minute, and slurmctld looks at time limits (and --signal) about every 30 s.
    # The signal is due 20 s into each run, so it comes 20-50 s in: a signal due at the start once came while the
    # job was still importing, before submitit's handler, and SIGUSR2's default action killed it.
    limits = options(cluster="dev", ntasks_per_node=1, wait=False, time=1, signal_delay_s=40, max_requeues=1)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CLIPFORGE_JOBS_DIR", str(root / "jobs"))
        job = run_script(
            "clipforge.jobs.selftest", limits + options(steps=100000, step_seconds=0.5, state_dir=root / "state")
        )
    return job, root / "state"


@pytest.fixture(scope="session")
def trained(early) -> early_work.Runs:
    """The runs that tests only read once finished (helpers.EARLY_TRAININGS), trained beside the suite."""
    return early_work.Runs(early)


@pytest.fixture(scope="session")
def zero_runs(early) -> early_work.Runs:
    """A run of each ZeRO stage (0-3) on 2 ranks, 12 steps (trained beside the suite: helpers.EARLY_TRAININGS)."""
    return early_work.Runs(early, "train-zero")


@pytest.fixture(scope="session")
def late_trained(early) -> early_work.Runs:
    """The runs of helpers.LATE_TRAININGS, trained beside the suite's last minutes."""
    return early_work.Runs(early)


@pytest.fixture
def isolated_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry tests never read or write the user's or the system's git config (their modules use it)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "home" / ".gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    (tmp_path / "home").mkdir()


@pytest.fixture(params=["bare", "http"])
def registry(request, tmp_path: Path, isolated_git) -> Registry:
    """A fresh registry: a bare repository path, or git daemon + a Git LFS server (giftless) over HTTP."""
    from clipforge.registry import protect
    from clipforge.registry.repo import Registry

    if request.param == "bare":
        registry = Registry.init(str(tmp_path / "remote.git"))
        registry.bare_dir, registry.objects = Path(registry.remote), Path(registry.remote) / "lfs" / "objects"
        return registry
    server = request.getfixturevalue("lfs_server")
    name = f"r{len(list(server.base.iterdir()))}"
    subprocess.run(["git", "init", "-q", "--bare", str(server.base / f"{name}.git")], check=True)
    protect.install(server.base / f"{name}.git")  # what the server's administrator runs once
    registry = Registry.init(f"{server.git_url}/{name}.git", lfs_url=f"{server.lfs_url}/clipforge/{name}", bare=False)
    registry.bare_dir, registry.objects = server.base / f"{name}.git", server.store / "clipforge" / name
    return registry


@pytest.fixture(scope="session")
def lfs_server(tmp_path_factory: pytest.TempPathFactory):
    """A Git LFS server over HTTP (giftless) and a git daemon on loopback, as a hosted remote behaves."""
    import socket
    import time
    import types

    from clipforge.hpc.distenv import free_port

    root = tmp_path_factory.mktemp("lfs-server")
    base, store = root / "repos", root / "lfs-storage"
    base.mkdir()
    http_port, git_port = free_port(), free_port()
    serve = (
        "import sys; from giftless.app import init_app\n"
        "app = init_app(additional_config={'AUTH_PROVIDERS': ['giftless.auth.allow_anon:read_write'],"
        " 'TRANSFER_ADAPTERS': {'basic': {'options': {'storage_options': {'path': sys.argv[2]}}}}})\n"
        "app.run(host='127.0.0.1', port=int(sys.argv[1]), threaded=True)\n"
    )
    giftless = subprocess.Popen(
        [sys.executable, "-c", serve, str(http_port), str(store)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    daemon = subprocess.Popen(
        [
            "git",
            "daemon",
            f"--base-path={base}",
            "--export-all",
            "--enable=receive-pack",
            "--reuseaddr",
            "--listen=127.0.0.1",
            f"--port={git_port}",
            str(base),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    for port in (http_port, git_port):
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline and giftless.poll() is None, "the LFS server (giftless) did not start"
            time.sleep(0.1)
    yield types.SimpleNamespace(
        base=base, git_url=f"git://127.0.0.1:{git_port}", lfs_url=f"http://127.0.0.1:{http_port}", store=store
    )
    giftless.terminate()
    daemon.terminate()


@pytest.fixture(scope="session")
def clean_store(corpus: Path, tmp_path_factory, mpiexec) -> Path:
    """The corpus packed once by 2 ranks into 32x32 clips, 3 per video: shared by every test that only reads it."""
    out = tmp_path_factory.mktemp("clean") / "store"
    argv = pack_argv(mpiexec, 2, corpus, out, clip_frames=8, height=32, width=32, clips_per_video=3, max_shard_clips=12)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out
