"""Errors that end a run on purpose, and the exit status each one gives.

Two families:

- :class:`InputError`: bad user input (config, files, command line), found before or after start-up.
  Reported as one line, exit status 2.
- :class:`StopRun`: the job must stop as a whole, once, because going on cannot help: a full disk,
  an unreadable file, the same exception again on the same micro-batch ids, too few replicas left,
  no replica left at all. Such a fault is not a replica failure, so it is never "repaired" by
  killing replicas one by one.

The exit status tells the truth (see :class:`ExitCode`): 0 only when every requested step was
committed; 3 only when the last committed step was checkpointed by the stop (a too-few-replicas stop
whose save failed exits 1, like a job that lost every replica: nothing newer than the earlier
checkpoints is left).
"""

from __future__ import annotations

from enum import IntEnum

from .failures import STOP_ORDER, Kind


class ExitCode(IntEnum):
    """Exit statuses of ``train`` and ``launch`` (also recorded in ``<run_dir>/outcome.json``)."""

    OK = 0  # every requested step committed
    # The job was lost, with no checkpoint of its last committed step: every replica lost (the record's
    # kind all_replicas_lost), a too-few-replicas stop whose save failed, or interrupted from outside.
    FAILED = 1
    INPUT = 2  # bad input: config, corpus, checkpoint, tokenizer
    # recover.min_replicas reached, and the last committed step was checkpointed (only then).
    TOO_FEW_REPLICAS = 3
    DETERMINISTIC = 4  # the same exception again on the same micro-batch ids on another replica
    IO = 5  # a full disk or an unwritable/unreadable path during the run


class InputError(ValueError):
    """Bad user input; the message says what is wrong and what to change."""


# The exit status of each kind a StopRun can have (``failures.STOP_ORDER``).
STOP_EXIT_CODES: dict[Kind, ExitCode] = {
    Kind.INPUT: ExitCode.INPUT,
    Kind.TOO_FEW_REPLICAS: ExitCode.TOO_FEW_REPLICAS,
    Kind.DETERMINISTIC: ExitCode.DETERMINISTIC,
    Kind.IO: ExitCode.IO,
    Kind.ALL_REPLICAS_LOST: ExitCode.FAILED,
    Kind.REGROW: ExitCode.FAILED,  # not every step committed: the supervisor relaunches it
}
assert set(STOP_EXIT_CODES) == set(STOP_ORDER)


class StopRun(RuntimeError):
    """Stop the whole job once, with one line naming the cause and a non-zero status.

    ``unsaved``: a too-few-replicas stop whose checkpoint of the last committed step could not be
    written; it exits 1, not 3 (3 promises that checkpoint)."""

    def __init__(self, kind: Kind | str, message: str, unsaved: bool = False):
        if kind not in STOP_EXIT_CODES:
            raise ValueError(f"unknown stop kind {kind!r}")
        super().__init__(message)
        self.kind = Kind(kind)
        self.message = message
        self.unsaved = unsaved

    @property
    def exit_code(self) -> ExitCode:
        if self.unsaved and self.kind == Kind.TOO_FEW_REPLICAS:
            return ExitCode.FAILED
        return STOP_EXIT_CODES[self.kind]
