"""A federation's outsiders and hostile clients, played with real processes: foreign keys and certificates at the
server's gate, the Control API through the job's port, NaN, misshapen and huge updates, false claims of examples
and epsilon; and the key files that keep them out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from clipforge.hpc.distenv import free_port
from clipforge.models.builders import architecture
from clipforge.preprocess.store import ClipStore
from clipforge.ps import certs
from clipforge.ps.flower import FlowerError, SuperLink, SuperNode

from .federations import FL_TINY as TINY
from .federations import (
    HOSTILE,
    HOSTILE_CLIP,
)
from .helpers import tiny_start

pytestmark = pytest.mark.checks_early


@pytest.fixture(scope="module")
def hostile(early) -> dict[str, Path]:
    """One round of each federation with hostile clients (federations.HOSTILE), run while the rest of the suite ran."""
    return {name: early.result(f"hostile-{name}") for name in HOSTILE}


def honest_updates(run: Path, clients: list[int], parts: int) -> tuple[dict[str, torch.Tensor], list]:
    """The round's start and the answers of honest ``clients`` (of ``parts`` iid shares) to round 1, computed here
    as their SuperNodes computed them, with the threads each of the federation's client processes had."""
    from clipforge.ps.federated import FederatedPlan, _Client, round_config

    plan = FederatedPlan.read(run / "flower" / "plan.json")
    store = ClipStore.open(Path(plan.store))
    start = architecture(plan.model, 6, 8, 32, **plan.overrides).build(seed=plan.seed).state_dict()
    config = round_config(plan, store, 1)
    node = {"store": plan.store, "num-partitions": parts, "partition": "iid", "seed": plan.seed}
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)) // parts)))
    try:
        answers = [
            _Client({**node, "partition-id": i}).fit([v.numpy() for v in start.values()], config) for i in clients
        ]
    finally:
        torch.set_num_threads(threads)
    return start, answers


def run_log(run: Path) -> str:
    return "".join(p.read_text() for p in (run / "flower" / "logs").glob("run-*.log"))


def test_nan_and_misshapen_updates_are_refused_and_the_round_is_fedavg_of_the_honest_clients(hostile) -> None:
    run = hostile["refused"]
    logs = run_log(run)
    # The rogue node (registered on the server's loopback, online before the round) was never sampled.
    assert "sampled 4 clients (out of 4)" in logs, logs[-3000:]
    rogue = (run.parent / "refused-rogue.log").read_text(errors="replace")
    assert "SuperNode ID" in rogue and "Received" not in rogue, rogue[-2000:]
    assert "the update of client 2 (node" in logs and "values that are not finite" in logs, logs[-3000:]
    assert "the update of client 3 (node" in logs and "1 arrays where the model has" in logs, logs[-3000:]
    row = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"round"' in line)
    assert sorted(row["refused"]) == [2, 3]
    start, answers = honest_updates(run, [0, 1], 4)
    total = sum(n for _, n, _ in answers)
    fedavg = {k: sum(w[j] * n for w, n, _ in answers) / total for j, k in enumerate(start)}
    final = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.isfinite(final[k]).all() for k in final)
    for k in fedavg:
        assert torch.allclose(final[k], torch.from_numpy(np.asarray(fedavg[k])), rtol=1e-5, atol=1e-6), k


def test_without_secagg_the_server_clips_a_huge_update_and_its_claims_count_for_nothing(
    hostile, tiny_store: Path
) -> None:
    from clipforge.preprocess.reader import ClipDataset
    from clipforge.ps import dpsgd, privacy
    from clipforge.ps.worker import partition

    store = tiny_store

    run = hostile["clipped"]
    start = tiny_start().state_dict()
    final = load_file(str(run / "final" / "model.safetensors"))
    moved = torch.cat([(final[k] - start[k]).flatten() for k in start]).norm().item()
    # Every update is clipped to the norm, so their mean moves at most that far; the noise (1e-6 clipping norms a
    # weight, over 3 clients) adds at most about 1e-3 of it. Unclipped, the +1000 client alone would move it 3e5.
    assert 0 < moved <= HOSTILE_CLIP * 1.001, moved
    logs = run_log(run)
    assert "claims 1000000000 examples" in logs, logs[-3000:]
    # The epsilons are the server's, not the client's 0. DP-SGD's: each client samples each of its clips with
    # probability batch / clips, for one epoch of 1 / that many steps; the largest client's counts.
    row = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"round"' in line)
    shares = partition(ClipDataset(ClipStore.open(store), "train").labels, 3, "iid", 0)
    spent = max(dpsgd.epsilon(1.0, q, int(1 / q), 1e-5) for q in (4 / len(share) for share in shares))
    assert row["sample_epsilon"] == pytest.approx(spent, rel=1e-9) and 0 < spent < float("inf")
    assert row["epsilon"] == privacy.epsilon(1e-6, 1.0, 1, 1e-5)
    record = json.loads((run / "final" / "run.json").read_text())["federated"]
    assert record["sample_differential_privacy"]["epsilon"] == row["sample_epsilon"]
    assert record["sample_differential_privacy"]["noise_multiplier"] == 1.0
    assert record["differential_privacy"]["clipping"] == "on the server"


