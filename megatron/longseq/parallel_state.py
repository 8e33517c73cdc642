"""The rank grid: the one place that lays ranks out on named axes and builds their groups.

Axes from the innermost (adjacent ranks) outwards: tp, cp, dp, pp. This is megatron-core's default
order "tp-cp-ep-dp-pp" with ep = 1, so the tp/cp/dp/pp groups built here are exactly the ones
megatron-core's `initialize_model_parallel` builds; `build_process_groups` takes megatron-core's
handles for them (one communicator per set of ranks, not two) and checks the members.

The cp axis is itself a 2D grid (LoongTrain section 3): hp (head-parallel, the Ulysses all-to-all)
x ring (the context-parallel ring). The placement decides which of the two is laid on adjacent
ranks (LoongTrain section 4.3): "head-first" puts a head-parallel group on adjacent ranks (inside a
node), "context-first" puts a ring there. The ring is cut into inner rings of W consecutive ring
positions; the outer rings join the ranks at the same inner position (Double-Ring-Attention).

With --num-distributed-optimizer-instances N the dp x cp group is cut into N instances of
consecutive ranks (megatron-core's intra-partial data-parallel groups): the optimizer is sharded
inside an instance, and the ranks holding the same shard in every instance form the inter groups.

Megatron's --use-tp-pp-dp-mapping swaps the two outer axes (order "tp-cp-pp-dp": pipeline stages
adjacent, data-parallel replicas outermost); megatron-core is initialised with the same order.
Everything here except `build_process_groups` is pure arithmetic, tested without processes.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

PLACEMENTS = ("head-first", "context-first")
# Axis orders from the innermost, as megatron-core spells them (ep = 1 here).
ORDERS = {"tp-cp-dp-pp": "tp-cp-ep-dp-pp", "tp-cp-pp-dp": "tp-cp-ep-pp-dp"}
OURS = ("hp", "ring", "inner", "outer", "tp_cp", "mp")  # the groups megatron-core has no handle for
# Coordinates of a rank, innermost axis first.
AXES = ("tp", "hp", "ring", "dp", "pp")


class GridError(ValueError):
    """A parallel layout whose arithmetic does not work out; the message has the numbers."""


@dataclass(frozen=True)
class RankGrid:
    """world = tp x cp x dp x pp, cp = hp x ring, ring = inner x outer; dp x cp = instances x shards."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    hp: int = 1
    inner_ring: Optional[int] = None
    placement: str = "head-first"
    order: str = "tp-cp-dp-pp"
    instances: int = 1  # distributed-optimizer instances over dp x cp

    def __post_init__(self):
        self._check()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def ring(self) -> int:
        return self.cp // self.hp

    @property
    def inner(self) -> int:
        return self.inner_ring if self.inner_ring is not None else self.ring

    @property
    def outer(self) -> int:
        return self.ring // self.inner

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    def _check(self):
        for name in ("world_size", "tp", "pp", "cp", "hp", "instances"):
            if getattr(self, name) < 1:
                raise GridError(f"{name} must be >= 1, got {getattr(self, name)}")
        model = self.tp * self.cp * self.pp
        if self.world_size % model:
            raise GridError(
                f"world size {self.world_size} is not divisible by tensor ({self.tp}) x context "
                f"({self.cp}) x pipeline ({self.pp}) parallel sizes = {model}"
            )
        if self.cp % self.hp:
            raise GridError(
                f"context parallel size {self.cp} is not divisible by the head-parallel size "
                f"{self.hp} (cp = head-parallel x ring)"
            )
        if self.dp % self.instances:
            # megatron-core asserts it of its expert data-parallel size, which is our dp (see
            # build_process_groups), deep inside its group set-up; here it is one line up front
            raise GridError(
                f"data parallel size {self.dp} is not divisible by the {self.instances} "
                f"distributed-optimizer instances"
            )
        if self.inner_ring is not None and (self.inner_ring < 1 or self.ring % self.inner_ring):
            raise GridError(
                f"inner ring size {self.inner_ring} does not divide the ring size {self.ring} "
                f"(context parallel {self.cp} / head-parallel {self.hp})"
            )
        if self.order not in ORDERS:
            raise GridError(f"order must be one of {tuple(ORDERS)}, got {self.order!r}")
        if self.placement not in PLACEMENTS:
            raise GridError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")

    # ---- rank <-> coordinates -------------------------------------------------------------
    def _cp_index(self, hp_i: int, ring_i: int) -> int:
        # head-first: the hp group is contiguous inside the cp block; context-first: the ring is.
        if self.placement == "head-first":
            return hp_i + self.hp * ring_i
        return ring_i + self.ring * hp_i

    def rank_of(self, tp: int = 0, hp: int = 0, ring: int = 0, dp: int = 0, pp: int = 0) -> int:
        cp_i = self._cp_index(hp, ring)
        outer = dp + self.dp * pp if self.order == "tp-cp-dp-pp" else pp + self.pp * dp
        return tp + self.tp * (cp_i + self.cp * outer)

    def coords(self, rank: int) -> Dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise GridError(f"rank {rank} outside world of size {self.world_size}")
        tp_i, rest = rank % self.tp, rank // self.tp
        cp_i, rest = rest % self.cp, rest // self.cp
        if self.order == "tp-cp-dp-pp":
            dp_i, pp_i = rest % self.dp, rest // self.dp
        else:
            pp_i, dp_i = rest % self.pp, rest // self.pp
        if self.placement == "head-first":
            hp_i, ring_i = cp_i % self.hp, cp_i // self.hp
        else:
            ring_i, hp_i = cp_i % self.ring, cp_i // self.ring
        return {"tp": tp_i, "hp": hp_i, "ring": ring_i, "dp": dp_i, "pp": pp_i}

    # ---- groups -----------------------------------------------------------------------------
    def _sizes(self) -> Dict[str, int]:
        return {"tp": self.tp, "hp": self.hp, "ring": self.ring, "dp": self.dp, "pp": self.pp}

    def groups_along(self, axes: Tuple[str, ...]) -> List[List[int]]:
        """All groups that vary exactly the named axes (others fixed), each ordered by the axes'
        coordinates with the first named axis fastest. Groups are listed in a fixed order, so
        every rank creates them identically."""
        sizes = self._sizes()
        fixed = [a for a in AXES if a not in axes]
        groups = []
        for fixed_vals in itertools.product(*(range(sizes[a]) for a in reversed(fixed))):
            base = dict(zip(reversed(fixed), fixed_vals))
            members = []
            for vals in itertools.product(*(range(sizes[a]) for a in reversed(axes))):
                coords = dict(base, **dict(zip(reversed(axes), vals)))
                members.append(self.rank_of(**coords))
            groups.append(members)
        return groups

    def ring_groups(self, level: str) -> List[List[int]]:
        """Double-Ring groups: 'inner' = W consecutive ring positions; 'outer' = the ranks at the
        same position of every inner ring. Ordered by ring position."""
        out = []
        for ring_group in self.groups_along(("ring",)):
            chunks = [ring_group[i : i + self.inner] for i in range(0, self.ring, self.inner)]
            out.extend(chunks if level == "inner" else [list(g) for g in zip(*chunks)])
        return out

    def all_groups(self) -> Dict[str, List[List[int]]]:
        """Every named group of the run; creation order is this dict's order."""
        return {
            "tp": self.groups_along(("tp",)),
            "cp": self.groups_along(("hp", "ring") if self.placement == "head-first" else ("ring", "hp")),
            "hp": self.groups_along(("hp",)),
            "ring": self.groups_along(("ring",)),
            "inner": self.ring_groups("inner"),
            "outer": self.ring_groups("outer"),
            "dp": self.groups_along(("dp",)),
            "dp_cp": self._sorted(self.groups_along(("hp", "ring", "dp"))),
            "dp_cp_intra": self.instance_groups("intra"),
            "dp_cp_inter": self.instance_groups("inter"),
            "tp_cp": self._sorted(self.groups_along(("tp", "hp", "ring"))),
            "pp": self.groups_along(("pp",)),
            "mp": self._sorted(self.groups_along(("tp", "pp"))),
        }

    def instance_groups(self, level: str) -> List[List[int]]:
        """Distributed-optimizer instances: 'intra' = one instance, consecutive ranks of a dp x cp
        group; 'inter' = the ranks at the same position of every instance (one shard's replicas)."""
        out = []
        for group in self._sorted(self.groups_along(("hp", "ring", "dp"))):
            size = len(group) // self.instances
            chunks = [group[i : i + size] for i in range(0, len(group), size)]
            out.extend(chunks if level == "intra" else [list(g) for g in zip(*chunks)])
        return out

    def aliases(self) -> Dict[str, str]:
        """Groups of ours with the same member lists, in the same order, as an earlier group share
        its handle: no second NCCL communicator over the same ranks (each holds GPU memory). Pure
        Ulysses' hp is cp, a single ring's ring and inner are cp, tp x cp is tp or cp when the other
        is 1, mp is tp or pp. Their traffic never runs at the same time: the all-to-all and the
        ring's transfers are waited on inside attention, before the loss's token count goes over
        cp; the norms' all-reduce on mp comes after the backward's collectives."""
        groups = self.all_groups()
        key = {name: sorted(map(tuple, lists)) for name, lists in groups.items()}
        same = {"dp_cp_intra": "dp_cp"} if self.instances == 1 else {}
        names = list(groups)
        for i, name in enumerate(names):
            earlier = [e for e in names[:i] if e not in same and key[e] == key[name]] if name in OURS else []
            if earlier:
                same[name] = earlier[0]
        return same

    @staticmethod
    def _sorted(groups: List[List[int]]) -> List[List[int]]:
        # Groups whose members are a set (reductions): rank order, as megatron-core keeps them.
        return [sorted(g) for g in groups]

    def describe(self) -> str:
        return (
            f"world {self.world_size} = tp {self.tp} x cp {self.cp} (hp {self.hp} x ring {self.ring}, "
            f"inner ring {self.inner}, {self.placement}) x dp {self.dp} x pp {self.pp}, order {self.order}"
            + (f", {self.instances} distributed-optimizer instances" if self.instances > 1 else "")
        )


