import itertools

import pytest
import torch.distributed as dist

from megatron.longseq.parallel_state import GridError, RankGrid, build_process_groups, pipeline_links
from tests.unit_tests.dist_utils import grid_groups, run_ranks


def _partitions(groups, world):
    flat = sorted(itertools.chain.from_iterable(groups))
    return flat == list(range(world))


@pytest.mark.parametrize("kw", [
    dict(world_size=8, tp=2),
    dict(world_size=16, tp=2, cp=4, hp=2),
    dict(world_size=16, cp=8, hp=2, inner_ring=2, placement="context-first"),
    dict(world_size=24, tp=2, cp=4, hp=4, pp=3),
    dict(world_size=24, tp=2, cp=2, pp=3, order="tp-cp-pp-dp"),
    dict(world_size=16, tp=2, cp=2, instances=2),
])
def test_coordinates_round_trip_and_groups_partition_the_world(kw):
    grid = RankGrid(**kw)
    assert grid.tp * grid.cp * grid.dp * grid.pp == grid.world_size
    seen = set()
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        assert grid.rank_of(**c) == rank
        seen.add(tuple(c.values()))
    assert len(seen) == grid.world_size
    sizes = {"tp": grid.tp, "cp": grid.cp, "hp": grid.hp, "ring": grid.ring, "inner": grid.inner,
             "outer": grid.outer, "dp": grid.dp, "dp_cp": grid.dp * grid.cp, "pp": grid.pp,
             "mp": grid.tp * grid.pp, "tp_cp": grid.tp * grid.cp,
             "dp_cp_intra": grid.dp * grid.cp // grid.instances, "dp_cp_inter": grid.instances}
    for name, groups in grid.all_groups().items():
        assert _partitions(groups, grid.world_size), name
        assert all(len(g) == sizes[name] for g in groups), name


def test_megatron_order_tp_innermost_then_cp_dp_pp():
    grid = RankGrid(world_size=16, tp=2, cp=2, pp=2)
    assert grid.groups_along(("tp",))[0] == [0, 1]
    assert grid.groups_along(("hp", "ring"))[0] == [0, 2]  # cp stride tp
    assert grid.groups_along(("dp",))[0] == [0, 4]  # dp stride tp*cp
    assert grid.groups_along(("pp",))[0] == [0, 8]  # pp outermost


def test_tp_pp_dp_mapping_puts_pipeline_stages_inside_data_parallel_replicas():
    grid = RankGrid(world_size=16, tp=2, cp=2, pp=2, order="tp-cp-pp-dp")
    assert grid.groups_along(("tp",))[0] == [0, 1]
    assert grid.groups_along(("hp", "ring"))[0] == [0, 2]
    assert grid.groups_along(("pp",))[0] == [0, 4]  # pp stride tp*cp
    assert grid.groups_along(("dp",))[0] == [0, 8]  # dp outermost


def test_placement_puts_the_chosen_group_on_adjacent_ranks():
    head_first = RankGrid(world_size=8, cp=8, hp=2, placement="head-first")
    assert head_first.groups_along(("hp",))[0] == [0, 1]
    assert head_first.groups_along(("ring",))[0] == [0, 2, 4, 6]
    ctx_first = RankGrid(world_size=8, cp=8, hp=2, placement="context-first")
    assert ctx_first.groups_along(("ring",))[0] == [0, 1, 2, 3]
    assert ctx_first.groups_along(("hp",))[0] == [0, 4]


def test_double_ring_inner_and_outer_rings():
    grid = RankGrid(world_size=8, cp=8, hp=1, inner_ring=2, placement="context-first")
    assert grid.ring_groups("inner") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.ring_groups("outer") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    plain = RankGrid(world_size=4, cp=4)  # W = ring size: one inner ring, outer rings of one
    assert plain.ring_groups("inner") == [[0, 1, 2, 3]]
    assert plain.outer == 1


def test_distributed_optimizer_instances_are_consecutive_ranks_of_dp_x_cp():
    grid = RankGrid(world_size=16, tp=2, cp=2, instances=2)  # dp x cp groups: [0, 2, 4, ..., 14], [1, 3, ...]
    assert grid.instance_groups("intra") == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert grid.instance_groups("inter")[:4] == [[0, 8], [2, 10], [4, 12], [6, 14]]
    # two instances: dp_cp_intra is a group of its own; pp 1: the model-parallel group is the tensor-parallel one
    assert "dp_cp_intra" not in grid.aliases() and grid.aliases()["mp"] == "tp"
    one = RankGrid(world_size=4, tp=2, pp=2)  # one instance: the whole dp x cp group, the same handle
    assert one.instance_groups("intra") == one.all_groups()["dp_cp"] and one.aliases()["dp_cp_intra"] == "dp_cp"


@pytest.mark.parametrize("grid", [RankGrid(world_size=8, tp=2, cp=2), RankGrid(world_size=8, tp=2, pp=2),
                                  RankGrid(world_size=16, tp=2, cp=2, instances=2)], ids=str)
def test_aliased_groups_have_the_same_members(grid):
    groups = grid.all_groups()
    for name, same in grid.aliases().items():
        assert sorted(map(sorted, groups[name])) == sorted(map(sorted, groups[same])), name


@pytest.mark.parametrize("kw, message", [
    (dict(world_size=6, tp=4), "world size 6 is not divisible by tensor (4) x context (1) x pipeline (1)"),
    (dict(world_size=8, cp=4, hp=3), "context parallel size 4 is not divisible by the head-parallel size 3"),
    (dict(world_size=8, cp=8, hp=2, inner_ring=3), "inner ring size 3 does not divide the ring size 4"),
    (dict(world_size=4, placement="sideways"), "placement must be one of"),
    (dict(world_size=4, order="pp-dp-tp-cp"), "order must be one of"),
    (dict(world_size=4, tp=0), "tp must be >= 1"),
    (dict(world_size=8, tp=2, instances=3), "data parallel size 4 is not divisible by the 3"),
    # dp x cp would divide; megatron-core's own check (its expert data-parallel size) would not
    (dict(world_size=4, cp=4, instances=2), "data parallel size 1 is not divisible by the 2"),
])
def test_bad_grids_name_the_numbers(kw, message):
    with pytest.raises(GridError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RankGrid(**kw)


def _check_groups_match_megatron():
    pgs = grid_groups(tp=2)  # raises if any group differs from megatron-core's
    rank = dist.get_rank()
    assert pgs.members["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
    assert pgs.members["dp"] == [rank % 2, rank % 2 + 2]
    assert pgs.index("tp") == rank % 2 and pgs.index("dp") == rank // 2
    assert dist.get_world_size(pgs.tp) == 2 and dist.get_world_size(pgs.dp_cp) == 2
    # --use-tp-pp-dp-mapping: megatron-core initialised with "tp-cp-ep-pp-dp" builds the same groups
    pgs = grid_groups(pp=2, order="tp-cp-pp-dp")
    assert pgs.members["pp"] == [rank - rank % 2, rank - rank % 2 + 1]
    assert pgs.members["dp"] == [rank % 2, rank % 2 + 2]
    # ... with context parallelism too, which megatron-core refuses there unless its expert grid
    # (no cp axis) keeps our data-parallel size
    pgs = grid_groups(pp=2, cp=2, order="tp-cp-pp-dp")
    assert pgs.members["cp"] == [rank - rank % 2, rank - rank % 2 + 1]
    assert pgs.members["pp"] == [rank % 2, rank % 2 + 2] and pgs.members["dp"] == [rank]
    # two distributed-optimizer instances: megatron-core's intra- and inter-instance groups
    pgs = grid_groups(cp=2, instances=2)
    assert pgs.members["dp_cp_intra"] == [rank - rank % 2, rank - rank % 2 + 1]
    assert pgs.members["dp_cp_inter"] == [rank % 2, rank % 2 + 2]


def test_process_groups_agree_with_megatron_core_on_4_ranks():
    run_ranks(_check_groups_match_megatron, 4)


def _check_every_group_takes_the_runs_timeout():
    from datetime import timedelta

    import torch
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    pgs = build_process_groups(RankGrid(world_size=2, pp=2), timeout_minutes=77)
    handles = [g for g in (*pgs.groups.values(), *pgs.links.values()) if g is not None]
    handles += [mpu.get_pipeline_model_parallel_group(), mpu.get_tensor_model_parallel_group(),
                mpu.get_context_parallel_group()]
    assert pgs.links and len(handles) > 8
    for group in handles:
        assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(minutes=77)


def test_every_group_takes_the_runs_timeout():
    """--distributed-timeout-minutes for every group of the grid, the pipeline links and
    megatron-core's: torch gives a new group its backend's default (NCCL: 10 minutes), not the
    world's, so raising the flag changed nothing for the traffic of training."""
    run_ranks(_check_every_group_takes_the_runs_timeout, 2)


@pytest.mark.parametrize("pp, v", [(2, 1), (4, 1), (2, 2), (4, 3)])
def test_pipeline_links_are_those_the_schedule_sends_on(pp, v):
    """One link per (purpose, sender, receiver) that the schedule sends a message on, and no
    other: an unused one would still hold an NCCL communicator once connected."""
    from megatron.longseq.pipeline.p2p import sent_messages
    from megatron.longseq.pipeline.seq1f1b import _stage_ops

    grid = RankGrid(world_size=pp, pp=pp)
    ops = _stage_ops(pp, 2 * pp, 2, v, None, False)
    used = {(purpose, stage, (stage + (1 if purpose == "act" else -1)) % pp)
            for stage in range(pp) for purpose in ("act", "grad")
            if sent_messages(ops[stage], pp, stage, v, purpose)}
    links = pipeline_links(grid, interleaved=v > 1)
    assert len(links) == len(set(links)) and set(links) == used


def _one_communicator_per_group():
    """megatron-core's handles where it has the same group, and the aliases: no second
    communicator over the same ranks (each costs GPU memory on NCCL)."""
    from megatron.core import parallel_state as mpu

    pgs = grid_groups(tp=2)
    assert pgs.tp is mpu.get_tensor_model_parallel_group() and pgs.mp is pgs.tp
    assert pgs.dp_cp is mpu.get_data_parallel_group(with_context_parallel=True)
    assert pgs.cp is mpu.get_context_parallel_group()
    pgs = grid_groups(pp=2)
    assert pgs.pp is mpu.get_pipeline_model_parallel_group() and pgs.embd is pgs.pp


def _no_group_of_ours_repeats_another():
    """On every layout: a group of ours whose members (in order) are another group's is that
    group -- pure Ulysses' hp is cp, a single ring's ring and inner are cp, tp x cp is tp or cp,
    mp is tp or pp."""
    from megatron.longseq.parallel_state import OURS

    for kw in (dict(cp=4, hp=4), dict(cp=4), dict(cp=4, hp=2), dict(cp=4, inner_ring=2), dict(pp=2, tp=2),
               dict(pp=4), dict(tp=2, cp=2, placement="context-first"), dict(pp=2, cp=2, order="tp-cp-pp-dp")):
        pgs = grid_groups(**kw)
        for name in OURS:
            twins = [other for other in pgs.groups if other != name and pgs.members[other] == pgs.members[name]]
            if pgs.size(name) > 1 and twins:
                assert any(pgs.groups[name] is pgs.groups[t] for t in twins), (kw, name, twins)


def test_one_communicator_per_set_of_ranks():
    run_ranks(_one_communicator_per_group, 2)
    run_ranks(_no_group_of_ours_repeats_another, 4)
