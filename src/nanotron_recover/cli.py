"""``nanotron-recover``: train, launch, watch, convert, eval, preprocess, snapshots.

``train`` is the per-rank entry point (mpirun starts one per rank); ``launch`` (see
:mod:`.launcher`) starts ``mpirun`` with the flags the engine needs, runs ``train`` on every rank and
exits with the status the run records in ``<run_dir>/outcome.json``.
Errors in user input (config, paths, checkpoints) print one line and exit with status 2; a run that
must stop (:class:`~.errors.StopRun`) exits with its kind's status. Under mpirun every rank prints its own
line (rank 0 alone would be killed by mpirun when another rank exits first).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# A process spawned by a re-join beats before the imports below (seconds on a busy node): the
# members give a join up when a spawned process has not started beating in time (ft/spawn_start.py).
from .ft.spawn_start import beat_if_spawned

beat_if_spawned()

from .config import HFDatasetArgs, NanosetDatasetsArgs, add_config_arguments, load_config  # noqa: E402
from .errors import ExitCode, InputError, StopRun  # noqa: E402
from .outcome import SUPERVISED_ENV, read_outcome, write_outcome  # noqa: E402
from .supervisor import last_committed_step  # noqa: E402


# -- train ------------------------------------------------------------------------------------
def cmd_train(args: argparse.Namespace) -> int:
    # A dry run plans a job before its data exists (e.g. before preprocessing C4): it notes it instead.
    from .launcher import target_step_of

    cfg = load_config(args.config, args.overrides, check_paths=not args.dry_run)
    args.target_step = target_step_of(cfg, args.stop_after_step)  # for an outcome record on error
    if args.dry_run:
        missing: list[str] = []
        for i, stage in enumerate(cfg.data_stages):
            ds = stage.data.dataset
            if isinstance(ds, HFDatasetArgs):
                print(
                    f"note: data_stages[{i}] names a Hugging Face dataset, which Nanotron tokenizes on the fly: "
                    "tokenize it once with `nanotron-recover preprocess` and set dataset_folder before training"
                )
            elif isinstance(ds, NanosetDatasetsArgs):
                missing += [f for f in ds.read_paths() if not Path(f).is_dir() and f not in missing]
        for folder in missing:
            print(f"note: dataset folder {folder!r} does not exist yet (preprocess before training)")
        from .estimate import format_plan, plan_summary

        print(format_plan(plan_summary(cfg)))
        return 0
    if cfg.recover.forward:
        from .ft.heartbeat import start_mpi

        start_mpi(cfg.recover.heartbeat_period_s, cfg.recover.heartbeat_timeout_s)
    from .data_parallel import build_data_parallel
    from .launcher import default_run_dir
    from .trainer import DistributedTrainer

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config)
    run_dir.mkdir(parents=True, exist_ok=True)
    from . import fencing

    try:
        fencing.adopt(run_dir)  # before anything shared is written
    except (fencing.TokenError, ValueError) as e:
        raise InputError(str(e)) from e
    trainer = DistributedTrainer(cfg, run_dir, build_data_parallel(cfg, run_dir))
    try:
        trainer.train(stop_after_step=args.stop_after_step)
    finally:
        trainer.close()
    return 0


# -- launch -----------------------------------------------------------------------------------
def cmd_launch(args: argparse.Namespace) -> int:
    from .launcher import launch

    return launch(
        args.config,
        args.overrides,
        nproc=args.nproc,
        run_dir=args.run_dir,
        stop_after_step=args.stop_after_step,
    )


# -- watch ------------------------------------------------------------------------------------
def cmd_watch(args: argparse.Namespace) -> int:
    from .logging.watch import watch

    return watch(args.run_dir, once=args.once, interval_s=args.interval, width=args.width)


# -- convert / eval / preprocess -----------------------------------------------------------------
def cmd_convert(args: argparse.Namespace) -> int:
    from .models.hf_conversion import from_hf, to_hf

    cfg = load_config(args.config, args.overrides, check_paths=False)
    if bool(args.from_hf) == bool(args.to_hf):
        raise InputError("convert needs exactly one of --from-hf DIR or --to-hf CKPT")
    out = from_hf(args.from_hf, cfg, args.out) if args.from_hf else to_hf(args.to_hf, cfg, args.out)
    print(f"wrote {out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import evaluate

    cfg = load_config(args.config, args.overrides, check_paths=False)
    result = evaluate(cfg, args.checkpoint, args.tokens, args.logits_out)
    if result is not None:
        print(f"loss {result.loss:.6f} perplexity {result.perplexity:.4f} tokens {result.tokens}", flush=True)
    return 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    from .data import run_preprocess

    return run_preprocess(args)


def cmd_convert_corpus(args: argparse.Namespace) -> int:
    from .data.convert import convert_corpus

    s = convert_corpus(args.old, args.new, tokenizer=args.tokenizer)
    print(
        f"wrote {s.folder}: {s.num_tokens:,} tokens in {s.num_documents:,} documents "
        f"({s.dtype}, tokenizer {s.tokenizer})"
    )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from .simulate.report import run_simulate

    return run_simulate(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(Path(args.out), steps=args.steps)


def cmd_chaos(args: argparse.Namespace) -> int:
    from .chaos.command import run_chaos

    return run_chaos(args)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; given the ``command`` being run, the options of ``preprocess``
    are declared only when it is that one: they live in the data package, which imports torch (2 s
    of CPU, paid by every ``snapshots clean`` at every job's end on every node otherwise)."""
    parser = argparse.ArgumentParser(prog="nanotron-recover", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train (one process per rank; start it with mpirun or launch)")
    add_config_arguments(p)
    p.add_argument("--run-dir", help="metrics, checkpoints and logs (default runs/<config name>)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan; needs no MPI")
    p.add_argument("--stop-after-step", type=int, help="checkpoint after this step and exit (pre-emption)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("launch", help="run train under mpirun with the flags the engine needs")
    add_config_arguments(p)
    p.add_argument("--nproc", type=int, help="ranks to start (default tp*pp*dp)")
    p.add_argument("--run-dir")
    p.add_argument("--stop-after-step", type=int)
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser(
        "watch", help="a live view of a run from its run directory (replicas, hosts, progress, incidents)"
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--once", action="store_true", help="print one frame and exit (plain text when not a tty)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (1)")
    p.add_argument("--width", type=int, help="columns to draw in (default: the terminal's)")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("convert", help="convert to or from a Hugging Face LlamaForCausalLM folder")
    add_config_arguments(p)
    p.add_argument("--from-hf", metavar="DIR")
    p.add_argument("--to-hf", metavar="CKPT")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("eval", help="loss and perplexity of a checkpoint on a [batch, seq] token file")
    add_config_arguments(p)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tokens", required=True, metavar="FILE.npy")
    p.add_argument("--logits-out", metavar="FILE.npy")
    p.set_defaults(func=cmd_eval)

    from .compare import add_compare_arguments, run_compare

    p = sub.add_parser(
        "compare", help="compare runs: loss differences, ids digests, incidents; --out plots a PNG"
    )
    add_compare_arguments(p)
    p.set_defaults(func=run_compare)

    from .slurm import add_slurm_arguments, run_slurm

    p = sub.add_parser("slurm", help="render (and --submit) an sbatch script for a config")
    add_slurm_arguments(p)
    p.set_defaults(func=run_slurm)

    p = sub.add_parser("demo", help="the main job on the embedded default: tiny LLaMA, offline corpus, CPU")
    p.add_argument("--out", default="demo_out", help="where the corpus, metrics and plots go")
    p.add_argument("--steps", type=int, help="train this many steps instead of the config's")
    p.set_defaults(func=cmd_demo)

    from .simulate.options import add_simulate_arguments

    p = sub.add_parser(
        "simulate", help="model forward recovery vs checkpoint-restart at scale (no GPU needed)"
    )
    add_config_arguments(p)
    add_simulate_arguments(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser(
        "preprocess", help="tokenize JSON lines or a Hugging Face dataset into a Nanoset folder (datatrove)"
    )
    if command in (None, "preprocess"):
        from .data import add_preprocess_arguments

        add_preprocess_arguments(p)
    p.set_defaults(func=cmd_preprocess)

    p = sub.add_parser(
        "convert-corpus", help="turn an old tokens.bin + index.json corpus into a Nanoset folder"
    )
    p.add_argument("old", metavar="OLD_FOLDER", help="folder with tokens.bin and index.json")
    p.add_argument("new", metavar="NEW_FOLDER", help="Nanoset folder to write (new or without *.ds files)")
    p.add_argument("--tokenizer", help="tokenizer name for the metadata (default: index.json's)")
    p.set_defaults(func=cmd_convert_corpus)

    from .snapshot_cleanup import add_snapshots_arguments, run_snapshots

    p = sub.add_parser(
        "snapshots", help="node-memory snapshots on this host: `snapshots clean` removes one run's"
    )
    add_snapshots_arguments(p)
    p.set_defaults(func=run_snapshots)

    from .chaos.command import add_chaos_arguments

    p = sub.add_parser(
        "chaos",
        help="a fault campaign: a seeded schedule of faults sent to a real job, judged against the plain run",
    )
    add_chaos_arguments(p)
    p.set_defaults(func=cmd_chaos)
    return parser


def _record_stop(args: argparse.Namespace, kind: str, code: int, message: str) -> bool:
    """For ``train``: make sure ``<run_dir>/outcome.json`` says why the run stopped (the trainer
    writes it when it gets that far; an error at start-up, before it, is recorded here). Whether
    the run dir now holds a record."""
    if args.command != "train" or args.dry_run:
        return False
    from .launcher import default_run_dir

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config)
    if not run_dir.is_dir():
        return False
    if read_outcome(run_dir) is not None:
        return True
    return write_outcome(
        run_dir,
        status="stopped",
        last_step=last_committed_step(run_dir),
        target_step=getattr(args, "target_step", None) or 0,
        exit_code=code,
        kind=kind,
        message=message,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and not argv[0].startswith("-") else None).parse_args(argv)
    from .checkpoint import CheckpointError

    try:
        return args.func(args)
    except StopRun as e:
        code, kind, message = int(e.exit_code), e.kind, e.message
    except (InputError, CheckpointError, FileNotFoundError) as e:
        code, kind, message = int(ExitCode.INPUT), "input", str(e)
    message = " ".join(message.splitlines())  # one line, whatever the exception held
    recorded = _record_stop(args, kind, code, message)
    # Under mpirun every rank says it: the first rank to exit non-zero makes mpirun kill the others,
    # so a line left to rank 0 alone was lost whenever another rank got there first (and an error
    # met by one rank only was never said). Under the launcher's supervisor the launcher prints the
    # recorded message itself, so the ranks stay quiet.
    quiet = bool(recorded and os.environ.get(SUPERVISED_ENV) == "1")
    if not quiet:
        print(f"nanotron-recover {args.command}: error: {message}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
