"""The Flower federations of test_fl.py that run with the early work (:class:`early.Early`), and what they need."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from .early import Early
from .helpers import kill_tree, pack_argv, tiny_start

FL_TINY = [
    "--model.name",
    "videovit-tiny",
    "--model.depth",
    "2",
    "--model.tubelet",
    "2",
    "8",
    "8",
    "--batch-per-rank",
    "4",
]
"""The federated job's tiny model and batch."""
DP_SIGMA, DP_CLIP = 1e-6, 1e4
"""Client-level DP of the DP round: a clipping norm no update reaches, so the noise is all that differs."""
ONE_ROUND = {
    # The SuperLink notices the lost client within two 30-second heartbeats and the stage stops waiting for it
    # then; the timeout only bounds a survivor's training stage, which on a busy host can take minutes.
    "secagg": ["--secagg", "--secagg-may-drop", "0.25", "--round-timeout-s", "900"],
    "dp": ["--dp.noise-multiplier", str(DP_SIGMA), "--dp.clipping-norm", str(DP_CLIP)],
    "bf16": ["--transport", "bf16"],
    "start": [],  # one client, from a weights file: START_SEED's initialisation (:func:`one_round` writes it)
}
"""One round of each variant, the flags beside the plain round's; SecAgg+ runs 4 clients and loses the last."""
START_SEED = 7
"""The "start" round's global model starts from TINY's initialisation at this seed, not the run's seed 0."""
NON_IID_EPOCHS, NON_IID_LR = 3, 0.005
"""The non-IID round's local training: long and fast enough for clients of 2 classes each to drift apart."""
NON_IID = ["--shares", "by_class", "--rounds", "1", "--local-epochs", str(NON_IID_EPOCHS), "--lr", str(NON_IID_LR)]
"""The non-IID round: 3 clients with 2 of the 6 classes each."""
NON_IID_MU = 20
"""FedProx's mu there: each local step moves lr x mu = 0.1 of the way back to the global model."""


def federation_argv(store: Path, run: Path, *extra: str, clients: int = 2) -> list[str]:
    """A local federation of ``clients`` with the tiny model."""
    argv = [sys.executable, "-m", "clipforge.jobs.fl_train", "--data.store", str(store), "--run-dir", str(run)]
    return [*argv, "--executor", "debug", "--clients", str(clients), *FL_TINY, *extra]


def kill_client_after_its_keys(
    run: Path, index: int, federation: subprocess.Popen, output: Path, timeout_s: float = 1800
) -> None:
    """SIGKILL client ``index``'s SuperNode and everything it started once it has answered SecAgg+'s first two
    messages (its public keys, then its key shares): a device that drops out while it trains."""
    log = run / "flower" / "logs" / f"supernode-{index}.log"
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and log.read_text(errors="replace").count("Sent successfully") >= 2):
        assert federation.poll() is None, (
            f"the federation ended (exit {federation.returncode}) before client {index} answered twice:\n"
            + output.read_text(errors="replace")[-3000:]
        )
        assert time.monotonic() < deadline, f"client {index} never answered"
        time.sleep(0.2)
    key = f"client-{index}.key"
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"flower-supernode") for a in argv[:2]) and any(a.endswith(key.encode()) for a in argv):
            kill_tree(int(proc.name))
            return
    raise AssertionError(f"no SuperNode process of client {index}")


def one_round(early: Early, store: Path, name: str) -> Path:
    """One round of the ``name`` variant of :data:`ONE_ROUND`; its run directory once it ended well."""
    clients, extra = {"secagg": 4, "start": 1}.get(name, 2), list(ONE_ROUND[name])
    if name == "start":  # downloaded weights, as a user starts from them: a file of TINY's architecture
        from safetensors.torch import save_file

        weights = early.root / "start.safetensors"
        save_file({k: v.contiguous() for k, v in tiny_start(START_SEED).state_dict().items()}, str(weights))
        extra += ["--model.weights", str(weights)]
    argv = federation_argv(store, early.root / name, "--rounds", "1", *extra, clients=clients)
    process = early.process(name, argv)
    if name == "secagg":
        kill_client_after_its_keys(early.root / name, 3, process, early.root / f"{name}.log")
    assert process.wait(timeout=1800) == 0, (early.root / f"{name}.log").read_text()[-3000:]
    return early.root / name