def test_a_trimmed_mean_keeps_every_weight_within_the_honest_clients_range(hostile) -> None:
    run = hostile["trimmed"]
    start, answers = honest_updates(run, [0, 1, 2, 3], 5)
    final = load_file(str(run / "final" / "model.safetensors"))
    assert "is refused" not in run_log(run)  # +1000 is finite and well shaped: only the aggregation stops it
    spread, distance = [], []
    total = sum(n for _, n, _ in answers)
    for j, k in enumerate(start):
        honest = torch.stack([torch.from_numpy(np.asarray(w[j])) for w, _, _ in answers]).double()
        fedavg = sum(torch.from_numpy(np.asarray(w[j])).double() * n for w, n, _ in answers) / total
        low, high = honest.min(0).values, honest.max(0).values
        value = final[k].double()
        # The stated bound: each weight lies within the honest clients' values for it (the hostile one is cut at the
        # top of every weight), so it is within their spread of the honest FedAvg.
        assert ((value >= low - 1e-6) & (value <= high + 1e-6)).all(), k
        spread.append((high - low).flatten())
        distance.append((value - fedavg).flatten())
    assert torch.cat(distance).norm() <= torch.cat(spread).norm()
    record = json.loads((run / "final" / "run.json").read_text())["federated"]
    assert record["aggregation_rule"] == "trimmed-mean"


@pytest.mark.slow  # a SuperLink, its gate and three SuperNodes
def test_outsiders_reach_only_the_fleet_api_and_only_with_a_certificate_of_the_federations_ca(tmp_path: Path) -> None:
    import ssl
    import urllib.error
    import urllib.request

    keys, other = tmp_path / "keys", tmp_path / "other-ca"
    certs.make_certs(keys, 3)
    certs.make_certs(other, 1)
    superlink = SuperLink(keys, free_port(), tmp_path / "flower")
    nodes = []
    try:
        honest = [superlink.register(certs.client_public_key(keys, i)) for i in range(2)]
        config = {"store": "unused", "partition-id": 0}

        def node(index: int, folder: Path, client: int, ca: Path) -> SuperNode:
            key, cert = certs.client_key(folder, client), certs.client_cert(folder, client)
            nodes.append(SuperNode(index, key, cert, ca, superlink.fleet_address, config, None, tmp_path))
            return nodes[-1]

        for i in range(2):
            node(i, keys, i, keys / certs.CA_CERT).wait_ready()
        unknown = node(2, keys, 2, keys / certs.CA_CERT)  # a certificate of the CA, a key the job did not register
        foreign = node(3, other, 0, keys / certs.CA_CERT)  # another CA's certificate and key
        trusting_other = node(4, keys, 0, other / certs.CA_CERT)  # would trust another CA's server
        for refused in (unknown, foreign, trusting_other):
            with pytest.raises(FlowerError):
                refused.wait_ready(timeout_s=60)
        assert "did not register this key" in unknown.refusal()
        assert "refused this site's certificate" in foreign.refusal(), foreign.log.read_text()[-2000:]
        assert "not signed by the CA given" in trusting_other.refusal()
        # The job's own port, played by an outsider with Flower's CLI: register a foreign key, run another app,
        # drop an honest node. Each is refused before the SuperLink (no client certificate), nothing changed.
        home = tmp_path / "outsider"
        home.mkdir()
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "f"\n\n[superlink.f]\n'
            f'address = "{superlink.fleet_address}"\nroot-certificates = "{keys / certs.CA_CERT}"\n'
        )
        env = dict(os.environ, FLWR_HOME=str(home))
        flwr = str(Path(sys.executable).parent / "flwr")
        attempts = [
            ["supernode", "register", str(certs.client_public_key(other, 0)), "f"],
            ["run", str(Path(__file__).parent / "hostile"), "f"],
            ["supernode", "unregister", str(honest[0]), "f"],
        ]
        for argv in attempts:
            result = subprocess.run([flwr, *argv], env=env, capture_output=True, text=True, timeout=120)
            assert result.returncode != 0 or "success" not in result.stdout.lower(), (argv, result.stdout)
        # The same Control API paths with a valid client certificate (a partner turned outsider): 403 at the gate.
        context = ssl.create_default_context(cafile=str(keys / certs.CA_CERT))
        pem = tmp_path / "partner.pem"
        certs.write_secret(pem, certs.tls_key_pem(certs.client_key(keys, 0)))
        context.load_cert_chain(str(certs.client_cert(keys, 0)), str(pem))
        port = superlink.fleet_address.rsplit(":", 1)[1]
        for path in ("/v1/control/register-node", "/v1/control/start-run", "/v1/control/unregister-node", "/docs"):
            request = urllib.request.Request(f"https://localhost:{port}{path}", data=b"", method="POST")
            with pytest.raises(urllib.error.HTTPError, match="403"):
                urllib.request.urlopen(request, context=context, timeout=30)
        # Without a client certificate, or with another CA's, the gate's TLS refuses it (nginx answers 400).
        bare = ssl.create_default_context(cafile=str(keys / certs.CA_CERT))
        for context in (bare, _context_with(other, keys, tmp_path)):
            request = urllib.request.Request(f"https://localhost:{port}/v1/fleet/pull-messages", data=b"")
            with pytest.raises(urllib.error.HTTPError, match="400"):
                urllib.request.urlopen(request, context=context, timeout=30)
        listed = json.loads(superlink.cli("supernode", "list", "federation", "--format", "json"))
        ids = sorted(int(n["node-id"]) for n in listed["nodes"])
        assert ids == sorted(honest), listed  # no foreign key registered, no honest node dropped
        assert all(n.process.poll() is None for n in nodes[:2])  # the honest ones stay in the federation
        served = (tmp_path / "flower" / "gate" / "access.log").read_text()
        assert " 403 " in served and " 400 " in served and "/v1/control/" in served
    finally:
        for each in nodes:
            each.stop()
        superlink.stop()


