"""Equivalence check for a machine with one GPU: several replicas (tp=pp=1, each its own torch world
on the same GPU; NCCL refuses two ranks of one world on one GPU) lose replicas mid-step, and every
run must match the plain run of the same global batch step by step.

Cases (each compared with a plain, fault-free run: same micro-batch ids per step, loss within 1e-5
relative, the surviving replicas' parameters bitwise identical, the expected incidents):

- ``lost_in_backward``: 3 replicas, G=2; replica 1 dies in the backward of step 3; blocking restore.
- ``promoted_spare_async``: 8 replicas, G=1 (B=8); replicas 5-7 die at step 2, which leaves W=5 and
  G=2: 4 Majors and a Spare shadowing Major 0. Replica 0 dies at step 4 and the Spare is promoted:
  its shadow gradients are added to the buffer while the asynchronous restore may still be copying
  snapshots into it on the side stream.
- ``torn_bookkeeping_async``: 3 replicas, G=2; replica 1 dies just before the last bucket of the
  reduction (see :func:`last_bucket` for why that is the one-GPU stand-in for a failure found at the
  step agree): the survivors restore every CUDA gradient bucket on the side stream and the CPU
  bookkeeping bucket by a plain copy.

The DP reduction goes over MPI from the CUDA gradient buffers (staged through pinned host memory,
``staging.py``); on a GPU the script then runs ``reduction.py --device cuda`` (the staged pipeline
against the pageable path it replaced, and the achieved copy bandwidths). On a GPU the table is written to ``<out>/gpu_recovery_check.json`` and ``.md``; ``--cpu`` runs the same
cases on CPU (asynchronous restores then fall back to blocking copies) and only prints the table,
which is how the script itself is checked on machines without a GPU. ``--quick`` uses the tiny model
and fewer steps, for a CPU check on a few cores.

    python benchmarks/gpu_recovery_check.py [--cpu] [--quick] [--steps 12] [--case NAME ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import markdown_table, write_report

from nanotron_recover.config import load_config
from nanotron_recover.data import ensure_local_dataset
from nanotron_recover.demo import tiny_config_path
from nanotron_recover.launcher import train_command
from nanotron_recover.logging import read_incidents, read_metrics
from nanotron_recover.models.llama import count_parameters
from nanotron_recover.session_dirs import fresh_session

REL_TOL = 1e-5
# The GPU model: big enough for several gradient buckets and real kernels, small enough for 8
# replicas on one GPU. --quick keeps the tiny config's own model.
GPU_MODEL = [
    "model.model_config.hidden_size=256",
    "model.model_config.intermediate_size=688",
    "model.model_config.num_hidden_layers=4",
    "tokens.sequence_length=128",
    "tokens.micro_batch_size=4",
]
GRAD_BUCKETS = 4  # gradient buffer cut into this many buckets in the bucketed cases


@dataclass
class Case:
    name: str
    replicas: int
    g: int  # micro-batches per replica; the global batch is B = replicas * g
    faults: list[dict]
    restore: str
    check_incidents: Callable[[list[dict]], str | None]  # None if the incidents are as expected
    what: str
    sets: list[str] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return self.replicas * self.g


def bucket_numel_setting(model: list[str]) -> tuple[str, int, int]:
    """``recover.bucket_size_mb`` that cuts the gradient buffer of a tp=pp=1 replica into
    :data:`GRAD_BUCKETS` buckets, with the bucket size in elements and the gradient count."""
    cfg = load_config(tiny_config_path(), model, check_paths=False)
    params = count_parameters(cfg.model.model_config)
    numel = math.ceil(params / GRAD_BUCKETS)
    # ForwardRecovery.attach uses int(bucket_size_mb * 2**20) // 4 elements per bucket; numel / 2**18
    # is exact in binary floating point, so that gives back exactly ``numel``.
    return f"recover.bucket_size_mb={numel / 2**18!r}", numel, params


def last_bucket(params: int, numel: int, batch: int) -> int:
    """Index of the last bucket of the reduction: the CPU bookkeeping vector (2B float64 values, one
    bucket), reduced after the gradient buckets.

    Why a kill there stands in for a failure found at the agree: with tp=pp=1 every rank's DP
    communicator holds every alive replica, so a victim that dies before the agree dies before one of
    its allreduces and every survivor learns it in that allreduce; a victim killed after it (phase
    ``optimizer``) has already passed the agree, and the survivors learn it in the next step's first
    bucket. Learning it at the agree needs a survivor whose DP communicator lacks the dead rank
    (tp*pp > 1 and a rank fault), i.e. two ranks of one replica's NCCL world, which one GPU cannot
    host. Killing the victim before the last bucket gives the survivors the state the agree case
    leaves: every gradient bucket reduced in the old epoch, and the CPU bookkeeping bucket
    snapshotted and stale, so the restore covers CUDA and CPU buckets together.
    """
    return math.ceil(params / numel) + math.ceil(2 * batch / numel) - 1


def expect(steps: dict[int, int], promoted_at: int | None = None, phase: str | None = None):
    """Incident check: at least ``n`` incidents at each step of ``steps`` (exactly when a single
    replica dies), none elsewhere; a spare promoted at ``promoted_at`` with nothing recomputed."""

    def check(incidents: list[dict]) -> str | None:
        by_step: dict[int, list[dict]] = {}
        for inc in incidents:
            by_step.setdefault(inc["step"], []).append(inc)
        if set(by_step) != set(steps):
            return f"incidents at steps {sorted(by_step)}, expected {sorted(steps)}"
        for step, n in steps.items():
            # Replicas killed together may be recovered from in one round or several.
            if not 1 <= len(by_step[step]) <= n:
                return f"step {step}: {len(by_step[step])} incidents, expected 1..{n}"
        if phase is not None and any(inc["phase"] != phase for inc in incidents):
            return f"phases {[inc['phase'] for inc in incidents]}, expected {phase}"
        if promoted_at is not None:
            inc = by_step[promoted_at]
            if [(i["action"], i["extra_microbatches"]) for i in inc] != [("promote_spare", 0)]:
                return f"step {promoted_at}: {[(i['action'], i['extra_microbatches']) for i in inc]}"
        return None

    return check


def cases(model: list[str]) -> list[Case]:
    bucket_set, numel, params = bucket_numel_setting(model)
    torn = last_bucket(params, numel, 3 * 2)
    return [
        Case(
            "lost_in_backward",
            3,
            2,
            [{"step": 3, "replica": 1, "phase": "backward", "microbatch": 1}],
            "blocking",
            expect({3: 1}, phase="backward"),
            "3 replicas, replica 1 killed at step 3 (backward)",
        ),
        Case(
            "promoted_spare_async",
            8,
            1,
            [
                {"step": 2, "replica": 5, "phase": "forward"},
                {"step": 2, "replica": 6, "phase": "forward"},
                {"step": 2, "replica": 7, "phase": "forward"},
                {"step": 4, "replica": 0, "phase": "backward"},
            ],
            "async",
            expect({2: 3, 4: 1}, promoted_at=4),
            "8 replicas G=1; 5-7 killed at step 2, Major 0 at step 4: its Spare is promoted",
            [bucket_set],
        ),
        Case(
            "torn_bookkeeping_async",
            3,
            2,
            [{"step": 3, "replica": 1, "phase": "reduce", "microbatch": torn}],
            "async",
            expect({3: 1}, phase="reduce"),
            f"3 replicas, replica 1 killed at step 3 before bucket {torn} of {torn + 1} (CPU bookkeeping)",
            [bucket_set],
        ),
    ]


def train(run_dir: Path, sets: list[str], nproc: int, env: dict[str, str], timeout_s: float) -> str | None:
    """Run a training job; None on success, else the tail of its output."""
    cmd = train_command(tiny_config_path(), run_dir, sets, nproc)
    try:
        done = subprocess.run(fresh_session(cmd), env=env, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return f"timed out after {timeout_s:.0f}s\n{out[-3000:]}"
    if done.returncode != 0:
        return f"exit status {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}"
    return None


def compare(plain: list[dict], rec: list[dict]) -> tuple[bool, float, bool]:
    """(same steps, worst relative loss difference, every step consumed the same ids)."""
    if [p["step"] for p in plain] != [r["step"] for r in rec]:
        return False, math.inf, False
    rel = max(
        (abs(p["loss"] - r["loss"]) / abs(p["loss"]) for p, r in zip(plain, rec, strict=True)), default=0.0
    )
    ids = all(p["ids_digest"] == r["ids_digest"] for p, r in zip(plain, rec, strict=True))
    return True, rel, ids


def run_case(case: Case, tmp: Path, common: list[str], env: dict, timeout_s: float, plains: dict) -> dict:
    row: dict = {"case": case.name, "what": case.what, "restore": case.restore, "replicas": case.replicas}
    if case.batch not in plains:
        plain_dir = tmp / f"plain_b{case.batch}"
        sets = common + ["parallelism.dp=1", f"tokens.batch_accumulation_per_replica={case.batch}"]
        error = train(plain_dir, sets, 1, env, timeout_s)
        plains[case.batch] = (read_metrics(plain_dir), None) if error is None else ([], error)
    plain, plain_error = plains[case.batch]
    if plain_error is not None:
        return row | {"ok": False, "error": f"plain run: {plain_error}"}
    run_dir = tmp / case.name
    sets = common + case.sets
    sets += [
        f"parallelism.dp={case.replicas}",
        f"tokens.batch_accumulation_per_replica={case.g}",
        "recover.enabled=true",
        f"recover.restore={case.restore}",
        f"recover.faults={json.dumps(case.faults)}",
    ]
    error = train(run_dir, sets, case.replicas, env, timeout_s)
    if error is not None:
        return row | {"ok": False, "error": f"recover run: {error}"}
    rec, incidents = read_metrics(run_dir), read_incidents(run_dir)
    digests = {p.read_text().strip() for p in (run_dir / "parameters").glob("*.sha256")}
    same_steps, rel, ids = compare(plain, rec)
    incident_error = case.check_incidents(incidents)
    problems = [
        *([] if same_steps else ["steps differ"]),
        *([] if ids else ["ids differ"]),
        *([] if rel <= REL_TOL else [f"loss rel diff {rel:.1e}"]),
        *([] if len(digests) == 1 else [f"{len(digests)} different parameter digests"]),
        *([] if incident_error is None else [incident_error]),
    ]
    return row | {
        "ok": not problems,
        "error": "; ".join(problems) or None,
        "steps": len(rec),
        "max_rel_diff": rel,
        "ids_equal": ids,
        "replica_digests": len(digests),
        "final_replicas": rec[-1]["replicas"] if rec else None,
        "incidents": [
            {k: i[k] for k in ("step", "phase", "failed_replicas", "action", "extra_microbatches")}
            for i in incidents
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU (checks the script itself)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 steps (for a CPU check)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 12, 6 with --quick)")
    parser.add_argument("--case", action="append", default=None, help="run only these cases (repeatable)")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds per training run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.cpu:
        env["NANOTRON_RECOVER_DEVICE"] = "cpu"
    on_gpu = not args.cpu and torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    steps = args.steps if args.steps is not None else (6 if args.quick else 12)
    model = [] if args.quick else GPU_MODEL
    selected = [c for c in cases(model) if args.case is None or c.name in args.case]
    if not selected:
        parser.error(f"no case among {[c.name for c in cases(model)]} matches {args.case}")
    if steps < 5:
        parser.error("--steps must be at least 5 (the last fault is at step 4)")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = ensure_local_dataset(tmp / "data")
        common = [
            f"data_stages.0.data.dataset={{dataset_folder: {data.corpus_dir}}}",
            f"tokens.train_steps={steps}",
            "checkpoints.save_final_state=false",
            "model.dtype=float32",
            *model,
        ]
        plains: dict[int, tuple[list[dict], str | None]] = {}
        for case in selected:
            print(f"[gpu_recovery_check] {case.name}: {case.what} ...", flush=True)
            rows.append(run_case(case, tmp, common, env, args.run_timeout, plains))
            if rows[-1]["error"]:
                print(f"[gpu_recovery_check] {case.name} FAILED: {rows[-1]['error']}", flush=True)
    ok = all(r["ok"] for r in rows)
    restore_note = "" if on_gpu else " (async falls back to blocking on CPU)"
    table = markdown_table(
        ["case", "replicas", "restore", "incidents", "max rel diff", "ids equal", "digests", "result"],
        [
            [
                r["case"],
                r["replicas"],
                r["restore"],
                ", ".join(f"s{i['step']} {i['action']}" for i in r.get("incidents", [])) or "-",
                f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else "-",
                r.get("ids_equal", "-"),
                r.get("replica_digests", "-"),
                "PASS" if r["ok"] else "FAIL",
            ]
            for r in rows
        ],
    )
    header = [
        f"Device: {device}. {steps} steps, tp=pp=1, every replica on the same device{restore_note}.",
        f"Each case vs the plain run: same ids per step, loss rel diff <= {REL_TOL:g}, one parameter digest.",
        "",
    ]
    details = [f"- {r['case']}: {r['what']}" + (f" -- {r['error']}" if r["error"] else "") for r in rows]
    lines = [*header, *table, "", *details, "", f"ok={ok}"]
    if on_gpu:
        write_report(
            Path(args.out),
            "gpu_recovery_check",
            {"device": device, "steps": steps, "ok": ok, "cases": rows},
            lines,
        )
        ok = reduction_on_gpu(Path(args.out), env) and ok
    else:
        print("\n".join(lines))
    return 0 if ok else 1


def reduction_on_gpu(out: Path, env: dict[str, str]) -> bool:
    """The reduction benchmark with gradients in GPU memory (``reduction.py --device cuda``): the
    staged pipeline against the pageable path it replaced and a bare host ``Allreduce``."""
    cmd = [sys.executable, str(Path(__file__).parent / "reduction.py"), "--device", "cuda"]
    cmd += ["--dp", "2", "--params", "50M", "200M", "--reps", "10", "--out", str(out)]
    print("[gpu_recovery_check] reduction with CUDA gradients ...", flush=True)
    try:
        done = subprocess.run(cmd, env=env, timeout=900)
    except subprocess.TimeoutExpired:
        print("[gpu_recovery_check] reduction benchmark timed out", flush=True)
        return False
    return done.returncode == 0


if __name__ == "__main__":
    sys.exit(main())
