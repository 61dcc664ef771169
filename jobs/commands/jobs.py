"""``clipforge jobs run|list|status|logs|cancel|sbatch-lines``: job modules and the jobs submitted through clipforge."""

from __future__ import annotations

import argparse
import json
import sys
import time

from clipforge.hpc import records
from clipforge.hpc.launch import job_spec, run_script
from clipforge.hpc.profile import load_profile
from clipforge.hpc.resources import Resources
from clipforge.jobs import config

JOB_MODULES = {
    name: f"clipforge.jobs.{name}" for name in ("selftest", "preprocess", "train", "ps_train", "evaluate", "predict")
}


def add_to(commands: argparse._SubParsersAction) -> None:
    jobs = commands.add_parser("jobs", help="run job modules and follow submitted jobs")
    actions = jobs.add_subparsers(metavar="ACTION")
    run = actions.add_parser(
        "run", add_help=False, help=f"run a job module: {', '.join(JOB_MODULES)} (its own --help lists options)"
    )
    run.add_argument("name", choices=sorted(JOB_MODULES))
    run.set_defaults(func=_run, passthrough=True)
    actions.add_parser("list", help="jobs submitted through clipforge, newest first").set_defaults(func=_list)
    for verb, func, text in (
        ("status", _status, "state and folder of one job"),
        ("logs", _logs, "print a job's logs"),
        ("cancel", _cancel, "cancel a job"),
    ):
        p = actions.add_parser(verb, help=text)
        p.add_argument("job_id")
        if verb == "logs":
            p.add_argument("--follow", action="store_true", help="keep printing until the job ends")
        p.set_defaults(func=func)
    lines = actions.add_parser("sbatch-lines", help="#SBATCH lines for resources given as job options (--nodes 2 ...)")
    lines.add_argument("--cluster", default=None, help="profile whose defaults fill the gaps")
    lines.add_argument("--job", choices=sorted(JOB_MODULES), help="start from this job's default resources")
    lines.set_defaults(func=_sbatch_lines, passthrough=True)


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    result = run_script(JOB_MODULES[args.name], rest)
    return result if isinstance(result, int) else 0


def _list(args: argparse.Namespace, rest: list[str]) -> int:
    print(f"{'JOB':>12}  {'STATE':<11} {'EXECUTOR':<8} {'SUBMITTED':<19} NAME")
    for r in records.list_jobs():
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.submitted_at))
        print(f"{r.job_id:>12}  {r.state:<11} {r.executor:<8} {when:<19} {r.name}")
    return 0


def _status(args: argparse.Namespace, rest: list[str]) -> int:
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


def _logs(args: argparse.Namespace, rest: list[str]) -> int:
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


def _cancel(args: argparse.Namespace, rest: list[str]) -> int:
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