def killed_after_round_one(early: Early, store: Path) -> Path:
    """A federation of 2 clients over 2 rounds, killed (server, SuperNodes and run at once) after round 1."""
    run = early.root / "killed"
    process = early.process("killed", federation_argv(store, run, "--rounds", "2", "--eval-every", "2"))
    deadline = time.monotonic() + 1800
    while not (run / "rounds" / "round-00001.safetensors").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the federation ended before round 1"
        time.sleep(0.2)
    kill_tree(process.pid)  # its group, and the ServerApp its SuperLink started in a session of its own
    process.wait()
    return run


def non_iid(early: Early, mpiexec: list[str]) -> dict[str, Path]:
    """One round of FedAvg and one of FedProx (:data:`NON_IID`) from the same start, and what they ran on.

    The start is a federation of one client that trained 20 epochs on all the training clips, so the round begins
    from a model that tells the motions apart: from a random start one round of 3 epochs learns nothing here. The
    store has 16 videos a class (a quarter for training), so the score is over 72 validation videos.
    """
    from clipforge.preprocess import synthetic

    root = early.root / "non-iid"
    synthetic.make_corpus(root / "videos", videos_per_class=16, frames=(40, 60))
    store = root / "store"
    packing = pack_argv(
        mpiexec,
        2,
        root / "videos",
        store,
        clip_frames=8,
        frame_stride=2,
        height=32,
        width=32,
        clips_per_video=4,
        split__train=0.25,
        split__val=0.75,
        split__test=0.0,
    )
    warm = federation_argv(store, root / "start", "--rounds", "1", "--local-epochs", "20", clients=1)
    for name, argv in (("non-iid-pack", packing), ("non-iid-start", warm)):
        assert early.process(name, argv).wait(timeout=1800) == 0, (early.root / f"{name}.log").read_text()[-3000:]
    sides = {"fedavg": [], "fedprox": ["--proximal-mu", str(NON_IID_MU)]}
    started = {
        name: early.process(
            f"non-iid-{name}",
            federation_argv(store, root / name, *NON_IID, *extra, "--model.weights", str(root / "start"), clients=3),
        )
        for name, extra in sides.items()
    }
    for name, process in started.items():
        assert process.wait(timeout=1800) == 0, (early.root / f"non-iid-{name}.log").read_text()[-3000:]
    return {"store": store, "start": root / "start", **{name: root / name for name in sides}}


HOSTILE_DIR = Path(__file__).resolve().parent / "hostile"
"""A hostile site's Python (its sitecustomize.py poisons the client's trainer as CLIPFORGE_ATTACK says)."""
HOSTILE_CLIP = 1.0
"""The clipping norm of the clipped federation: the bound on how far the global model may move in a round."""
HOSTILE = {
    # Clients 0 and 1 honest, 2 sends NaN and 3 a flattened update, both joined from outside; a rogue node that
    # the job did not register (registered on the server's loopback) is online before the round.
    "refused": (4, ["--outside", "2", "--min-clients", "4"], {2: "nan", 3: "shape"}),
    # Client-level DP without SecAgg+ (noise too small to matter), DP-SGD on the clients; client 2 sends +1000 on
    # every weight with 10^9 examples claimed, skips clipping, and claims a sample-level epsilon of 0.
    "clipped": (
        3,
        [
            "--outside",
            "1",
            "--min-clients",
            "3",
            "--dp.noise-multiplier",
            "1e-6",
            "--dp.clipping-norm",
            str(HOSTILE_CLIP),
            "--dp.sample-noise-multiplier",
            "1.0",
        ],
        {2: "huge"},
    ),
    # Four honest clients and one that sends +1000 (finite, the right shapes: only the aggregation can stop it).
    "trimmed": (5, ["--outside", "1", "--min-clients", "5", "--aggregation", "trimmed-mean"], {4: "huge"}),
}
"""The federations with hostile clients: their clients, flags, and the attack of each client that joins from outside."""


