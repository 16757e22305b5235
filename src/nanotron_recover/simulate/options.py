"""The options of ``nanotron-recover simulate``, importable without torch (the CLI builds every
subcommand's parser before running one, and ``train`` must start MPI before torch is imported)."""

from __future__ import annotations

import argparse

from ..failures import Kind
from .constants import PROFILES


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``nanotron-recover simulate`` (``--config`` and ``--set`` come from the CLI)."""
    parser.add_argument("--profile", default="a100-512", choices=sorted(PROFILES), help="hardware constants")
    parser.add_argument(
        "--set-constant", action="append", default=[], metavar="NAME=VALUE", help="override a constant"
    )
    parser.add_argument("--constants", action="store_true", help="print the profile's constants and sources")
    parser.add_argument("--every", type=int, default=5, help="a replica fails every K steps (default 5)")
    parser.add_argument("--until", type=int, help="... until N replicas are lost (default: half of them)")
    parser.add_argument("--mtbf-hours", type=float, help="random faults instead: MTBF per device, hours")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random faults")
    parser.add_argument("--fault-kind", choices=[Kind.CRASH.value, Kind.HANG.value], default=Kind.CRASH.value)
    parser.add_argument(
        "--fault-at", type=float, default=0.0, help="where in the phase a fault strikes, 0..1 of it"
    )
    parser.add_argument(
        "--fault-phase",
        choices=["compute", "reduce"],
        default="compute",
        help="the phase a fault strikes in: the step's compute, or its cross-replica reduction",
    )
    parser.add_argument("--intervals", default="2,16,64", help="checkpoint intervals to compare")
    parser.add_argument(
        "--steps", type=int, help="steps of the reference forward run (default: the schedule's)"
    )
    parser.add_argument("--budget-s", type=float, help="compare at this wall time (default: forward's)")
    parser.add_argument(
        "--budget-gpu-hours", type=float, help="... or at this many GPU-hours (234 in the paper)"
    )
    parser.add_argument("--rejoin", action="store_true", help="also forward recovery with re-join")
    parser.add_argument("--plot", metavar="PATH", help="write the plot (PNG)")
    parser.add_argument("--json", metavar="PATH", help="write the report's data as JSON")
