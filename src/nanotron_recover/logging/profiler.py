"""Nanotron's ``profiler:`` section: torch.profiler traces of a window of training steps."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from ..config.schema import ProfilerArgs


class StepProfiler:
    """torch.profiler driven by the training loop, with Nanotron's schedule and fields.

    The trainer starts it before its step loop, calls :meth:`step` at the start of every training
    step (as Nanotron calls ``prof.step()``) and stops it after the loop; it is a context manager
    too. The n-th step this process trains (a resumed run counts from its restart) runs under step
    n of ``torch.profiler.schedule(skip_first, wait, warmup, active, repeat)`` (``repeat: 0`` cycles
    until training ends), exactly as in Nanotron: with its defaults (skip_first 3, wait 1, warmup 1,
    active 1, repeat 1) step 5 is recorded. :meth:`recorded_steps` lists the recorded steps.

    Unlike Nanotron, which profiles rank 0 only, every rank profiles (a straggler or a slow
    collective shows on the rank it happens on). At the end of each cycle a rank writes one
    Chrome-trace JSON, readable by chrome://tracing, Perfetto and TensorBoard's profiler plugin:
    ``<profiler_export_path>/<run>/<worker>.step<last recorded step>.pt.trace.json``, where
    ``<run>`` names the run (its run folder) and ``<worker>`` the rank (e.g. ``replica0_pp1_tp0``).
    CPU activity is always recorded, CUDA activity when a GPU is present; ``record_shapes``,
    ``profile_memory`` and ``with_stack`` are passed on as they are.
    """

    def __init__(self, args: ProfilerArgs, folder: Path, worker: str):
        if args.profiler_export_path is None:
            raise ValueError("profiler.profiler_export_path is null: there is nothing to write")
        self.args, self.folder, self.worker = args, Path(folder), worker
        self.written: list[Path] = []
        self._last_step = 0  # the last training step begun, so a cycle's trace names its last step
        self._prof: profile | None = None

    @classmethod
    def for_run(cls, args: ProfilerArgs | None, run: str, worker: str) -> StepProfiler | None:
        """The profiler a config asks for (None: no ``profiler:`` or no export path, as in Nanotron,
        where a null path writes nothing)."""
        if args is None or args.profiler_export_path is None:
            return None
        return cls(args, Path(args.profiler_export_path) / run, worker)

    @staticmethod
    def recorded_steps(args: ProfilerArgs, steps: int) -> list[int]:
        """Which of the first ``steps`` steps of a process are recorded (1-based, in order)."""
        cycle = args.wait + args.warmup + args.active
        out = []
        for n in range(1, steps + 1):
            k = n - args.skip_first  # step n runs under schedule step n (see the class docstring)
            if k < 0 or (args.repeat and k >= args.repeat * cycle):
                continue
            if k % cycle >= args.wait + args.warmup:
                out.append(n)
        return out

    def start(self) -> None:
        """Start profiling (before the first :meth:`step`)."""
        if self._prof is not None:
            return
        a = self.args
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(
                skip_first=a.skip_first, wait=a.wait, warmup=a.warmup, active=a.active, repeat=a.repeat
            ),
            on_trace_ready=self._save,
            record_shapes=a.record_shapes,
            profile_memory=a.profile_memory,
            with_stack=a.with_stack,
        )
        self._prof.start()

    def step(self, step: int) -> None:
        """Training step ``step`` (the global step number, used in file names) begins."""
        if self._prof is None:
            raise RuntimeError("StepProfiler.step before start()")
        with warnings.catch_warnings():
            # torch says, at each new cycle, that a cycle's events are not kept for the next one:
            # that is the intent, each cycle has its own trace file.
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
            self._prof.step()  # a cycle that ended with the previous step is saved now, under its number
        self._last_step = step

    def stop(self) -> None:
        """Stop profiling; a cycle still recording is saved. Safe to call twice."""
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()

    def __enter__(self) -> StepProfiler:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _save(self, prof: profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self.worker}.step{self._last_step}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.written.append(path)