def _context_with(folder: Path, keys: Path, tmp_path: Path):
    """A TLS client context that trusts the federation's CA and shows client 0's certificate of ``folder``."""
    import ssl

    context = ssl.create_default_context(cafile=str(keys / certs.CA_CERT))
    pem = tmp_path / f"{folder.name}.pem"
    certs.write_secret(pem, certs.tls_key_pem(certs.client_key(folder, 0)))
    context.load_cert_chain(str(certs.client_cert(folder, 0)), str(pem))
    return context


def test_private_keys_are_never_readable_by_others_while_they_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes: dict[str, int] = {}
    write = os.write

    def watched(fd: int, data) -> int:  # every write of every file: its mode at that moment
        modes[os.readlink(f"/proc/self/fd/{fd}")] = os.fstat(fd).st_mode & 0o777
        return write(fd, data)

    monkeypatch.setattr(os, "write", watched)
    old = os.umask(0o022)
    try:
        certs.make_certs(tmp_path, 2)
    finally:
        os.umask(old)
    secrets = [p for p in tmp_path.iterdir() if p.suffix == ".key"]
    assert sorted(p.name for p in secrets) == ["ca.key", "client-0.key", "client-1.key", "server.key"]
    written = {Path(path).name: mode for path, mode in modes.items()}
    for key in secrets:  # written through a temporary file, then moved into place
        during = [mode for name, mode in written.items() if name.startswith(f".{key.name}.")]
        assert during == [0o600], (key.name, written)
        assert key.stat().st_mode & 0o777 == 0o600


def test_fl_certs_makes_a_ca_a_server_certificate_and_client_keys_and_says_who_gets_what(tmp_path: Path) -> None:
    from cryptography import x509

    argv = [sys.executable, "-m", "clipforge.jobs.cli", "fl", "certs", str(tmp_path), "--clients", "3"]
    result = subprocess.run([*argv, "--host", "fl.example.org"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    ca = x509.load_pem_x509_certificate((tmp_path / certs.CA_CERT).read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / certs.SERVER_CERT).read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert sorted(p.name for p in tmp_path.glob("client-*.key")) == ["client-0.key", "client-1.key", "client-2.key"]
    assert "client 2 (clipforge fl join)" in result.stdout and "keep" in result.stdout
    assert sorted(p.name for p in tmp_path.glob("client-*.crt")) == ["client-0.crt", "client-1.crt", "client-2.crt"]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    subprocess.run([*argv, "--clients", "4"], check=True, capture_output=True)  # one more client, the rest kept
    assert all((tmp_path / name).read_bytes() == data for name, data in before.items())
    assert (tmp_path / "client-3.key").exists()
    kept = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith("server")}
    subprocess.run([*argv, "--clients", "4", "--host", "fl2.example.org"], check=True, capture_output=True)
    assert certs.server_hosts(tmp_path) == {"fl.example.org", "fl2.example.org"}  # re-issued for the new name too
    assert all((tmp_path / name).read_bytes() == data for name, data in kept.items())  # by the same CA


def test_a_robust_aggregation_with_secagg_or_dp_and_a_wrong_count_of_client_examples_are_refused(
    tiny_store: Path,
) -> None:
    from clipforge.jobs import fl_train
    from clipforge.ps import federation

    base = ["--data.store", str(tiny_store), *TINY, "--aggregation", "median"]
    for extra in (["--secagg"], ["--dp.noise-multiplier", "1"]):
        with pytest.raises(federation.FederationError, match="--aggregation median needs each update in the clear"):
            fl_train.check(fl_train.parse([*base, *extra]))
    wrong = fl_train.parse(["--data.store", str(tiny_store), *TINY, "--clients", "3", "--client-examples", "10", "20"])
    with pytest.raises(federation.FederationError, match="give one positive count per client .3."):
        fl_train.check(wrong)
    given = fl_train.parse(["--data.store", str(tiny_store), *TINY, "--client-examples", "10", "30"])
    fl_train.check(given)
    assert federation.plan(given).examples == [10.0, 30.0]