@dataclass
class ProcessGroups:
    """This rank's groups on every axis, plus their member lists (ordered as on the axis)."""

    grid: RankGrid
    rank: int
    groups: Dict[str, object] = field(default_factory=dict)
    members: Dict[str, List[int]] = field(default_factory=dict)
    links: Dict[Tuple[str, int, int], object] = field(default_factory=dict)

    def __getattr__(self, name):
        groups = self.__dict__.get("groups", {})
        if name in groups:
            return groups[name]
        raise AttributeError(name)

    def size(self, axis: str) -> int:
        return len(self.members[axis])

    def index(self, axis: str) -> int:
        """This rank's position along the axis (its ring position for 'ring', etc.)."""
        return self.members[axis].index(self.rank)


def build_process_groups(grid: RankGrid, timeout_minutes: int = 10, interleaved: bool = True) -> ProcessGroups:
    """Create every group of `grid` (collective: all ranks call it in the same order), each with
    the run's collective timeout (torch gives a new group its backend's default, not the world's);
    the pipeline's links from the last stage back to the first only for an interleaved schedule.

    Also initialises megatron-core's parallel_state with the same tp/cp/pp sizes; its groups are
    ours (the same handles, members checked), so megatron-core modules that read its globals agree
    with us."""
    from megatron.core import parallel_state as mpu

    rank = dist.get_rank()
    if dist.get_world_size() != grid.world_size:
        raise GridError(f"grid is for {grid.world_size} ranks but the world has {dist.get_world_size()}")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=grid.tp,
        pipeline_model_parallel_size=grid.pp,
        context_parallel_size=grid.cp,
        # no experts here: its expert grid (which has no cp axis) takes tp x cp as its tensor axis,
        # so that its data-parallel size is ours -- what the tp-pp-dp order requires with a
        # pipeline (Megatron's own cp configs in that order set --expert-tensor-parallel-size so)
        expert_tensor_parallel_size=grid.tp * grid.cp,
        order=ORDERS[grid.order],
        create_gloo_process_groups=False,
        num_distributed_optimizer_instances=grid.instances,
        distributed_timeout_minutes=timeout_minutes,
    )
    pgs = ProcessGroups(grid=grid, rank=rank)
    new_group = functools.partial(dist.new_group, timeout=timedelta(minutes=timeout_minutes))
    aliases, theirs = grid.aliases(), _megatron_groups(grid, mpu)
    for name, group_list in grid.all_groups().items():
        for members in group_list if name not in aliases else ():
            # megatron-core's group where it has the same one (its modules use it: a second
            # communicator over the same ranks would cost GPU memory for nothing); new_group is
            # collective over the world even for groups this rank is not in
            handle = theirs[name] if name in theirs else new_group(members)
            if rank in members:
                pgs.groups[name], pgs.members[name] = handle, members
    for name, same in aliases.items():
        pgs.groups[name], pgs.members[name] = pgs.groups[same], pgs.members[same]
    _check_against_megatron(pgs, theirs)
    _build_pipeline_links(grid, pgs, rank, new_group, interleaved)
    return pgs


