"""What the registry refuses and how it reads names: plain git against released versions and aliases, verify,
reviews merged by plain git, hosted rules and the bare remote's hooks, references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clipforge.registry import protect
from clipforge.registry.refs import alias_tag, peeled_alias
from clipforge.registry.repo import Ref, Registry, RegistryError

from .registries import make_run, stored_objects

pytestmark = [pytest.mark.usefixtures("isolated_git"), pytest.mark.waits]


def plain_git(cwd: Path, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """git as a user runs it by hand, without clipforge (LFS smudging off: the pointers are enough here)."""
    env = {**os.environ, "GIT_LFS_SKIP_SMUDGE": "1", "GIT_TERMINAL_PROMPT": "0", **env}
    identity = ["-c", "user.name=Plain User", "-c", "user.email=plain@example.org"]
    result = subprocess.run(["git", *identity, *args], cwd=cwd, capture_output=True, text=True, env=env)
    if check:
        assert result.returncode == 0, result.stderr[-2000:]
    return result


def plain_clone(registry: Registry, to: Path) -> Path:
    plain_git(to.parent, "clone", "-q", "--no-checkout", registry.remote, str(to))
    plain_git(to, "fetch", "-q", "origin", "+refs/heads/*:refs/remotes/origin/*", "+refs/tags/*:refs/tags/*")
    return to


def test_plain_git_cannot_rewrite_or_delete_released_versions_or_aliases(registry: Registry, tmp_path: Path) -> None:
    for i in range(2):
        registry.push(make_run(tmp_path / f"run{i}", i), "clipnet")
    registry.promote(Ref.parse("clipnet@v1"), "production")
    clone = plain_clone(registry, tmp_path / "clone")
    plain_git(clone, "checkout", "-q", "--orphan", "evil")
    (clone / "clipnet").mkdir()
    (clone / "clipnet" / "model.yaml").write_text("name: clipnet\nversion: 1\n")
    plain_git(clone, "add", "clipnet")
    plain_git(clone, "commit", "-qm", "clipnet v1\n\nRegistry-Version: clipnet@v1")  # even with the trailer
    attempts = {
        "force push over v1": (
            ["push", "-f", "origin", "evil:models/clipnet/v1"],
            "released version and cannot be rewritten",
        ),
        "delete v2": (
            ["push", "origin", ":models/clipnet/v2"],
            "clipnet@v2 is a released version and cannot be deleted",
        ),
        "delete the alias": (
            ["push", "origin", ":refs/tags/clipnet/production"],
            "alias clipnet/production cannot be deleted",
        ),
        "alias to a non-version": (
            ["push", "-f", "origin", "evil:refs/tags/clipnet/production"],
            "alias clipnet/production must point at a released version",
        ),
        "a version without the record": (
            ["push", "origin", "origin/main:refs/heads/models/clipnet/v7"],
            "lacks the record",
        ),
    }
    for what, (args, message) in attempts.items():
        result = plain_git(clone, *args, check=False)
        assert result.returncode != 0, what
        assert "clipforge registry: refused" in result.stderr and message in result.stderr, (what, result.stderr)
    rewrite = plain_git(clone, "push", "-f", "origin", "evil:main", check=False)  # the hook or git's own check
    assert rewrite.returncode != 0 and ("non-fast-forward" in rewrite.stderr or "append-only" in rewrite.stderr)
    assert registry.versions("clipnet") == {"clipnet": [1, 2]} and registry.aliases("clipnet") == {
        "clipnet": {"production": 1}
    }
    problems, counts = registry.verify()
    assert problems == [] and counts == {"versions": 2, "aliases": 1}


def test_verify_reports_a_version_rewritten_behind_the_registrys_back_and_replaced_weights(
    registry: Registry, tmp_path: Path
) -> None:
    for i in range(3):
        registry.push(make_run(tmp_path / f"run{i}", i), "clipnet")
    registry.promote(Ref.parse("clipnet@v1"), "production")
    # A remote without the hook (a hosted one before `registry protect`): plain git can rewrite v1.
    (registry.bare_dir / "hooks" / "pre-receive").unlink()
    for key in ("receive.denyNonFastForwards", "receive.denyDeletes"):
        subprocess.run(["git", "--git-dir", str(registry.bare_dir), "config", key, "false"], check=True)
    clone = plain_clone(registry, tmp_path / "clone")
    plain_git(clone, "checkout", "-q", "-B", "v1", "origin/models/clipnet/v1")
    record = yaml.safe_load(plain_git(clone, "show", "HEAD:clipnet/model.yaml").stdout)
    record["metrics"]["video_top1"] = 0.99  # a better number, silently
    (clone / "clipnet" / "model.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    plain_git(clone, "add", "clipnet/model.yaml")
    plain_git(clone, "commit", "-qm", "clipnet v1\n\nRegistry-Version: clipnet@v1")
    plain_git(clone, "push", "-q", "-f", "origin", "v1:models/clipnet/v1")
    # And v2's weights replaced in the LFS store.
    oid = registry.record(Ref.parse("clipnet@v2"))["files"]["model.safetensors"]["sha256"]
    stored = next(p for p in stored_objects(registry) if p.name == oid)
    stored.write_bytes((tmp_path / "run2" / "final" / "model.safetensors").read_bytes())
    problems, _ = registry.verify()
    assert any(p.startswith("clipnet@v1: rewritten after its push") for p in problems), problems
    assert any(p.startswith("clipnet@v2:") and oid[:12] in p for p in problems), problems
    assert not any(p.startswith("clipnet@v3") for p in problems), problems
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipforge.jobs.cli",
            "registry",
            "--remote",
            registry.remote,
            *(["--lfs-url", registry.lfs_url] if registry.lfs_url else []),
            "verify",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "TAMPERED  clipnet@v1: rewritten after its push" in result.stdout, result.stdout


def test_a_proposed_promotion_merged_by_plain_git_moves_the_alias_and_is_in_the_history(
    registry: Registry, tmp_path: Path
) -> None:
    for i in range(2):
        registry.push(make_run(tmp_path / f"run{i}", i, top1=0.5 + i / 10), "clipnet")
    registry.promote(Ref.parse("clipnet@v1"), "production", why="first model")
    branch, body = registry.propose(Ref.parse("clipnet@v2"), "production", why="better video top-1")
    assert branch == "promote/clipnet/production/v2" and "Compared with v1." in body
    assert registry.aliases("clipnet") == {"clipnet": {"production": 1}}  # proposing moves nothing
    clone = plain_clone(registry, tmp_path / "clone")
    plain_git(clone, "checkout", "-q", "-B", "main", "origin/main")
    plain_git(
        clone, "merge", "-q", "--no-ff", f"origin/{branch}", "-m", f"Merge {branch}", GIT_COMMITTER_NAME="Rev Iewer"
    )
    plain_git(clone, "push", "-q", "origin", "main", GIT_COMMITTER_NAME="Rev Iewer")
    assert registry.aliases("clipnet") == {"clipnet": {"production": 2}}  # the merge moved it
    plain_git(clone, "fetch", "-q", "-f", "origin", "+refs/tags/*:refs/tags/*")
    tip = plain_git(clone, "rev-parse", "clipnet/production^{commit}").stdout.strip()
    assert tip == plain_git(clone, "rev-parse", "origin/models/clipnet/v2").stdout.strip()  # plain git resolves it
    history = registry.history("clipnet")
    assert [(m["from"], m["to"], m["why"]) for m in history] == [(None, 1, "first model"), (1, 2, "better video top-1")]
    assert history[0]["via"] == "promote" and history[1]["via"] == f"pull request {branch}"
    assert history[1]["merged_by"].startswith("Rev Iewer")
    problems, _ = registry.verify()
    assert problems == []


def test_the_review_names_the_changed_tensor_and_warns_when_the_data_differ(registry: Registry, tmp_path: Path) -> None:
    registry.push(make_run(tmp_path / "a", 0), "clipnet")
    registry.push(make_run(tmp_path / "b", 0, nudge="1.bias", store_sha="cd" * 32), "clipnet")
    text = registry.review(Ref.parse("clipnet@v2"), "production")
    assert "Weights against v1: 1 tensors changed, 1 unchanged, 0 added, 0 removed" in text
    assert "| `1.bias` | 64 | 0.01 |" in text
    warning = [line for line in text.splitlines() if line.startswith("**Warning:**")]
    assert len(warning) == 1 and "the metrics come from different data (clip store differ" in warning[0]


def test_init_gives_a_group_shared_registry_and_protect_prints_hosted_rules(tmp_path: Path) -> None:
    import grp
    import json

    remote = tmp_path / "team.git"
    Registry.init(str(remote), group="users")
    config = subprocess.run(
        ["git", "--git-dir", str(remote), "config", "core.sharedRepository"], capture_output=True, text=True
    )
    assert config.stdout.strip() == "group"
    gid = grp.getgrnam("users").gr_gid
    assert all(p.stat().st_gid == gid for p in [remote, *remote.rglob("*")])
    assert (remote / "refs").stat().st_mode & 0o2070 == 0o2070  # setgid, group-writable: new files stay the team's
    cli = [sys.executable, "-m", "clipforge.jobs.cli", "registry", "--remote"]
    bad = subprocess.run(
        [*cli, str(tmp_path / "x.git"), "init", "--group", "no-such-group"], capture_output=True, text=True
    )
    assert (
        bad.returncode != 0 and "Traceback" not in bad.stderr and "group 'no-such-group' does not exist" in bad.stderr
    )
    shown = subprocess.run([*cli, "https://github.com/acme/models.git", "protect"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    rules = [
        json.loads(line.split("echo ", 1)[1].rsplit(" | gh", 1)[0].strip("'"))
        for line in shown.stdout.splitlines()
        if line.startswith("echo ")
    ]
    kinds = {rule["type"] for r in rules for rule in r["rules"]}
    assert kinds == {"deletion", "non_fast_forward", "update"} and "repos/acme/models/rulesets" in shown.stdout
    odd = subprocess.run([*cli, "/some/path.git", "protect"], capture_output=True, text=True)
    assert odd.returncode != 0 and "is not a GitHub or GitLab URL" in odd.stderr and "Traceback" not in odd.stderr


@pytest.mark.parametrize(
    "text,ref",
    [
        ("clipnet", Ref("clipnet")),
        ("clipnet@v3", Ref("clipnet", version=3)),
        ("clipnet@v12", Ref("clipnet", version=12)),
        ("clipnet@production", Ref("clipnet", alias="production")),
        ("videomae-b.k400_v2@staging", Ref("videomae-b.k400_v2", alias="staging")),
        ("clipnet@v3x", Ref("clipnet", alias="v3x")),  # not a version number: a name, so an alias
    ],
)
def test_a_reference_parses_to_a_version_an_alias_or_the_newest(text: str, ref: Ref) -> None:
    assert Ref.parse(text) == ref
    assert str(Ref.parse(text)) == text


@pytest.mark.parametrize(
    "text,message",
    [
        ("Clipnet", "'Clipnet' is not a model name"),
        ("clip net@v1", "'clip net' is not a model name"),
        ("", "'' is not a model name"),
        ("-clipnet", "'-clipnet' is not a model name"),
        ("clipnet@V3", "'clipnet@V3': after '@' give a version (v3) or an alias (production)"),
        ("clipnet@prod/uction", "'clipnet@prod/uction': after '@' give a version"),
    ],
)
def test_a_malformed_reference_is_refused_with_what_to_write(text: str, message: str) -> None:
    with pytest.raises(RegistryError) as caught:
        Ref.parse(text)
    assert str(caught.value).startswith(message)


def test_a_version_is_a_branch_and_an_alias_a_tag() -> None:
    ref = Ref("clipnet", version=3)
    assert ref.branch == "models/clipnet/v3"
    assert Ref.of_branch(f"refs/heads/{ref.branch}") == ref
    for other in ("refs/heads/main", "refs/heads/models/clipnet/latest", "refs/heads/models/a/b/v1", "models/x/v1"):
        assert Ref.of_branch(other) is None, other
    assert alias_tag("clipnet", "production") == "refs/tags/clipnet/production"
    assert peeled_alias("refs/tags/clipnet/production^{}") == ("clipnet", "production")
    assert peeled_alias("refs/tags/clipnet/production") is None  # the tag object itself, not its commit


def hosted_forbids(rulesets: list[dict], ref: str, change: str) -> bool:
    """Whether GitHub would refuse ``change`` (create, update, force or delete) of ``ref`` under ``rulesets``.

    GitHub's ref_name patterns are fnmatch's: ``*`` stops at '/', ``**`` does not.
    """
    import re

    forbids = {"deletion": {"delete"}, "non_fast_forward": {"force"}, "update": {"update", "force"}}
    for ruleset in rulesets:
        prefix = "refs/heads/" if ruleset["target"] == "branch" else "refs/tags/"
        patterns = [
            re.escape(p).replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
            for p in ruleset["conditions"]["ref_name"]["include"]
        ]
        if ref.startswith(prefix) and any(re.fullmatch(p, ref) for p in patterns):
            if any(change in forbids.get(rule["type"], set()) for rule in ruleset["rules"]):
                return True
    return False


def test_the_bare_remotes_hooks_refuse_the_pushes_the_hosted_rules_forbid_and_allow_the_rest(tmp_path: Path) -> None:
    import json

    _, commands, _ = protect.hosted_rules("https://github.com/acme/models.git")
    rulesets = [json.loads(command[-1]) for command in commands]
    registry = Registry.init(str(tmp_path / "remote.git"))
    for i in range(2):
        registry.push(make_run(tmp_path / f"run{i}", i), "clipnet")
    registry.promote(Ref.parse("clipnet@v1"), "production")
    clone = plain_clone(registry, tmp_path / "clone")
    plain_git(clone, "checkout", "-q", "-B", "on-v1", "origin/models/clipnet/v1")
    (clone / "clipnet" / "notes.txt").write_text("a fix after the release\n")
    plain_git(clone, "add", "clipnet/notes.txt")
    plain_git(clone, "commit", "-qm", "clipnet v1\n\nRegistry-Version: clipnet@v1")
    plain_git(clone, "checkout", "-q", "--orphan", "evil")
    plain_git(clone, "commit", "-q", "--allow-empty", "-m", "history, rewritten")
    forbidden = {
        "delete a version": (["push", "origin", ":models/clipnet/v2"], "refs/heads/models/clipnet/v2", "delete"),
        "force over a version": (
            ["push", "-f", "origin", "evil:models/clipnet/v1"],
            "refs/heads/models/clipnet/v1",
            "force",
        ),
        "fast-forward a version": (
            ["push", "origin", "on-v1:models/clipnet/v1"],
            "refs/heads/models/clipnet/v1",
            "update",
        ),
        "delete an alias": (
            ["push", "origin", ":refs/tags/clipnet/production"],
            "refs/tags/clipnet/production",
            "delete",
        ),
        "force over main": (["push", "-f", "origin", "evil:main"], "refs/heads/main", "force"),
        "delete main": (["push", "origin", ":main"], "refs/heads/main", "delete"),
    }
    before = registry.origin.ls_remote("refs/*")
    for what, (args, ref, change) in forbidden.items():
        assert hosted_forbids(rulesets, ref, change), f"the hosted rules allow: {what}"
        result = plain_git(clone, *args, check=False)
        assert result.returncode != 0 and "rejected" in result.stderr, (what, result.stderr)
    assert registry.origin.ls_remote("refs/*") == before  # not one ref moved
    # What the registry itself pushes, both allow: a new version branch, and main moved forward.
    assert not hosted_forbids(rulesets, "refs/heads/models/clipnet/v3", "create")
    assert not hosted_forbids(rulesets, "refs/heads/main", "update")
    assert registry.push(make_run(tmp_path / "run2", 2), "clipnet") == Ref("clipnet", 3)
    plain_git(clone, "checkout", "-q", "-B", "main", "origin/main")
    (clone / "NOTES.md").write_text("reviewed by the team\n")
    plain_git(clone, "add", "NOTES.md")
    plain_git(clone, "commit", "-qm", "notes")
    plain_git(clone, "pull", "-q", "--rebase", "origin", "main")
    plain_git(clone, "push", "-q", "origin", "main")
