"""TP x CP x DP x PP ranks for attention, and the expert-parallel regrouping of the same ranks for MoE.

Rank order (Megatron-LM's default ``tp-cp-ep-dp-pp``): tensor parallel fastest, then context
parallel, then data parallel, pipeline slowest::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

MoE layers regroup, inside each pipeline stage and for each TP rank, the ``dp * cp`` attention
ranks (in ``dp_cp`` order, cp fastest) into expert-parallel groups of ``ep`` consecutive members
and expert-data-parallel groups across them (``edp = dp * cp / ep``)::

    rank = tp_rank + tp * (ep_rank + ep * (edp_rank + edp * pp_rank))

so an expert group never leaves its pipeline stage (the MoE-CP layout bug that built expert groups
across stages cannot happen) and, with ``ep == cp``, the expert group is the CP group.
Hierarchical CP levels (inner first, adjacent ranks inner) split the CP dimension.

The attention groups (pp, dp, cp, tp) are the dimensions of one DeviceMesh ``(pp, dp, cp, tp)``,
built with the public ``init_device_mesh``; the regroupings of the same ranks (dp_cp, tp_cp, ep,
edp, hierarchical CP levels) are cut from that rank grid with einops and created with the public
``torch.distributed.new_subgroups_by_enumeration``; a regrouping whose rank lists equal an existing
group's (``ep == cp``, a level of size cp) reuses that group. No private DeviceMesh method
(``_unflatten`` / ``_flatten`` change between torch releases: 2.11's ``_unflatten`` rejects string
dims). :func:`ParallelLayout.build` needs an initialised default process group (any backend, the
``fake`` one included, which is how the tests lay out 64 ranks in one process).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from einops import rearrange
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..core.comm_types import HIERARCHICAL_COMM_TYPES
from .config import AUTO, check_hierarchical_sizes

GROUP_KINDS = ("tp", "cp", "dp", "pp", "tp_cp", "dp_cp", "ep", "edp")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of every parallel dimension; all rules checked at construction.

    Args:
        world_size: number of ranks.
        tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size: tp, cp, pp.
        expert_model_parallel_size: ep, must divide ``dp * cp``.
        hierarchical_context_parallel_sizes: CP levels, inner first, product ``cp`` (optional).
        data_parallel_size: ``world / (tp * cp * pp)`` when ``None``; checked when given.

    Raises:
        ValueError: a size below 1, sizes whose product is not the world size, ``ep`` not dividing
            ``dp * cp``, or hierarchical sizes not multiplying to ``cp`` (names the field and the rule).
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    data_parallel_size: int | None = None

    def __post_init__(self) -> None:
        sizes = {"world_size": self.world_size, "tensor_model_parallel_size": self.tensor_model_parallel_size,
                 "context_parallel_size": self.context_parallel_size,
                 "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
                 "expert_model_parallel_size": self.expert_model_parallel_size}
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        model = self.tensor_model_parallel_size * self.context_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % model:
            raise ValueError(
                f"world_size={self.world_size} is not a multiple of tp * cp * pp = {self.tensor_model_parallel_size} "
                f"* {self.context_parallel_size} * {self.pipeline_model_parallel_size} = {model}"
            )
        dp = self.world_size // model
        if self.data_parallel_size is None:
            object.__setattr__(self, "data_parallel_size", dp)
        elif self.data_parallel_size != dp:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size}: tp * cp * dp * pp must equal world_size="
                f"{self.world_size}, so dp must be {dp}"
            )
        if (dp * self.context_parallel_size) % self.expert_model_parallel_size:
            raise ValueError(
                f"expert_model_parallel_size={self.expert_model_parallel_size} must divide dp * cp = "
                f"{dp} * {self.context_parallel_size} = {dp * self.context_parallel_size} (expert groups are "
                "formed from the attention data- and context-parallel ranks)"
            )
        levels = self.hierarchical_context_parallel_sizes
        if levels is not None:
            check_hierarchical_sizes(levels, self.context_parallel_size)
            object.__setattr__(self, "hierarchical_context_parallel_sizes", tuple(levels))

    @property
    def expert_data_parallel_size(self) -> int:
        """``dp * cp / ep``: replicas of each expert shard."""
        return self.data_parallel_size * self.context_parallel_size // self.expert_model_parallel_size

    def build(self, device_type: str = "cpu") -> ParallelGroups:
        """This rank's groups of every kind (every rank must call it: groups are created collectively).

        Raises:
            ValueError: the default group's size is not ``world_size``.
        """
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"ParallelLayout(world_size={self.world_size}) built on {dist.get_world_size()} ranks")
        tp, cp, pp, ep = (self.tensor_model_parallel_size, self.context_parallel_size,
                          self.pipeline_model_parallel_size, self.expert_model_parallel_size)
        dp, edp = self.data_parallel_size, self.expert_data_parallel_size
        mesh = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
        groups = {kind: mesh.get_group(kind) for kind in ("pp", "dp", "cp", "tp")}
        grid = torch.arange(self.world_size).view(pp, dp, cp, tp)
        built = {_partition(_along(grid, dim)): groups[kind] for dim, kind in enumerate(("pp", "dp", "cp", "tp"))}
        experts = grid.reshape(pp, edp, ep, tp)
        regroupings = {
            "dp_cp": rearrange(grid, "pp dp cp tp -> (pp tp) (dp cp)"),
            "tp_cp": rearrange(grid, "pp dp cp tp -> (pp dp) (cp tp)"),
            "ep": rearrange(experts, "pp edp ep tp -> (pp edp tp) ep"),
            "edp": rearrange(experts, "pp edp ep tp -> (pp ep tp) edp"),
        }
        sizes = self.hierarchical_context_parallel_sizes or ()
        for i in range(len(sizes)):  # level 0 (inner, adjacent CP ranks) is the last CP dim
            regroupings[f"cp_level_{i}"] = _along(grid.reshape(pp, dp, *reversed(sizes), tp), 1 + len(sizes) - i)
        for kind, rank_lists in regroupings.items():
            key = _partition(rank_lists)
            if key not in built:
                built[key] = dist.new_subgroups_by_enumeration([list(r) for r in key])[0]
            groups[kind] = built[key]
        levels = [groups.pop(f"cp_level_{i}") for i in range(len(sizes))]
        return ParallelGroups(self, {"attention": mesh}, groups, levels)

    def node_levels(self, ranks_per_node: int) -> tuple[int, int]:
        """The hierarchical CP levels that follow the node boundary, ``(CP ranks on one node, nodes one CP group
        spans)``: a2a inside a node (NVLink), p2p across nodes; global ranks numbered node by node, ``ranks_per_node``
        on each (torchrun's ``LOCAL_WORLD_SIZE``). ``(cp, 1)``: every CP group inside one node.

        Raises:
            ValueError: ``ranks_per_node`` below 1, or a CP group whose ranks do not fall into equal runs per node
                (give the levels explicitly).
        """
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node!r} must be an integer >= 1 (LOCAL_WORLD_SIZE)")
        tp, cp, pp = self.tensor_model_parallel_size, self.context_parallel_size, self.pipeline_model_parallel_size
        grid = torch.arange(self.world_size).view(pp, self.data_parallel_size, cp, tp)
        runs = set()
        for ranks in rearrange(grid, "pp dp cp tp -> (pp dp tp) cp").tolist():
            nodes = [rank // ranks_per_node for rank in ranks]
            runs.update(len(list(run)) for _, run in itertools.groupby(nodes))
        inner = runs.pop()
        if runs or cp % inner:
            raise ValueError(f"context_parallel_size={cp} with {ranks_per_node} ranks per node (LOCAL_WORLD_SIZE) and "
                             f"tp={tp}: a CP group's ranks do not fall into equal runs per node, so the node boundary "
                             "gives no hierarchical levels; set hierarchical_context_parallel_sizes (cp-train: "
                             "--hierarchical-cp-sizes)")
        return inner, cp // inner

    def describe(self, groups: ParallelGroups | None = None) -> str:
        """Sizes and the rank grid of each view (``pp`` blocks of ``dp x cp x tp`` and
        ``edp x ep x tp``), for logs; pure (no processes needed)."""
        tp, cp, pp, ep = (self.tensor_model_parallel_size, self.context_parallel_size,
                          self.pipeline_model_parallel_size, self.expert_model_parallel_size)
        ranks = torch.arange(self.world_size)
        lines = [f"ParallelLayout world={self.world_size} tp={tp} cp={cp} dp={self.data_parallel_size} pp={pp} "
                 f"ep={ep} edp={self.expert_data_parallel_size} "
                 f"hierarchical_cp={list(self.hierarchical_context_parallel_sizes or [])} (tp fastest, pp slowest)"]
        for stage, block in enumerate(ranks.view(pp, -1)):
            lines.append(f"  pp stage {stage}: attention [dp][cp][tp] = {block.view(-1, cp, tp).tolist()}")
            lines.append(f"  pp stage {stage}: experts   [edp][ep][tp] = {block.view(-1, ep, tp).tolist()}")
        return "\n".join(lines)


def _along(grid: torch.Tensor, dim: int) -> torch.Tensor:
    """Rank lists of the groups along ``dim`` of a rank grid: ``(groups, grid.shape[dim])``."""
    return grid.movedim(dim, -1).reshape(-1, grid.shape[dim])


def _partition(rank_lists: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """A partition of the ranks as sorted tuples (rows of ``rank_lists``), comparable across kinds."""
    return tuple(sorted(tuple(sorted(row)) for row in rank_lists.tolist()))


@dataclass
class ParallelGroups:
    """This rank's process groups from :meth:`ParallelLayout.build`.

    ``groups[kind]`` for every kind of :data:`GROUP_KINDS`; ``hierarchical_cp_groups`` inner
    first (empty without hierarchical sizes); ``meshes["attention"]`` the ``(pp, dp, cp, tp)`` DeviceMesh.
    """

    layout: ParallelLayout
    meshes: dict[str, DeviceMesh]
    groups: dict[str, dist.ProcessGroup]
    hierarchical_cp_groups: list[dist.ProcessGroup] = field(default_factory=list)

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of ``kind`` (a hierarchical level: ``cp_level_i``)."""
        if kind.startswith("cp_level_"):
            return dist.get_process_group_ranks(self.hierarchical_cp_groups[int(kind.rsplit("_", 1)[1])])
        return dist.get_process_group_ranks(self.groups[kind])


def default_hierarchical_sizes(cp_comm_type: str | list[str], layout: ParallelLayout,
                               ranks_per_node: int) -> list[int] | None:
    """``hierarchical_context_parallel_sizes`` when none are given: the node boundary's levels
    (:meth:`ParallelLayout.node_levels`) for a hierarchical ``cp_comm_type`` (``"a2a+p2p"``: a2a inside a node,
    p2p across), and for ``"auto"`` when a CP group spans nodes (so auto may pick the hierarchy); else ``None``.

    Raises:
        ValueError: a hierarchical comm type whose CP groups do not split evenly over the nodes (named).
    """
    types = [cp_comm_type] if isinstance(cp_comm_type, str) else list(cp_comm_type)
    if any(t in HIERARCHICAL_COMM_TYPES for t in types):
        return list(layout.node_levels(ranks_per_node))
    if AUTO in types and layout.context_parallel_size > ranks_per_node:
        try:
            inner, outer = layout.node_levels(ranks_per_node)
        except ValueError:
            return None  # auto without the hierarchy: it picks among the flat patterns
        return [inner, outer] if outer > 1 else None
    return None