def pipeline_links(grid: RankGrid, interleaved: bool) -> List[Tuple[str, int, int]]:
    """Directional pipeline links (purpose, sender, receiver) in creation order: activations flow
    from stage i to i+1 (and, interleaved, from the last back to the first), gradients the other
    way. Each gets its own group, so each group carries one direction of one kind of message; a
    link no message takes would still cost an NCCL communicator once connected."""
    links = []
    for members in grid.groups_along(("pp",)):
        p = len(members)
        for i in range(0 if p == 1 else p if interleaved else p - 1):
            nxt = members[(i + 1) % p]
            links.append(("act", members[i], nxt))
            links.append(("grad", nxt, members[i]))
    return links


def _build_pipeline_links(grid: RankGrid, pgs: ProcessGroups, rank: int, new_group, interleaved: bool) -> None:
    pgs.links = {}
    for purpose, src, dst in pipeline_links(grid, interleaved):
        handle = new_group([src, dst]) if src != dst else None
        if rank in (src, dst):
            pgs.links[(purpose, src, dst)] = handle
    # The embedding group: first and last stage of each pipeline (tied word embeddings); with two
    # stages, the pipeline group itself.
    for members in grid.groups_along(("pp",)):
        ends = sorted({members[0], members[-1]})
        handle = None if len(ends) == 1 else pgs.groups.get("pp") if len(members) == 2 else new_group(ends)
        if rank in ends:
            pgs.groups["embd"], pgs.members["embd"] = handle, ends


def _megatron_groups(grid: RankGrid, mpu) -> Dict[str, object]:
    """This rank's groups of megatron-core's parallel state, under our names."""
    theirs = {
        "tp": mpu.get_tensor_model_parallel_group(),
        "cp": mpu.get_context_parallel_group(),
        "dp": mpu.get_data_parallel_group(),
        "dp_cp": mpu.get_data_parallel_group(with_context_parallel=True),
        "pp": mpu.get_pipeline_model_parallel_group(),
        "dp_cp_intra": mpu.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
    }
    if grid.instances > 1:
        theirs["dp_cp_inter"] = mpu.get_inter_distributed_optimizer_instance_group()
    return theirs


def _check_against_megatron(pgs: ProcessGroups, theirs: Dict[str, object]) -> None:
    """Our member lists (axis order) are megatron-core's groups (rank order) as sets."""
    for name, group in theirs.items():
        their_ranks = sorted(dist.get_process_group_ranks(group))
        if sorted(pgs.members[name]) != their_ranks:
            raise GridError(
                f"{name} group {pgs.members[name]} differs from megatron-core's {their_ranks}"
            )
