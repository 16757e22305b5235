"""``nanotron-recover chaos``: the command line of a fault campaign, from arguments to exit status.

::

    nanotron-recover chaos --config C.yaml --run-dir D --seed S --faults N --kinds k1,k2,...
        [--set a.b=v ...] [--replay chaos_schedule.json] [--out DIR]

It loads the config once (a bad one stops here, before anything runs), draws the schedule
(:mod:`.schedule`) or reads the one to replay, refuses kinds the config or the target cannot serve
(:func:`.runner.needs_of`), writes ``<out>/chaos_schedule.json``, runs (or reuses) the plain
reference (:mod:`.reference`), runs the campaign (:mod:`.runner`) and writes ``chaos.json`` and
``chaos.md`` (:mod:`.report`). Its exit status is the report's verdict: 0 only when the job
exited 0, trained the plain run's steps and never hung, and every fault was sent.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from ..config import add_config_arguments, load_config
from ..errors import InputError
from .kinds import LOCAL_KINDS
from .reference import ensure_reference
from .report import judge, write_report
from .runner import Campaign, CampaignOptions, needs_of
from .schedule import draw_schedule, load_schedule

DEFAULT_KINDS = "kill,freeze,kill_during_rejoin"


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--run-dir", required=True, type=Path, help="the job's run directory (new or empty)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the schedule (0)")
    parser.add_argument("--faults", type=int, default=3, help="faults to send (3)")
    parser.add_argument(
        "--kinds",
        default=DEFAULT_KINDS,
        help=f"comma-separated fault kinds ({DEFAULT_KINDS}); one host: {', '.join(LOCAL_KINDS)}",
    )
    parser.add_argument("--replay", type=Path, metavar="chaos_schedule.json", help="send this schedule again")
    parser.add_argument(
        "--out", type=Path, help="where chaos.json, chaos.md and the schedule go (the run dir)"
    )
    parser.add_argument("--first-step", type=int, default=3, help="no fault before this step (3)")
    parser.add_argument(
        "--last-step", type=int, help="no fault scheduled after this step (default: 80%% of train_steps)"
    )
    parser.add_argument(
        "--min-gap",
        type=int,
        help="steps between faults (default: recover.rejoin.after_steps + 2, at least 3)",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        help="folder of plain reference runs, reused by key (default: <run dir's parent>/chaos_reference)",
    )
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="the whole campaign's limit (1800)")
    parser.add_argument("--hang-floor-s", type=float, default=30.0, help="smallest no-commit bound (30)")
    parser.add_argument(
        "--hang-factor", type=float, default=50.0, help="no-commit bound in median step times (50)"
    )


def _replay_command(args: argparse.Namespace, schedule_path: Path) -> str:
    parts = ["nanotron-recover", "chaos", "--config", str(args.config), "--run-dir", "NEW_RUN_DIR"]
    for s in args.overrides:
        parts += ["--set", s]
    parts += ["--replay", str(schedule_path)]
    return shlex.join(parts)


def run_chaos(args: argparse.Namespace) -> int:
    """The command: the verdict's exit status (2 for bad input, raised as InputError)."""
    config = Path(args.config).resolve()
    run_dir: Path = args.run_dir.resolve()
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "outcome.json").exists():
        raise InputError(f"run dir {run_dir} holds a run already: give chaos a new --run-dir")
    sets = list(args.overrides)
    added = []
    if not any(s.startswith("checkpoints.checkpoints_path=") for s in sets):
        added.append(f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}")  # never another run's
    sets += added
    cfg = load_config(config, sets)
    dp, size = cfg.parallelism.dp, cfg.parallelism.replica_size
    steps = cfg.tokens.train_steps
    if args.replay is not None:
        schedule = load_schedule(args.replay)
        if (schedule.dp, schedule.replica_size) != (dp, size):
            raise InputError(
                f"{args.replay} was drawn for {schedule.dp} replicas of {schedule.replica_size} ranks; "
                f"this config has {dp} of {size}"
            )
        if schedule.faults and schedule.faults[-1].step >= steps:
            raise InputError(
                f"{args.replay} sends a fault in step {schedule.faults[-1].step} of a {steps}-step run"
            )
    else:
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        min_gap = args.min_gap or max(3, cfg.recover.rejoin.after_steps + 2)
        last = args.last_step or max(args.first_step, int(steps * 0.8))
        if last >= steps:
            raise InputError(f"--last-step {last} must be below tokens.train_steps={steps}")
        schedule = draw_schedule(
            args.seed,
            args.faults,
            kinds,
            dp=dp,
            replica_size=size,
            first_step=args.first_step,
            last_step=last,
            min_gap=min_gap,
        )
    problems = needs_of(schedule.kinds, cfg)
    if problems:
        raise InputError("; ".join(problems))
    out: Path = (args.out or run_dir).resolve()
    schedule_path = schedule.write(out / "chaos_schedule.json")
    log = _logger()
    log(f"schedule ({schedule_path}): " + ", ".join(f"{f.kind}@{f.step}" for f in schedule.faults))
    ref_root = (args.reference or run_dir.parent / "chaos_reference").resolve()
    ref_dir, reused = ensure_reference(config, cfg, args.overrides, ref_root, timeout_s=args.timeout_s)
    log(f"plain reference {'reused' if reused else 'run'}: {ref_dir}")
    opts = CampaignOptions(
        config=config,
        run_dir=run_dir,
        sets=sets,
        schedule=schedule,
        cfg=cfg,
        timeout_s=args.timeout_s,
        hang_floor_s=args.hang_floor_s,
        hang_factor=args.hang_factor,
        log=log,
    )
    run = Campaign(opts).run()
    record = judge(
        run=run,
        schedule=schedule,
        run_dir=run_dir,
        ref_dir=ref_dir,
        dp=dp,
        replica_size=size,
        steps=steps,
        exact=cfg.recover.exact,
        replay_cmd=_replay_command(args, schedule_path),
        extra={"config": str(config), "sets": sets, "added_sets": added, "reference_reused": reused},
    )
    js, md = write_report(record, out)
    print(md.read_text(), flush=True)
    log(f"wrote {js} and {md}; exit {record['exit_status']}: {record['verdict']}")
    return int(record["exit_status"])


def _logger() -> Callable[[str], None]:
    def log(line: str) -> None:
        print(f"nanotron-recover chaos: {line}", file=sys.stderr, flush=True)

    return log
