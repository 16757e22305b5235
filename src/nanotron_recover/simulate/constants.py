"""Every constant of the fault simulator, in one table per hardware profile, each with its source.

A profile is a table of :class:`Constant` (name, value, unit, source, meaning). Both profiles
define the same names, so the event model never asks where a number came from; ``simulate
--constants`` prints the table, and ``--set-constant NAME=VALUE`` replaces a value (its source then
reads "set on the command line").

Sources are one of:

- **measured here**, with the command that measured it (this project's benchmarks on the 2-core
  development machine: ``benchmarks/simulate_validation.py --calibrate``, ``recovery.py``,
  ``rejoin.py``);
- **datasheet**: a vendor's published figure (NVIDIA A100, PCIe);
- **paper**: the forward-recovery paper whose 512-GPU run the ``a100-512`` profile models;
- **FlashRecovery** (arXiv 2509.03047): restart costs at scale;
- **extrapolated**: a fit measured here, applied at a scale it was not measured at (said so);
- **assumed**: no measurement available; the order of magnitude and why are given.

What comes from the config (parameters, layout, ``B``, heartbeat timeout, ``min_replicas``,
re-join settings) is not a constant: :mod:`.workload` reads it from the config.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

MEASURED_CALIBRATE = "measured here: python benchmarks/simulate_validation.py --calibrate"
MEASURED_RECOVERY = "measured here: python benchmarks/recovery.py (results/recovery.json)"
MEASURED_REJOIN = "measured here: python benchmarks/rejoin.py (results/rejoin.json)"
MEASURED_SNAPSHOT = "measured here: python benchmarks/snapshot_cost.py (results/snapshot_cost.json)"
MEASURED_HOST_BW = (
    "measured here: python -m nanotron_recover.simulate.constants --measure-host (one thread, "
    "25 MiB float32 buffers, best of 15)"
)
SET_ON_COMMAND_LINE = "set on the command line (--set-constant)"


@dataclass(frozen=True)
class Constant:
    """One number of the model: its value, unit, where it comes from and what it stands for."""

    name: str
    value: float
    unit: str
    source: str
    meaning: str


class Profile(Mapping[str, Constant]):
    """A named, read-only table of constants; ``profile["x"]`` is the :class:`Constant`,
    ``profile.v("x")`` its value."""

    def __init__(self, name: str, description: str, constants: list[Constant]):
        self.name = name
        self.description = description
        self._table = {c.name: c for c in constants}
        if len(self._table) != len(constants):
            raise ValueError(f"profile {name}: a constant is defined twice")

    def __getitem__(self, key: str) -> Constant:
        try:
            return self._table[key]
        except KeyError:
            raise KeyError(f"no constant {key!r} (known: {', '.join(sorted(self._table))})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def v(self, key: str) -> float:
        return self[key].value

    def with_values(self, values: Mapping[str, float]) -> Profile:
        """A copy with some values replaced (``--set-constant``); unknown names raise KeyError."""
        table = dict(self._table)
        for key, value in values.items():
            table[key] = replace(self[key], value=float(value), source=SET_ON_COMMAND_LINE)
        return Profile(self.name, self.description, list(table.values()))


# Meaning and unit of every constant, shared by the profiles (the values and sources differ).
MEANINGS: dict[str, tuple[str, str]] = {
    "peak_flops": ("FLOP/s", "peak rate of one device (GPU, or one CPU core: one rank per core)"),
    "mfu": ("-", "fraction of peak that forward+backward reach (TP/PP/DP traffic modelled apart)"),
    "shared_cores": ("cores", "cores the ranks share; 0 = every rank has a device of its own"),
    "devices_per_node": ("devices", "devices per node (TP/PP inside a node use the intra-node link)"),
    "intra_node_bw": ("B/s", "per-device bandwidth of the intra-node link, one direction"),
    "inter_node_bw": ("B/s", "network bandwidth of one node, one direction"),
    "link_efficiency": ("-", "fraction of link bandwidth a collective or transfer reaches"),
    "hbm_bw": ("B/s", "device memory bandwidth (the optimizer step is memory-bound)"),
    "dp_latency_ft_s": (
        "s",
        "fixed cost per step of the forward-recovery path besides its buckets (gate, agree)",
    ),
    "grad_staging": (
        "0/1",
        "1: gradients live on the device and each bucket is copied to host memory, reduced by MPI "
        "and copied back (the Open MPI wheel has no CUDA support); 0: they are in host memory",
    ),
    "staging_pinned": ("0/1", "1: the host staging buffers are pinned (the code); 0: pageable (.cpu())"),
    "copy_bw_pinned": ("B/s", "device<->host copy of one rank from/to pinned host memory"),
    "copy_bw_pageable": ("B/s", "device<->host copy of one rank from/to pageable host memory"),
    "host_memcpy_bw": ("B/s", "one core copying host memory (a host bucket's snapshot)"),
    "cpu_sum_bw": ("B/s", "one core summing float32 into host memory (MPI_SUM), bytes of the result"),
    "mpi_transport_rdma": ("0/1", "the forward-recovery MPI transport: 1 btl/uct (RDMA), 0 btl/tcp"),
    "mpi_bw_rdma": ("B/s", "one rank's share of the network through btl/uct (efficiency included)"),
    "mpi_bw_tcp": ("B/s", "one rank's share of the network through btl/tcp (efficiency included)"),
    "mpi_latency_rdma_s": ("s", "one MPI message's latency through btl/uct"),
    "mpi_latency_tcp_s": ("s", "one MPI message's latency through btl/tcp"),
    "reduce_pipeline_depth": (
        "stages",
        "stages of the forward-recovery reduction running at once (1: one bucket at a time, its "
        "copies and all-reduce one after the other; 3: copies out, reductions and copies back "
        "overlapped, as staging.py does)",
    ),
    "dp_latency_plain_s": ("s", "fixed cost per step of the plain all-reduce (gloo on CPU, NCCL on GPU)"),
    "snapshot_bw": (
        "B/s",
        "a rank's node-memory snapshot (recover.snapshot): its state's bytes over the time to copy "
        "them into the node's shared memory (on a GPU device to pinned host memory, then into the slot)",
    ),
    "snapshot_overlap": (
        "0/1",
        "1: the snapshot's copy runs beside the next step (a side stream, a thread with a core of its "
        "own) and costs only what outlasts that step's compute and reduction; 0: it takes its whole "
        "time from the step (every core computing)",
    ),
    "detect_crash_s": ("s", "a crashed process to the survivors seeing it in MPI"),
    "repair_base_s": (
        "s",
        "in-step repair without redone work: revoke, agree, shrink, split, restore, commit",
    ),
    "repair_per_log2_rank_s": ("s", "... plus this much per doubling of the ranks in the job"),
    "spawn_s": ("s", "re-join: start of the spawned processes (interpreter, imports, device init)"),
    "rebuild_s": ("s", "re-join: the re-joining replica's torch world and model"),
    "state_transfer_bw": ("B/s", "re-join: state copied to one re-joining rank from its donor"),
    "launcher_s": ("s", "the launch command's own start before mpirun (first launch only)"),
    "start_base_s": ("s", "job start-up: mpirun to the first step (processes, imports, worlds, model)"),
    "start_per_log2_rank_s": ("s", "... plus this much per doubling of the ranks"),
    "start_plain_extra_s": ("s", "extra start-up of the plain (non-ULFM) job over the ULFM one"),
    "relaunch_s": ("s", "checkpoint-restart: the failure to the relaunched job starting (abort, relaunch)"),
    "exit_ft_s": ("s", "last commit to the end of a forward-recovery job (no MPI_Finalize)"),
    "exit_plain_s": ("s", "last commit to the end of a plain job (MPI_Finalize)"),
    "save_fixed_s": ("s", "blocking fixed cost of one asynchronous checkpoint save"),
    "stage_bw": ("B/s", "device-to-host copy that stages a checkpoint in CPU memory"),
    "fs_write_bw": ("B/s", "file-system write bandwidth of one writing rank (background write)"),
    "fs_read_bw_aggregate": ("B/s", "file-system read bandwidth of the whole job (every replica loads)"),
}


def _table(values: dict[str, tuple[float, str]]) -> list[Constant]:
    missing = set(MEANINGS) - set(values)
    extra = set(values) - set(MEANINGS)
    if missing or extra:
        raise ValueError(f"profile constants: missing {sorted(missing)}, unknown {sorted(extra)}")
    return [Constant(k, float(values[k][0]), MEANINGS[k][0], values[k][1], MEANINGS[k][1]) for k in MEANINGS]


# Measured by `python benchmarks/simulate_validation.py --calibrate` on short runs of the tiny LLaMA
# (not the runs it validates); benchmarks/results/simulate_calibration.json holds every run.
CALIBRATION = {
    "peak_flops": 9.48e10,
    "microbatch_s": 0.00477,
    "launcher_s": 1.95,
    "start_base_s": 2.867,
    "start_per_log2_rank_s": 0.483,
    "start_plain_extra_s": 0.328,
    "dp_latency_ft_s": 0.0136,
    "dp_latency_plain_s": 0.0171,
    "detect_crash_s": 0.041,
    "repair_base_s": -0.0021,
    "repair_per_log2_rank_s": 0.0019,
    "exit_ft_s": 0.63,
    "exit_plain_s": 2.72,
    "relaunch_s": -0.23,
    "save_fixed_s": 0.021,
}
# One core of this machine (python -m nanotron_recover.simulate.constants --measure-host), the
# bandwidth of Open MPI's sm transport per rank fitted to the bare per-bucket Allreduce of
# benchmarks/reduction.py (nanotron_recover.simulate.validation.fit_sm_bandwidth), and a node-memory
# snapshot's own bandwidth (benchmarks/snapshot_cost.py).
HOST = {
    "host_memcpy_bw": 12.2e9,
    "cpu_sum_bw": 15.2e9,
    "mpi_bw_sm": 4.13e9,
    # benchmarks/snapshot_cost.py: 31.5 MB over the 4.4 ms of one snapshot written alone
    "snapshot_bw": 7.09e9,
}
FITTED_SM = (
    "fitted here: 4 ranks' bare per-bucket MPI Allreduce of 50M parameters in results/reduction.json "
    "(validation.fit_sm_bandwidth; cpu_sum_bw measured apart); the bucket code's own terms are then "
    "checked against the same file"
)
# FLOPs of one tiny-LLaMA micro-batch (configs/tiny_cpu.yaml), to turn the measured micro-batch time
# into an MFU: 6 * 139,584 parameters * 128 tokens + 12 * 2 layers * 64 * 64 * 128 tokens.
TINY_MICROBATCH_FLOPS = 6 * 139_584 * 128 + 12 * 2 * 64 * 64 * 128


# -- a100-512: the paper's run (configs/llama7b_c4.yaml) ------------------------------------------
A100_512 = Profile(
    "a100-512",
    "512 A100 40GB SXM4, 4 per node (128 nodes; configs/llama7b_c4.yaml: tp=4 in a node, pp=2 "
    "across two nodes, dp=64), 2 x 200 Gb/s NICs per node, a Lustre-class parallel file system",
    _table(
        {
            "peak_flops": (312e12, "datasheet: NVIDIA A100, BF16 dense Tensor Core 312 TFLOP/s"),
            "mfu": (
                0.45,
                "assumed: Megatron-LM reached 52% of A100 peak at scale (Narayanan et al., SC'21); "
                "a 7B model at tp=4 with unfused kernels a little less",
            ),
            "shared_cores": (0, "a GPU per rank"),
            "devices_per_node": (4, "assumed node: 4-GPU HGX A100 (the config also allows 64 x 8)"),
            "intra_node_bw": (
                300e9,
                "datasheet: NVIDIA A100 NVLink 600 GB/s bidirectional = 300 GB/s each way",
            ),
            "inter_node_bw": (50e9, "assumed node: 2 NICs x 200 Gb/s (HDR InfiniBand or Slingshot class)"),
            "link_efficiency": (0.7, "assumed: collectives typically reach 70-80% of the link (nccl-tests)"),
            "hbm_bw": (1.555e12, "datasheet: NVIDIA A100 40GB, 1,555 GB/s HBM2"),
            "dp_latency_ft_s": (
                0.01,
                "assumed: the gate (a barrier inside the replica) and the ULFM agree over 512 ranks; "
                "the buckets are modelled apart (the agree took 0.14 ms at 4 ranks here, "
                "results/reduction.json)",
            ),
            "grad_staging": (
                1,
                "the code: buckets.py stages a CUDA bucket through host memory (staging.py) for "
                "comm.allreduce_ and copies the sum back; the Open MPI wheel is built without CUDA",
            ),
            "staging_pinned": (
                1,
                "the code: staging.py allocates pinned staging and result buffers once",
            ),
            "copy_bw_pinned": (
                25e9,
                "datasheet: PCIe Gen4 x16, 32 GB/s per direction; ~25 GB/s reached from pinned memory "
                "(assumed, as stage_bw)",
            ),
            "copy_bw_pageable": (
                6e9,
                "assumed: a pageable copy goes through the driver's pinned bounce buffer plus a CPU copy, "
                "into pages .cpu() has just allocated (NVIDIA, 'How to Optimize Data Transfers in CUDA "
                "C/C++': pageable well below pinned); about a quarter of pinned",
            ),
            "host_memcpy_bw": (
                10e9,
                "assumed: one core of an A100 host streaming a copy (12 GB/s measured here)",
            ),
            "cpu_sum_bw": (10e9, "assumed: one core's streaming float32 add (15 GB/s measured here)"),
            "mpi_transport_rdma": (
                1,
                "assumed: Open MPI picks btl/uct on InfiniBand (the wheel ships it; under ULFM only the "
                "ob1 PML with btl tcp/uct/sm is supported, Open MPI 5 docs, features/ulfm)",
            ),
            "mpi_bw_rdma": (8.75e9, "derived: inter_node_bw / devices_per_node x link_efficiency"),
            "mpi_bw_tcp": (
                2.5e9,
                "assumed: btl/tcp over IPoIB or Ethernet, ~10 GB/s per node with several streams, "
                "shared by the node's 4 ranks",
            ),
            "mpi_latency_rdma_s": (5e-6, "assumed: ob1 over uct, a few microseconds per message"),
            "mpi_latency_tcp_s": (30e-6, "assumed: a TCP message between nodes, 20-50 microseconds"),
            "reduce_pipeline_depth": (
                3,
                "the code: staging.py queues every device->host copy at once and copies each sum "
                "back on its own stream while the next bucket is reduced",
            ),
            "dp_latency_plain_s": (0.02, "assumed: NCCL all-reduce latency, bucketed"),
            "snapshot_bw": (
                1 / (1 / 25e9 + 1 / 10e9),
                "derived, not measured on a GPU: the device-to-host copy from the side stream into "
                "pinned memory at copy_bw_pinned (PCIe Gen4 x16, 32 GB/s datasheet, ~25 GB/s reached: "
                "assumed), then one core's copy into the slot at host_memcpy_bw (assumed), one after "
                "the other (benchmarks/snapshot_cost.py --device cuda measures both)",
            ),
            "snapshot_overlap": (
                1,
                "the code: the copy on a side stream (snapshot_copy.py) and the write on a thread; "
                "only the next optimizer step waits for the copy, on the device. Assumed: the copy "
                "does not slow the step's own PCIe traffic (the reduction's staging) noticeably",
            ),
            "detect_crash_s": (
                CALIBRATION["detect_crash_s"],
                MEASURED_CALIBRATE + " (this-machine); a dead process is reported by the runtime, "
                "assumed as fast on a cluster",
            ),
            "repair_base_s": (
                CALIBRATION["repair_base_s"],
                "extrapolated: the fit measured here at 4/8/16 CPU ranks (this-machine), applied at 512",
            ),
            "repair_per_log2_rank_s": (
                CALIBRATION["repair_per_log2_rank_s"],
                "extrapolated: the same fit's slope; 4/8/16 ranks measured, 512 not",
            ),
            "spawn_s": (
                10.0,
                "assumed: interpreter + torch import + CUDA context on a GPU node (2.2 s measured here "
                "on CPU, results/rejoin.json)",
            ),
            "rebuild_s": (
                5.0,
                "assumed: NCCL world of 8 ranks and a 7B stage built on the GPU (1 s here on CPU)",
            ),
            "state_transfer_bw": (8.75e9, "assumed: inter_node_bw / devices_per_node x link_efficiency"),
            "launcher_s": (2.0, "assumed: one Python process importing the launcher (1-2 s here)"),
            "start_base_s": (
                12.0,
                "assumed: interpreter, torch import from a shared file system, CUDA and model build on "
                "512 ranks (a 4-rank CPU job starts in 8-10 s here)",
            ),
            "start_per_log2_rank_s": (
                0.5,
                "assumed: NCCL/MPI communicator set-up grows with scale (FlashRecovery: restart time "
                "grows with cluster size without their scale-independent restart)",
            ),
            "start_plain_extra_s": (0.0, "assumed: the same start-up with and without ULFM"),
            "relaunch_s": (
                5.0,
                "assumed: tearing the failed job down and starting mpirun again inside the allocation "
                "(no queue wait; here a relaunch costs no more than a first start: the fit gives -0.2 s)",
            ),
            "exit_ft_s": (2.0, "assumed"),
            "exit_plain_s": (5.0, "assumed (MPI_Finalize + the final checkpoint is not counted)"),
            "save_fixed_s": (0.5, "assumed: the save's collective agreement and file creation"),
            "stage_bw": (25e9, "datasheet: PCIe Gen4 x16, 32 GB/s; ~25 GB/s reached (assumed)"),
            "fs_write_bw": (2e9, "assumed: one rank's stream to a Lustre-class file system"),
            "fs_read_bw_aggregate": (
                650e9,
                "assumed: published aggregate of ALCF's Eagle Lustre (an A100-era HPC file system; the "
                "paper's site is not known here)",
            ),
        }
    ),
)

# -- this-machine: the 2-core development machine, tiny LLaMA (benchmarks/faults.py) -------------
C = CALIBRATION
THIS_MACHINE = Profile(
    "this-machine",
    "the 2-core development machine (x86_64, no GPU, torch CPU, Open MPI 5 ULFM); ranks oversubscribe "
    "the cores, one thread each",
    _table(
        {
            "peak_flops": (
                C["peak_flops"],
                "measured here: single-thread fp32 torch.mm 256x256, best of 20 "
                "(python -m nanotron_recover.simulate.constants --measure-peak)",
            ),
            "mfu": (
                TINY_MICROBATCH_FLOPS / (C["peak_flops"] * C["microbatch_s"]),
                MEASURED_CALIBRATE + " (fitted to the steady step times)",
            ),
            "shared_cores": (2, "measured here: os.cpu_count()"),
            "devices_per_node": (1024, "one host: every rank on it"),
            "intra_node_bw": (5e9, "assumed: shared-memory copy; unused at tp=pp=1"),
            "inter_node_bw": (5e9, "assumed: shared-memory copy (one host)"),
            "link_efficiency": (1.0, "assumed: the reduction's cost is in dp_latency_*_s, fitted"),
            "hbm_bw": (1e10, "assumed: CPU memory; the tiny model's optimizer step is negligible"),
            "dp_latency_ft_s": (
                C["dp_latency_ft_s"],
                MEASURED_CALIBRATE + " (fitted to the steady step times; the tiny model's one bucket, "
                "modelled apart, adds 0.5 ms to it)",
            ),
            "grad_staging": (0, "gradients in host memory: no device"),
            "staging_pinned": (0, "the code (unused without staging)"),
            "copy_bw_pinned": (1e10, "unused: no device"),
            "copy_bw_pageable": (1e10, "unused: no device"),
            "host_memcpy_bw": (HOST["host_memcpy_bw"], MEASURED_HOST_BW),
            "cpu_sum_bw": (HOST["cpu_sum_bw"], MEASURED_HOST_BW),
            "mpi_transport_rdma": (0, "one host: Open MPI's sm BTL, whichever transport is named"),
            "mpi_bw_rdma": (HOST["mpi_bw_sm"], FITTED_SM),
            "mpi_bw_tcp": (HOST["mpi_bw_sm"], FITTED_SM),
            "mpi_latency_rdma_s": (0.0, "folded into the fitted sm bandwidth"),
            "mpi_latency_tcp_s": (0.0, "folded into the fitted sm bandwidth"),
            "reduce_pipeline_depth": (1, "the code: buckets.py reduces one bucket at a time"),
            "dp_latency_plain_s": (
                C["dp_latency_plain_s"],
                MEASURED_CALIBRATE + " (fitted to the steady step times)",
            ),
            "snapshot_bw": (
                HOST["snapshot_bw"],
                MEASURED_SNAPSHOT + ": a snapshot of 31.5 MB written alone in 4.4 ms (export, copy "
                "into the mapped slot in /dev/shm, publish); beside a step computing on both cores "
                "the thread took 4x that and the step lost as much (results/snapshot_cost.md), which "
                "the model does not charge",
            ),
            "snapshot_overlap": (
                0,
                MEASURED_SNAPSHOT + ": every core computes, so the snapshot thread's copy takes its "
                "time from the step",
            ),
            "detect_crash_s": (
                C["detect_crash_s"],
                MEASURED_CALIBRATE + ": median detect_s of forward-pass crashes at 4 ranks "
                "(0.038 s over all phases in results/recovery.json)",
            ),
            "repair_base_s": (
                C["repair_base_s"],
                MEASURED_CALIBRATE + ": recover_s at 4/8/16 ranks, a + b*log2(ranks)",
            ),
            "repair_per_log2_rank_s": (
                C["repair_per_log2_rank_s"],
                MEASURED_CALIBRATE + ": the same fit's slope",
            ),
            "spawn_s": (2.22, MEASURED_REJOIN + ", 4 replicas"),
            "rebuild_s": (0.98, MEASURED_REJOIN + ", 4 replicas"),
            "state_transfer_bw": (8.7e8, MEASURED_REJOIN + ": 30 MiB in 0.036 s"),
            "launcher_s": (
                C["launcher_s"],
                MEASURED_CALIBRATE + ": python -c 'import nanotron_recover.restart', best of 3",
            ),
            "start_base_s": (
                C["start_base_s"],
                MEASURED_CALIBRATE + ": start-up at 4/8/16 ranks, a + b*log2(ranks)",
            ),
            "start_per_log2_rank_s": (
                C["start_per_log2_rank_s"],
                MEASURED_CALIBRATE + ": the same fit's slope",
            ),
            "start_plain_extra_s": (
                C["start_plain_extra_s"],
                MEASURED_CALIBRATE + ": plain 4-rank start-up minus the fit at 4",
            ),
            "relaunch_s": (
                C["relaunch_s"],
                MEASURED_CALIBRATE + ": death to the relaunched first step, minus start-up",
            ),
            "exit_ft_s": (C["exit_ft_s"], MEASURED_CALIBRATE),
            "exit_plain_s": (C["exit_plain_s"], MEASURED_CALIBRATE),
            "save_fixed_s": (
                C["save_fixed_s"],
                MEASURED_CALIBRATE + ": commit interval after a save minus the others",
            ),
            "stage_bw": (5e9, "assumed: memory copy; the tiny checkpoint is ~2 MB"),
            "fs_write_bw": (1e9, "assumed: local disk, page cache"),
            "fs_read_bw_aggregate": (1e9, "assumed: local disk, page cache"),
        }
    ),
)

PROFILES: dict[str, Profile] = {p.name: p for p in (A100_512, THIS_MACHINE)}


def get_profile(name: str, overrides: Mapping[str, float] | None = None) -> Profile:
    """The named profile with ``overrides`` (``--set-constant``) applied."""
    try:
        profile = PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r} (known: {', '.join(PROFILES)})") from None
    return profile.with_values(overrides or {})


def parse_overrides(items: list[str]) -> dict[str, float]:
    """``["NAME=VALUE", ...]`` -> ``{NAME: VALUE}``; ValueError on a malformed item."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--set-constant expects NAME=VALUE, got {item!r}")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--set-constant {name.strip()}: {value!r} is not a number") from None
    return out