def join_argv(run: Path, index: int, store: Path, superlink: str, clients: int) -> list[str]:
    """``clipforge fl join`` as client ``index`` of the federation in ``run`` (its keys), on share index of clients."""
    keys = run / "certs"
    argv = [f"{Path(sys.executable).parent}/clipforge", "fl", "join", "--superlink", superlink]
    argv += ["--ca", str(keys / "ca.crt"), "--key", str(keys / f"client-{index}.key")]
    argv += ["--cert", str(keys / f"client-{index}.crt"), "--data.store", str(store)]
    return [*argv, "--partition", f"{index}/{clients}", "--work", str(run.parent / f"{run.name}-site-{index}")]


def wait_for_text(path: Path, text: str, process: subprocess.Popen, timeout_s: float = 1800) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert process.poll() is None, f"{process.args[:4]} ended before {text!r}:\n" + path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {text!r} in {path}"
        time.sleep(0.5)


def rogue_node(early: Early, run: Path) -> Path:
    """A SuperNode the job did not register: an insider on the server's host registers its own key through the
    SuperLink's loopback address (the gate would refuse it) and connects there. Its log, once it is online."""
    from clipforge.hpc.distenv import free_port
    from clipforge.ps import certs

    keys = early.root / "rogue-keys"
    certs.make_certs(keys, 1)
    home = run / "flower" / "cli-home"  # the job's own CLI configuration: the SuperLink's loopback address
    flwr = Path(sys.executable).parent / "flwr"
    env = dict(early.env, FLWR_HOME=str(home))
    public = certs.client_public_key(keys, 0)
    subprocess.run(
        [str(flwr), "supernode", "register", str(public), "federation"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    address = next(line.split('"')[1] for line in (home / "config.toml").read_text().splitlines() if "address" in line)
    argv = [f"{Path(sys.executable).parent}/flower-supernode", "--superlink", address]
    argv += ["--root-certificates", str(run / "certs" / "ca.crt"), "--auth-supernode-private-key"]
    argv += [str(certs.client_key(keys, 0)), "--node-config", 'store="unused"', "--port", str(free_port())]
    process = early.process("refused-rogue", argv, dict(early.env, FLWR_HOME=str(early.root / "rogue-home")))
    wait_for_text(early.root / "refused-rogue.log", "SuperNode ID", process, timeout_s=300)
    return early.root / "refused-rogue.log"


def hostile(early: Early, store: Path, name: str) -> Path:
    """The ``name`` federation of :data:`HOSTILE`, one round: its run directory once it ended well."""
    from clipforge.hpc.distenv import free_port

    clients, flags, attacks = HOSTILE[name]
    run, port = early.root / name, free_port()
    argv = federation_argv(store, run, "--rounds", "1", "--port", str(port), *flags, clients=clients)
    process = early.process(name, argv)
    wait_for_text(early.root / f"{name}.log", "clients from other sites", process)
    if name == "refused":
        rogue_node(early, run)
    sites = []
    for index, attack in attacks.items():
        env = dict(early.env, PYTHONPATH=str(HOSTILE_DIR), CLIPFORGE_ATTACK=attack)
        sites.append(
            early.process(f"{name}-site-{index}", join_argv(run, index, store, f"127.0.0.1:{port}", clients), env)
        )
    try:
        assert process.wait(timeout=1800) == 0, (early.root / f"{name}.log").read_text()[-3000:]
    finally:
        for site in sites:
            kill_tree(site.pid)
    return run
