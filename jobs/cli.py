"""``clipforge``: one command line over the rooms.

clipforge cluster up|down|status|env     a Slurm cluster on this host (--nodes N: N nodes)
clipforge jobs run NAME [ARGS]           run a job module (selftest, ...)
clipforge jobs list|status|logs|cancel   jobs submitted through clipforge
clipforge jobs sbatch-lines              #SBATCH lines for given resources
clipforge registry init|push|list|show|diff|pull|promote|propose|history|sync|review|verify|protect|gc
                                         model versions as Git LFS branches
clipforge store inspect|verify STORE     a clip store's videos (timing, decodable span, what is odd); its shards
clipforge models import PATH --from F    a published checkpoint (VideoMAE, VideoMAE V2, Hugging Face, torchvision)
clipforge demo                           the main job on the embedded default
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

from clipforge.base.logs import setup_logging
from clipforge.hpc import records
from clipforge.hpc.cluster import LocalCluster
from clipforge.hpc.launch import job_spec, run_script
from clipforge.hpc.profile import load_profile
from clipforge.hpc.resources import Resources
from clipforge.jobs import config

JOB_MODULES = {
    name: f"clipforge.jobs.{name}" for name in ("selftest", "preprocess", "train", "ps_train", "evaluate", "predict")
}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    setup_logging()
    return config.guarded(lambda: args.func(args, rest))()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clipforge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(metavar="COMMAND")

    cluster = sub.add_parser("cluster", help="start, stop or inspect the Slurm cluster on this host (--nodes N)")
    cluster.add_argument("action", choices=["up", "down", "status", "env"])
    cluster.add_argument("--no-accounting", action="store_true", help="skip slurmdbd and MariaDB (sacct will not work)")
    cluster.add_argument(
        "--nodes", type=int, help="up: 1 (default), this host is the node; 2-9: nodes n1..nN in network namespaces"
    )
    cluster.add_argument("--subnet", default="10.77.0", help="the nodes' /24 when there are several (default 10.77.0)")
    cluster.set_defaults(func=_cluster)

    jobs = sub.add_parser("jobs", help="run job modules and follow submitted jobs")
    jsub = jobs.add_subparsers(metavar="ACTION")
    run = jsub.add_parser(
        "run", add_help=False, help=f"run a job module: {', '.join(JOB_MODULES)} (its own --help lists options)"
    )
    run.add_argument("name", choices=sorted(JOB_MODULES))
    run.set_defaults(func=_jobs_run, passthrough=True)
    lst = jsub.add_parser("list", help="jobs submitted through clipforge, newest first")
    lst.set_defaults(func=_jobs_list)
    for verb, func, text in (
        ("status", _jobs_status, "state and folder of one job"),
        ("logs", _jobs_logs, "print a job's logs"),
        ("cancel", _jobs_cancel, "cancel a job"),
    ):
        p = jsub.add_parser(verb, help=text)
        p.add_argument("job_id")
        if verb == "logs":
            p.add_argument("--follow", action="store_true", help="keep printing until the job ends")
        p.set_defaults(func=func)
    lines = jsub.add_parser("sbatch-lines", help="#SBATCH lines for resources given as job options (--nodes 2 ...)")
    lines.add_argument("--cluster", default=None, help="profile whose defaults fill the gaps")
    lines.add_argument("--job", choices=sorted(JOB_MODULES), help="start from this job's default resources")
    lines.set_defaults(func=_sbatch_lines, passthrough=True)

    reg = sub.add_parser("registry", help="model versions in a Git LFS registry (--remote or $CLIPFORGE_REGISTRY)")
    reg.add_argument(
        "--remote",
        default=os.environ.get("CLIPFORGE_REGISTRY"),
        help="registry remote: a bare repository path or a URL",
    )
    reg.add_argument(
        "--lfs-url",
        default=os.environ.get("CLIPFORGE_REGISTRY_LFS_URL"),
        help="LFS server URL when it is not the git remote's",
    )
    rsub = reg.add_subparsers(metavar="VERB")
    ref_help = "a version: NAME@vN, or NAME@ALIAS (an alias tag such as production)"
    for verb, text, arguments in (
        (
            "init",
            "create a registry: a protected bare repository at --remote, and its main branch",
            [("--group", {"help": "Unix group that shares the repository: its members push, nobody else writes"})],
        ),
        (
            "push",
            "push a finished run as the next version of NAME",
            [
                ("run_dir", {"help": "a finished run directory (it has final weights and a run record)"}),
                ("--name", {"required": True, "help": "model name; versions of it are numbered v1, v2, ..."}),
            ],
        ),
        ("list", "models, versions and aliases", [("name", {"nargs": "?", "help": "only this model"})]),
        ("show", "a version's card (NAME@vN or NAME@ALIAS)", [("ref", {"help": ref_help})]),
        (
            "diff",
            "metric, config and size differences of two versions",
            [
                ("a", {"help": "the base version (NAME@vN or NAME@ALIAS)"}),
                ("b", {"help": "the version compared with it"}),
            ],
        ),
        (
            "pull",
            "fetch one version's files, verified, into --to",
            [
                ("ref", {"help": ref_help}),
                ("--to", {"required": True, "help": "directory to put model.safetensors, model.yaml and MODEL.md in"}),
            ],
        ),
        (
            "promote",
            "point an alias tag at a version (compare-and-swap)",
            [
                ("ref", {"help": "the version to promote (NAME@vN)"}),
                ("--alias", {"required": True, "help": "alias to point at it, e.g. production or staging"}),
                (
                    "--expect",
                    {
                        "help": "the version the alias must point at now (vN, or none for a new alias); "
                        "default: whatever it points at when read, so a concurrent promote is refused"
                    },
                ),
                ("--why", {"default": "", "help": "why, for the alias's history"}),
            ],
        ),
        (
            "propose",
            "propose a promotion as a pull request: a branch whose merge into main moves the alias",
            [
                ("ref", {"help": "the version to promote (NAME@vN)"}),
                ("--alias", {"required": True, "help": "alias to point at it, e.g. production"}),
                ("--why", {"default": "", "help": "why, for the alias's history and the pull request"}),
                ("--open", {"action": "store_true", "help": "open the pull request with gh or glab"}),
            ],
        ),
        ("history", "every alias move of a model: who, when, from, to, why", [("name", {"help": "model name"})]),
        ("sync", "point alias tags at what main's alias files say (after a merge on a host without hooks)", []),
        ("verify", "check versions against the ledger, weights against their sha256, aliases against versions", []),
        (
            "protect",
            "print (or apply, with gh or glab) the rules that protect a GitHub or GitLab registry",
            [("--apply", {"action": "store_true", "help": "apply them with the host's CLI"})],
        ),
        (
            "review",
            "the pull-request body for a version",
            [
                ("ref", {"help": ref_help}),
                (
                    "--against",
                    {"default": "production", "help": "the version or alias to compare with (default: production)"},
                ),
                ("--open", {"action": "store_true", "help": "open the pull request with gh or glab"}),
                ("--no-weights", {"action": "store_true", "help": "skip the weight diff (it pulls both versions)"}),
            ],
        ),
        ("gc", "delete LFS objects no version refers to (bare remotes)", []),
    ):
        p = rsub.add_parser(verb, help=text, description=text)
        for flag, options in arguments:
            p.add_argument(flag, **options)
        p.set_defaults(func=_registry, verb=verb)

    store = sub.add_parser("store", help="look into a packed clip store")
    ssub = store.add_subparsers(metavar="VERB")
    inspect = ssub.add_parser(
        "inspect",
        help="per store and per video: timing, decodable span, clips, repeated frames, the videos worth a look",
    )
    inspect.add_argument("store", help="the store's directory")
    inspect.add_argument("--json", action="store_true", help="everything, every video included, as JSON")
    inspect.add_argument("--all", action="store_true", help="list every video, not only those worth a look")
    inspect.set_defaults(func=_store_inspect)
    verify = ssub.add_parser("verify", help="check that every shard is there with the size the index recorded")
    verify.add_argument("store", help="the store's directory")
    verify.set_defaults(func=_store_verify)

    fl = sub.add_parser("fl", help="federated training on Flower: the federation's keys")
    flsub = fl.add_subparsers(metavar="VERB")
    keys = flsub.add_parser(
        "certs",
        help="a CA, the server's TLS certificate and one key pair per client, and what to hand to whom",
    )
    keys.add_argument("folder", help="where the keys go (existing ones are kept)")
    keys.add_argument("--clients", type=int, default=2, help="client key pairs to make (client-0 ... client-N-1)")
    keys.add_argument(
        "--host",
        action="append",
        default=None,
        help="a name or address the server is reached at (repeat; default: the certificate there, or localhost "
        "and 127.0.0.1); a new one re-issues the server's certificate from the same CA",
    )
    keys.set_defaults(func=_fl_certs)

    models = sub.add_parser("models", help="published checkpoints in: VideoMAE, VideoMAE V2, Hugging Face, torchvision")
    msub = models.add_subparsers(metavar="VERB")
    imp = msub.add_parser(
        "import",
        help="a downloaded checkpoint as clipforge weights and their architecture record, for --model.weights or "
        "clipforge registry push",
    )
    imp.add_argument("path", help="the checkpoint: a .pth (VideoMAE, torchvision) or a Hugging Face folder")
    imp.add_argument("--from", dest="source", required=True, choices=["videomae", "videomaev2", "hf", "torchvision"])
    imp.add_argument("--name", required=True, help="the imported model's folder name (and a registry name for it)")
    imp.add_argument("--out", default="models", help="where the NAME folder goes (default: models/)")
    imp.add_argument("--model", default=None, help="the torchvision architecture (r2plus1d_18, mvit_v2_s, ...)")
    imp.add_argument("--frames", type=int, default=None, help="frames per clip it was trained at (VideoMAE: 16)")
    imp.add_argument("--image-size", type=int, default=None, help="frame size it was trained at (VideoMAE: 224)")
    imp.add_argument("--heads", type=int, default=None, help="attention heads, when not the size's usual number")
    imp.add_argument("--classes", type=Path, default=None, help="a file of class names, one per line, in order")
    imp.set_defaults(func=_models_import)

    demo = sub.add_parser("demo", help="run the main job on the embedded default (no cluster needed)")
    demo.add_argument("--cluster", default=None, help="a cluster profile to run on instead of local processes")
    demo.add_argument("--workdir", default="runs/demo", help="where the demo corpus, store and runs go")
    demo.set_defaults(func=_demo)
    return parser


def _cluster(args: argparse.Namespace, rest: list[str]) -> int:
    # down, status and env act on the cluster as it was brought up.
    nodes = args.nodes or (1 if args.action == "up" else LocalCluster().recorded_nodes())
    cluster = LocalCluster(accounting=not args.no_accounting, nodes=nodes, subnet=args.subnet)
    if args.action == "up":
        cluster.up()
        print(f"export SLURM_CONF={cluster.conf}")
    elif args.action == "down":
        cluster.down()
    elif args.action == "env":
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        for daemon, running in cluster.status().items():
            print(f"{daemon:10s} {'running' if running else 'stopped'}")
        return 0 if cluster.is_up() else 1
    return 0


def _jobs_run(args: argparse.Namespace, rest: list[str]) -> int:
    result = run_script(JOB_MODULES[args.name], rest)
    return result if isinstance(result, int) else 0


def _jobs_list(args: argparse.Namespace, rest: list[str]) -> int:
    print(f"{'JOB':>12}  {'STATE':<11} {'EXECUTOR':<8} {'SUBMITTED':<19} NAME")
    for r in records.list_jobs():
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.submitted_at))
        print(f"{r.job_id:>12}  {r.state:<11} {r.executor:<8} {when:<19} {r.name}")
    return 0


def _jobs_status(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        r = records.find_job(args.job_id)
        status: dict = {"job_id": r.job_id, "state": r.state, "name": r.name, "folder": str(r.folder)}
        reason = records.failure(r)
        if reason:
            status.update(reason=reason, log=str(next((p for p in r.logs if p.suffix == ".err"), r.logs[0])))
        slurm = r.executor == "slurm"
    except records.UnknownJob:
        status, slurm = {"job_id": args.job_id}, True  # perhaps a plain `sbatch jobs/<job>.py`
    runs = records.slurm_runs(args.job_id) if slurm else []
    if runs:
        # A requeued job (a node failure, a preemption) has one run per start; the last is the current one.
        status.setdefault("state", runs[-1]["state"])
        status.update(restarts=len(runs) - 1, runs=runs)
    elif "name" not in status:
        raise records.UnknownJob(
            f"no job {args.job_id} under {records.jobs_root()} or in Slurm's accounting;"
            " `clipforge jobs list` shows the known ones"
        )
    print(json.dumps(status, indent=1))
    return 0


def _jobs_logs(args: argparse.Namespace, rest: list[str]) -> int:
    r = records.find_job(args.job_id)
    seen: dict = {}
    while True:
        for path in r.logs:
            text = path.read_text(errors="replace")
            if text[seen.get(path, 0) :]:
                print(text[seen.get(path, 0) :], end="")
            seen[path] = len(text)
        now = records.find_job(args.job_id) if args.follow else r
        if not args.follow or now.state not in records.ACTIVE:
            reason = records.failure(now)
            if reason:
                print(f"clipforge: job {args.job_id} failed: {reason}", file=sys.stderr)
            return 0
        time.sleep(records.POLL_INTERVAL_S)


def _jobs_cancel(args: argparse.Namespace, rest: list[str]) -> int:
    records.cancel(records.find_job(args.job_id))
    print(f"cancelled {args.job_id}")
    return 0


def _sbatch_lines(args: argparse.Namespace, rest: list[str]) -> int:
    if args.job:
        resources = job_spec(JOB_MODULES[args.job]).parse(rest).resources
    else:
        resources = config.parse(Resources, rest)
    print("\n".join(load_profile(args.cluster).apply(resources).sbatch_lines()))
    return 0


def _registry(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.registry.repo import Ref, Registry

    if not args.remote:
        raise config.ConfigError("no registry: pass --remote PATH_OR_URL or set CLIPFORGE_REGISTRY")
    if args.verb == "init":
        bare = "://" not in args.remote
        Registry.init(args.remote, args.lfs_url, bare=bare, group=args.group)
        print(
            f"registry created at {args.remote}"
            + (
                ": versions and aliases cannot be rewritten or deleted there"
                if bare
                else f"; protect it on the host: clipforge registry --remote {args.remote} protect"
            )
        )
        return 0
    if args.verb == "protect":
        return _registry_protect(args)
    reg = Registry(args.remote, args.lfs_url)
    if args.verb == "push":
        ref = reg.push(Path(args.run_dir), args.name)
        print(f"pushed {ref} (branch {ref.branch}); review it with: clipforge registry review {ref}")
    elif args.verb == "list":
        aliases = reg.aliases(args.name)
        for name, versions in reg.versions(args.name).items():
            tags = {v: a for a, v in aliases.get(name, {}).items()}
            print(f"{name}: " + " ".join(f"v{v}" + (f" ({tags[v]})" if v in tags else "") for v in versions))
    elif args.verb == "show":
        print(reg.card(Ref.parse(args.ref)))
    elif args.verb == "diff":
        print(json.dumps(reg.diff(Ref.parse(args.a), Ref.parse(args.b)), indent=1, default=str))
    elif args.verb == "pull":
        fetched = reg.pull(Ref.parse(args.ref), Path(args.to))
        print(f"pulled {args.ref} into {args.to} ({len(fetched)} LFS object(s) downloaded, sha256 verified)")
    elif args.verb == "promote":
        expect = "current" if args.expect is None else (None if args.expect == "none" else int(args.expect.lstrip("v")))
        ref = reg.promote(Ref.parse(args.ref), args.alias, expect=expect, why=args.why)
        print(f"{ref.name}@{args.alias} -> v{ref.version}")
    elif args.verb == "propose":
        branch, text = reg.propose(Ref.parse(args.ref), args.alias, why=args.why)
        print(text)
        print(f"\nproposed on branch {branch}: merging it into main moves {args.ref.split('@')[0]}@{args.alias}")
        if args.open:
            return _open_pull_request(f"Promote {args.ref} to {args.alias}", text, branch)
    elif args.verb == "history":
        moves = reg.history(args.name)
        if not moves:
            print(f"{args.name}: no alias has moved yet")
        for m in moves:
            before = f"v{m['from']}" if m["from"] else "unset"
            merged = f", merged by {m['merged_by'].rsplit(' ', 2)[0]}" if m["via"].startswith("pull request") else ""
            print(
                f"{m['at']}  {args.name}@{m['alias']}: {before} -> v{m['to']}  by {m['by']} via {m['via']}{merged}"
                + (f": {m['why']}" if m["why"] else "")
            )
    elif args.verb == "sync":
        moved = reg.sync()
        print("\n".join(moved) if moved else "every alias tag already matches main")
    elif args.verb == "verify":
        problems, counts = reg.verify()
        for problem in problems:
            print(f"TAMPERED  {problem}")
        print(
            f"{counts['versions']} versions and {counts['aliases']} aliases checked: "
            + (f"{len(problems)} problem(s)" if problems else "every version matches its ledger and sha256")
        )
        return 1 if problems else 0
    elif args.verb == "review":
        text = reg.review(Ref.parse(args.ref), args.against, weights_too=not args.no_weights)
        print(text)
        if args.open:
            return _open_pull_request(str(Ref.parse(args.ref)), text)
    elif args.verb == "gc":
        removed = reg.gc()
        print(f"removed {len(removed)} orphaned LFS object(s)")
    return 0


def _registry_protect(args: argparse.Namespace) -> int:
    import shlex

    from clipforge.registry.protect import apply_rules, hosted_rules

    host, commands, what = hosted_rules(args.remote)
    print(f"# {host}: {what}")
    for command in commands:
        argv, stdin = (command[:-1], command[-1]) if "--input" in command else (command, None)
        line = shlex.join(argv)
        print(f"echo {shlex.quote(stdin)} | {line}" if stdin else line)
    if args.apply:
        for done in apply_rules(commands):
            print(f"applied: {done}")
    else:
        print("# run these (or pass --apply with the host's CLI installed); `registry verify` checks afterwards")
    return 0


def _open_pull_request(title: str, body: str, head: str | None = None) -> int:
    import shutil
    import subprocess

    tools = (
        ("gh", ["gh", "pr", "create", "--title", title, "--body", body, *(["--head", head] if head else [])]),
        (
            "glab",
            [
                "glab",
                "mr",
                "create",
                "--title",
                title,
                "--description",
                body,
                *(["--source-branch", head] if head else []),
            ],
        ),
    )
    for tool, argv in tools:
        if shutil.which(tool):
            return subprocess.run(argv, check=False).returncode
    print("neither gh nor glab is installed: paste the text above into a new pull request", file=sys.stderr)
    return 0


def _store_inspect(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.preprocess.quality import inspect_store

    report = inspect_store(Path(args.store))
    print(json.dumps(report.to_json(), indent=1) if args.json else "\n".join(report.lines(every_video=args.all)))
    return 0


def _store_verify(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.preprocess.store import ClipStore

    store = ClipStore.open(Path(args.store))
    store.verify()
    print(f"{args.store}: {len(store.shard_names)} shards, every one present with its recorded size")
    return 0


def _fl_certs(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.ps import certs

    made = certs.make_certs(Path(args.folder), args.clients, tuple(args.host) if args.host else None)
    hosts = sorted(certs.server_hosts(Path(args.folder)))
    print(f"{len(made)} files made in {args.folder} (server certificate for {', '.join(hosts)})")
    print("\n".join(certs.handout(Path(args.folder), args.clients)))
    return 0


def _models_import(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.models.imports import import_checkpoint

    out = Path(args.out) / args.name
    weights, imported = import_checkpoint(
        Path(args.path), args.source, out, args.model, args.frames, args.image_size, args.heads, args.classes
    )
    kind = "encoder (pretraining, no classifier)" if imported.encoder_only else f"{len(imported.classes)} classes"
    arch = ", ".join(f"{k} {v}" for k, v in imported.overrides.items())
    print(f"imported {args.path} ({args.source}) as {imported.model} [{arch}], {kind}, "
          f"{imported.frames}x{imported.image_size}x{imported.image_size} clips")  # fmt: skip
    for note in imported.notes:
        print(f"  {note}")
    print(f"  weights   {weights}")
    print(f"  fine-tune python jobs/train.py --model.weights {out} --data.store STORE ...")
    print(f"  version   clipforge registry push {out} --name {args.name}")
    return 0


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    demo = importlib.import_module("clipforge.jobs.demo")
    return demo.run(cluster=args.cluster, workdir=Path(args.workdir))


if __name__ == "__main__":
    sys.exit(main())