def format_constants(profile: Profile) -> str:
    """The table ``simulate --constants`` prints."""
    lines = [f"profile {profile.name}: {profile.description}", ""]
    width = max(len(k) for k in profile)
    for c in profile.values():
        lines.append(f"{c.name:<{width}}  {c.value:<12.4g} {c.unit:<8} {c.meaning}")
        lines.append(f"{'':<{width}}  source: {c.source}")
    return "\n".join(lines)


def measure_host_bandwidth(numel: int = 25 * 2**18, repeats: int = 15) -> dict[str, float]:
    """One core's copy and float32 add over ``numel`` floats (25 MiB by default), best of
    ``repeats``: ``host_memcpy_bw`` and ``cpu_sum_bw`` in bytes/s (bytes of the destination)."""
    import time

    import numpy as np

    a = np.random.default_rng(0).random(numel, dtype=np.float32)
    b = np.empty_like(a)

    def best(f: object) -> float:
        t_min = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()  # type: ignore[operator]
            t_min = min(t_min, time.perf_counter() - t0)
        return t_min

    nbytes = a.nbytes
    copy = best(lambda: np.copyto(b, a))
    add = best(lambda: np.add(a, b, out=a))
    return {"host_memcpy_bw": nbytes / copy, "cpu_sum_bw": nbytes / add}


def measure_peak_flops(n: int = 256, repeats: int = 20) -> float:
    """Single-thread fp32 matmul rate of this machine, best of ``repeats`` (FLOP/s)."""
    import time

    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / 10)
    return 2 * n**3 / best


if __name__ == "__main__":
    import sys

    if "--measure-peak" in sys.argv:
        print(f"peak_flops {measure_peak_flops():.3g}")
    if "--measure-host" in sys.argv:
        for name, value in measure_host_bandwidth().items():
            print(f"{name} {value:.3g}")
