"""ParallelContext: this rank's coordinates in the 3D (dp, pp, tp) grid and its process groups.

The rank layout is ``parallel/layout.py``'s (tp fastest, a replica is a contiguous block of ranks),
so a tensor-parallel group is ``tp`` consecutive ranks (kept inside one node by the launcher) and a
pipeline group strides by ``tp``. The fault-tolerant mode uses the same layout (``ft/topology.py``),
where each replica is its own torch world (dp=1 here) and data parallelism goes over MPI instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .layout import grid_coordinates, grid_rank


@dataclass
class ParallelContext:
    tp: int
    pp: int
    dp: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    mp_group: dist.ProcessGroup | None = None  # the replica: all tp*pp ranks of one dp rank
    tied_group: dist.ProcessGroup | None = None  # first and last pp stage (tied embeddings)
    pp_global_ranks: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, tp: int, pp: int, dp: int, device: torch.device) -> ParallelContext:
        """Build every group; collective over the whole default world (all ranks, same order)."""
        world = dist.get_world_size()
        if world != tp * pp * dp:
            raise ValueError(f"world size {world} != tp*pp*dp = {tp}*{pp}*{dp}")
        rank = dist.get_rank()
        d, p, t = grid_coordinates(rank, tp, pp)
        ctx = cls(tp=tp, pp=pp, dp=dp, device=device, rank=rank, tp_rank=t, pp_rank=p, dp_rank=d)

        def make(groups: list[list[int]]) -> dist.ProcessGroup | None:
            mine = None
            for ranks in groups:
                g = dist.new_group(ranks)  # every rank must create every group, in the same order
                if rank in ranks:
                    mine = g
            return mine

        ctx.tp_group = make(
            [[grid_rank(a, b, c, tp, pp) for c in range(tp)] for a in range(dp) for b in range(pp)]
        )
        pp_groups = [[grid_rank(a, b, c, tp, pp) for b in range(pp)] for a in range(dp) for c in range(tp)]
        ctx.pp_group = make(pp_groups)
        ctx.pp_global_ranks = next(g for g in pp_groups if rank in g)
        ctx.dp_group = make(
            [[grid_rank(a, b, c, tp, pp) for a in range(dp)] for b in range(pp) for c in range(tp)]
        )
        ctx.mp_group = make(
            [[grid_rank(a, b, c, tp, pp) for b in range(pp) for c in range(tp)] for a in range(dp)]
        )
        if pp > 1:
            ctx.tied_group = make(
                [
                    [grid_rank(a, 0, c, tp, pp), grid_rank(a, pp - 1, c, tp, pp)]
                    for a in range(dp)
                    for c in range(tp)
                ]
            )
        return ctx

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.pp_global_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int:
        return self.pp_global_ranks[self.pp_rank + 1]

    @property
    def last_stage_rank(self) -> int:
        return self.pp_global_ranks[-1]
