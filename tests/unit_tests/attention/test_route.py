"""The ring route (pure): played out for every rank of double rings of every shape and arbitrary
meeting matrices, every send has its receive posted by the peer in the same step (so NCCL batches
pair up), a block is in hand wherever a query meets it, its dK/dV accumulator visits exactly those
holders in schedule order and ends at its owner; without documents it is the plain double ring."""
import pytest
import torch

from megatron.longseq.attention.ring import RingContext
from megatron.longseq.attention.route import Route

SHAPES = [(2, 1), (1, 2), (4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)]  # (W, O)


def _ranks(W, O, meets):
    return [Route(RingContext(None, None, j, W, O), meets) for j in range(W * O)]


def _peer(W, O, j, axis, offset):
    i, p = divmod(j, W)
    return W * i + (p + offset) % W if axis == "inner" else W * ((i + offset) % O) + p


def _deliver(W, O, axis, sends, recvs):
    """sends {rank: (block, offset)}, recvs {rank: [(block, offset)]} of one step -> where each
    sent block lands; every send must meet a receive of the same block and vice versa."""
    landed = {}
    expected = {(j, b, _peer(W, O, j, axis, off)) for j, lst in recvs.items() for b, off in lst}
    for j, (block, off) in sends.items():
        dest = _peer(W, O, j, axis, off)
        assert (dest, block, j) in expected, f"{axis}: {j} sends block {block} to {dest}, which does not receive it"
        expected.discard((dest, block, j))
        landed[block] = dest
    assert not expected, f"{axis}: receives without a send: {expected}"
    return landed


def play(W, O, meets):
    """Run the route; returns each block's accumulator visits and where it ends."""
    R, routes = W * O, _ranks(W, O, meets)
    needs = lambda j, x: meets is None or bool(meets[j, x])  # noqa: E731
    kv_at = {j: j for j in range(R)}  # rank -> block at the start of the outer step
    acc_at, visits = {x: x for x in range(R)}, {x: [] for x in range(R)}
    for o in range(O):
        outer = {j: routes[j].kv_outer(o) for j in range(R)}
        cur = dict(kv_at)
        for t in range(W):
            for j in range(R):
                block = routes[j].rc.source(o, t)
                if needs(j, block):
                    assert cur.get(j) == block, f"({o}, {t}): rank {j} needs block {block} but holds {cur.get(j)}"
                    assert acc_at[block] == j, f"({o}, {t}): block {block}'s accumulator is at {acc_at[block]}, not {j}"
                    visits[block].append(j)
            kv = {j: routes[j].kv_inner(o, t) for j in range(R)}
            landed = _deliver(W, O, "inner", {j: (cur[j], 1) for j in range(R) if kv[j][0]},
                              {j: [(routes[j].rc.source(o, t + 1), -1)] for j in range(R) if kv[j][1]})
            cur = {dest: block for block, dest in landed.items()}
            acc = {j: routes[j].acc_inner(o, t) for j in range(R)} if W > 1 else {}
            sends = {j: (routes[j].rc.source(o, t), a[0]) for j, a in acc.items() if a[0] is not None}
            for j, (block, _) in sends.items():
                assert acc_at[block] == j
            acc_at.update(_deliver(W, O, "inner", sends, {j: a[1] for j, a in acc.items() if a[1]}))
        landed = _deliver(W, O, "outer", {j: (kv_at[j], 1) for j in range(R) if outer[j][0]},
                          {j: [(routes[j].rc.source(o + 1, 0), -1)] for j in range(R) if outer[j][1]})
        kv_at = {dest: block for block, dest in landed.items()}
        if O > 1:
            acc = {j: routes[j].acc_outer(o) for j in range(R)}
            sends = {j: (routes[j].rc.source(o, 0), a[0]) for j, a in acc.items() if a[0] is not None}
            for j, (block, _) in sends.items():
                assert acc_at[block] == j
            acc_at.update(_deliver(W, O, "outer", sends, {j: a[1] for j, a in acc.items() if a[1]}))
    return visits, acc_at


def schedule_order(W, O, x):
    """The holders of block x in schedule order."""
    i, p = divmod(x, W)
    return [W * ((i + o) % O) + (p + t) % W for o in range(O) for t in range(W)]


@pytest.mark.parametrize("W, O", SHAPES)
def test_plain_route_is_the_whole_double_ring(W, O):
    visits, home = play(W, O, None)
    R = W * O
    assert all(visits[x] == schedule_order(W, O, x) for x in range(R)) and home == {x: x for x in range(R)}
    for route in _ranks(W, O, None):  # every hop taken
        assert all(route.kv_inner(o, t) == (True, True) for o in range(O) for t in range(W - 1))
        assert all(route.kv_outer(o) == (True, True) for o in range(O - 1))


@pytest.mark.parametrize("W, O", SHAPES)
def test_any_meeting_matrix_routes_every_block_to_its_readers_and_home(W, O):
    g = torch.Generator().manual_seed(W * 10 + O)
    R = W * O
    for density in (0.0, 0.2, 0.5, 0.9):
        for _ in range(20):
            meets = torch.rand(R, R, generator=g) < density
            visits, home = play(W, O, meets)
            assert home == {x: x for x in range(R)}
            for x in range(R):
                assert visits[x] == [j for j in schedule_order(W, O, x) if meets[j, x]]


def test_a_layout_shared_by_ring_positions_keeps_a_route_for_each():
    """The layout depends on the samples only, so positions in one process (the ring benchmark's
    threads) may share it; a route is one position's view."""
    from types import SimpleNamespace

    from megatron.longseq.attention.documents import lognormal_starts
    from megatron.longseq.attention.placement import DocumentLayout
    from megatron.longseq.attention.ring import _route

    layout = DocumentLayout(lognormal_starts(64, 6.0, 1.0, torch.Generator().manual_seed(0)).unsqueeze(0), 4)
    rcs = [SimpleNamespace(ring_index=j, inner_size=4, outer_size=1, size=4) for j in range(4)]
    routes = [_route(layout, rc, 0, 0) for rc in rcs]
    assert [r.rc for r in routes] == rcs and _route(layout, rcs[1], 0, 0) is routes[1]
