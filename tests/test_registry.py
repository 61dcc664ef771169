"""The registry against real git and git-lfs, with a bare repository as the remote."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from clipforge.base.files import sha256
from clipforge.models.builders import ModelError, load_weights
from clipforge.registry.repo import Ref, Registry, RegistryError

from .registries import make_run, stored_objects

pytestmark = [pytest.mark.usefixtures("isolated_git"), pytest.mark.waits]


def test_push_then_pull_gives_identical_weights_stored_as_lfs_pointers(registry: Registry, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", 0)
    ref = registry.push(run, "clipnet")
    assert ref == Ref("clipnet", 1)
    size = subprocess.run(
        ["git", "cat-file", "-s", f"{ref.branch}:clipnet/model.safetensors"],
        cwd=registry.bare_dir,
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(size.stdout) < 200  # a pointer, not 66 KB of weights
    registry.pull(Ref.parse("clipnet@v1"), tmp_path / "pulled")
    assert sha256(tmp_path / "pulled" / "model.safetensors") == sha256(run / "final" / "model.safetensors")
    record = yaml.safe_load((tmp_path / "pulled" / "model.yaml").read_text())
    assert record["slurm_job_id"] == "4242" and record["code_commit"] == "0123abc" and record["parent"] is None
    assert "clipforge registry pull clipnet@v1" in (tmp_path / "pulled" / "MODEL.md").read_text()


def _push(args: tuple[str, str | None, str, str, dict]) -> str:
    remote, lfs_url, run, name, env = args
    os.environ.update(env)
    return str(Registry(remote, lfs_url).push(Path(run), name))


def test_eight_concurrent_pushes_give_eight_versions_and_gc_removes_orphans(registry: Registry, tmp_path: Path) -> None:
    runs = [make_run(tmp_path / f"run{i}", i) for i in range(8)]
    env = {k: os.environ[k] for k in ("HOME", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_NOSYSTEM")}
    with ProcessPoolExecutor(8) as pool:
        refs = list(pool.map(_push, [(registry.remote, registry.lfs_url, str(r), "clipnet", env) for r in runs]))
    assert sorted(refs, key=lambda r: int(r.split("@v")[1])) == [f"clipnet@v{i}" for i in range(1, 9)]
    assert registry.versions() == {"clipnet": list(range(1, 9))}
    pushed = {sha256(r / "final" / "model.safetensors") for r in runs}
    stored = {
        sha256(registry.pull(Ref("clipnet", v), tmp_path / f"p{v}") and tmp_path / f"p{v}" / "model.safetensors")
        for v in range(1, 9)
    }
    assert stored == pushed  # every run landed in exactly one version, none lost
    if registry.lfs_url:
        with pytest.raises(RegistryError, match="gc works on a bare repository path"):
            registry.gc()  # an LFS server is cleaned by its own tools
        return
    orphan = _upload_orphan(registry, tmp_path)
    assert any(p.name == orphan for p in stored_objects(registry))
    assert registry.gc() == [orphan]
    assert len(stored_objects(registry)) == 8
    registry.pull(Ref("clipnet", 3), tmp_path / "after-gc")


def _upload_orphan(registry: Registry, tmp_path: Path) -> str:
    """What a push that lost its race leaves: an LFS object uploaded for a branch that never landed."""
    run = make_run(tmp_path / "loser", 99)
    clone = tmp_path / "loser-clone"
    subprocess.run(
        ["git", "clone", "-q", registry.remote, str(clone)], check=True, env={**os.environ, "GIT_LFS_SKIP_SMUDGE": "1"}
    )
    subprocess.run(["git", "lfs", "install", "--local"], cwd=clone, check=True, capture_output=True)
    subprocess.run(["git", "checkout", "-q", "-b", "models/clipnet/v9"], cwd=clone, check=True)
    (clone / "clipnet").mkdir()
    (clone / "clipnet" / "model.safetensors").write_bytes((run / "final" / "model.safetensors").read_bytes())
    subprocess.run(["git", "add", "."], cwd=clone, check=True)
    subprocess.run(["git", "-c", "user.name=x", "-c", "user.email=x@x", "commit", "-qm", "lost"], cwd=clone, check=True)
    subprocess.run(["git", "lfs", "push", "origin", "models/clipnet/v9"], cwd=clone, check=True, capture_output=True)
    return sha256(run / "final" / "model.safetensors")


def test_a_promotion_that_lost_the_race_fails_with_a_clear_message(registry: Registry, tmp_path: Path) -> None:
    for i in range(2):
        registry.push(make_run(tmp_path / f"run{i}", i), "clipnet")
    seen = registry.aliases("clipnet").get("clipnet", {}).get("production")  # both promoters look: unset
    registry.promote(Ref.parse("clipnet@v1"), "production", expect=seen)  # the first one wins
    with pytest.raises(
        RegistryError, match=r"clipnet@production points to v1, not nothing as expected: someone promoted meanwhile"
    ):
        registry.promote(Ref.parse("clipnet@v2"), "production", expect=seen)
    assert registry.aliases("clipnet") == {"clipnet": {"production": 1}}
    registry.promote(Ref.parse("clipnet@v2"), "production", expect=1)
    assert registry.resolve(Ref.parse("clipnet@production")) == Ref("clipnet", 2)


def test_tampered_weights_in_the_remote_are_refused(registry: Registry, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", 0)
    registry.push(run, "clipnet")
    stored = stored_objects(registry)[0]
    data = bytearray(stored.read_bytes())
    data[100] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match="the stored weights do not match their sha256"):
        registry.pull(Ref.parse("clipnet@v1"), tmp_path / "pulled")
    assert not (tmp_path / "pulled" / "model.safetensors").exists()


def test_pulling_one_version_downloads_only_its_objects(registry: Registry, tmp_path: Path) -> None:
    for i in range(3):
        registry.push(make_run(tmp_path / f"run{i}", i), "clipnet")
    wanted = sha256(tmp_path / "run1" / "final" / "model.safetensors")
    others = [p for p in stored_objects(registry) if p.name != wanted]
    assert len(others) == 2
    for other in others:
        other.unlink()  # a pull that reads, or downloads, any other version's weights now fails
    fetched = registry.pull(Ref.parse("clipnet@v2"), tmp_path / "pulled")
    assert fetched == [wanted]
    assert sha256(tmp_path / "pulled" / "model.safetensors") == wanted


def test_review_shows_metric_deltas_against_the_alias(registry: Registry, tmp_path: Path) -> None:
    registry.push(make_run(tmp_path / "a", 0, top1=0.5), "clipnet")
    registry.promote(Ref.parse("clipnet@v1"), "production")
    registry.push(make_run(tmp_path / "b", 1, top1=0.7, lr=5e-4), "clipnet")
    text = registry.review(Ref.parse("clipnet@v2"), "production")
    assert "Compared with v1." in text.splitlines()  # production is v2's parent: named once, as v1
    assert "| video top-1 | 0.6000 | 0.8000 | +0.2000 ▲ better |" in text
    assert "| loss | 0.5000 | 0.3000 | -0.2000 ▲ better |" in text
    assert "- `optim.lr`: 0.001 → 0.0005" in text
    assert "# clipnet v2" in text
    diff = registry.diff(Ref.parse("clipnet@v1"), Ref.parse("clipnet@v2"))
    assert diff["metrics"]["clip_top1"] == (0.5, 0.7) and diff["config"]["optim.lr"] == (0.001, 0.0005)


def test_a_federated_models_card_states_its_privacy_guarantee(tmp_path: Path) -> None:
    registry = Registry.init(str(tmp_path / "remote.git"))
    dp = {"level": "client", "noise_multiplier": 1.1, "clipping_norm": 0.5, "delta": 1e-5, "epsilon": 3.21}
    fed = {"engine": "flower", "rounds": 20, "clients": 8, "client_fraction": 0.5, "differential_privacy": dp}
    ref = registry.push(make_run(tmp_path / "fed", 0, federated=fed), "kin")
    plain = registry.push(make_run(tmp_path / "plain", 1), "kin")
    assert registry.record(ref)["federated"]["differential_privacy"]["epsilon"] == 3.21
    card = registry.card(ref)
    assert "## Federated training" in card and "(3.21, 1e-05)-DP" in card and "20 rounds over 8 clients" in card
    assert "Federated" not in registry.card(plain) and "federated" not in registry.record(plain)


def test_a_pt_file_with_code_in_its_pickle_is_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(tmp_path / "weights.pt", "wb") as f:
        pickle.dump({"0.weight": Evil()}, f)
    with pytest.raises(ModelError, match="never unpickled"):
        load_weights(torch.nn.Linear(2, 2), tmp_path / "weights.pt")
    assert not marker.exists()
    with pytest.raises(ModelError, match="must be a .safetensors file"):
        load_weights(torch.nn.Linear(2, 2), tmp_path / "weights.pkl")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["show", "nosuch@v1"], "no model named 'nosuch'"),
        (["show", "clipnet@v7"], "clipnet@v7 does not exist; clipnet has versions v1"),
        (["show", "clipnet@staging"], "clipnet@staging is not set"),
        (["show", "Bad Name"], "is not a model name"),
    ],
)
def test_registry_mistakes_are_one_line(registry: Registry, tmp_path: Path, argv: list[str], message: str) -> None:
    registry.push(make_run(tmp_path / "run", 0), "clipnet")
    result = subprocess.run(
        [sys.executable, "-m", "clipforge.jobs.cli", "registry", "--remote", registry.remote, *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1]


def test_an_unreachable_remote_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "clipforge.jobs.cli", "registry", "--remote", str(tmp_path / "nowhere.git"), "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"cannot reach the registry at {tmp_path / 'nowhere.git'}" in result.stderr


def test_missing_git_lfs_is_one_line(registry: Registry, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(subprocess.run(["which", "git"], capture_output=True, text=True).stdout.strip(), bin_dir / "git")
    result = subprocess.run(
        [sys.executable, "-m", "clipforge.jobs.cli", "registry", "--remote", registry.remote, "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(bin_dir)},
    )
    assert result.returncode == 2
    assert "git-lfs is not installed" in result.stderr and "Traceback" not in result.stderr
