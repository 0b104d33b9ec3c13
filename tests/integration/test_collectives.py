"""parity.distributed.collectives and parity.distributed.groups on 4 real gloo ranks.

One 4-rank launch (module fixture) runs every check and returns what each rank saw; the tests
below assert on it in the parent. Values are compared bit for bit (integer views), and the
payloads include -0.0 and a NaN with a payload, which value comparison would not tell apart.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from parity.distributed import collectives as C
from parity.distributed.groups import build_groups, ep_group_ranks, expt_dp_group_ranks
from parity.harness.launch import LaunchConfig, launch

WORLD = 4
SIZES = [3, 0, 5, 1]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def payload(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s send tensor: random bits, plus -0.0 and a payload NaN for float32."""
    g = torch.Generator().manual_seed(1000 + rank)
    t = torch.randn(n, generator=g) * 100
    if dtype == torch.float32 and n >= 2:
        t[0] = -0.0
        t[1] = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)[0]
    return t.to(dtype)


def bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(INT_VIEW[t.dtype]).tolist()


def gather_uneven(send, sizes, group):
    """The uneven all-gather into a new flat buffer, split per rank (what the tests read)."""
    out = torch.empty(sum(sizes), dtype=send.dtype)
    C.all_gather_uneven_into(out, send, sizes, group)
    return list(torch.split(out, sizes))


def _rank_checks(ctx) -> dict:
    r = ctx.rank
    out: dict = {}

    # --- uneven all-gather: list variant, fp32 / bf16 / fp8
    for dtype in INT_VIEW:
        got = gather_uneven(payload(r, SIZES[r], dtype), SIZES, None)
        out[f"uneven/{dtype}"] = [bits(t) for t in got]

    # --- uneven all-gather into a view of a larger buffer, guarded on both sides
    big = torch.full((sum(SIZES) + 4,), 7.0)
    view = big[2 : 2 + sum(SIZES)]
    C.all_gather_uneven_into(view, payload(r, SIZES[r], torch.float32), SIZES, None)
    out["into/buffer"] = bits(big)

    # --- the send tensor may already be this rank's slot of the output
    flat = torch.zeros(sum(SIZES))
    start = sum(SIZES[:r])
    flat[start : start + SIZES[r]] = payload(r, SIZES[r], torch.float32)
    C.all_gather_uneven_into(flat, flat[start : start + SIZES[r]], SIZES, None)
    out["into/aliased"] = bits(flat)

    # --- asynchronous: one handle over the per-root broadcasts; the data is there after wait()
    flat = torch.zeros(sum(SIZES), dtype=torch.bfloat16)
    handle = C.all_gather_uneven_into(flat, payload(r, SIZES[r], torch.bfloat16), SIZES, None, async_op=True)
    out["async/type"] = type(handle).__name__
    handle.wait()
    out["async/bits"] = bits(flat)
    out["async/done"] = handle.is_completed()

    # --- argument errors are ValueErrors, raised before any traffic
    errors = []
    for bad in (lambda: C.all_gather_uneven_into(torch.zeros(9), torch.zeros(2), SIZES, None),  # wrong own size
                lambda: C.all_gather_uneven_into(torch.zeros(9), torch.zeros(SIZES[r]), SIZES[:3], None),
                lambda: C.all_gather_uneven_into(torch.zeros(3), torch.zeros(SIZES[r]), SIZES, None),
                lambda: C.all_gather_uneven_into(torch.zeros(9), torch.zeros(SIZES[r]), [3.0, 0, 5, 1], None)):
        try:
            bad()
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    out["uneven/errors"] = errors

    # --- even wrappers on the world group
    t = torch.tensor([float(r + 1), 0.5])
    C.all_reduce_sum(t, None)
    out["all_reduce"] = t.tolist()
    rs_out = torch.empty(2)
    C.reduce_scatter_sum(rs_out, torch.arange(8, dtype=torch.float32) * (r + 1), None)
    out["reduce_scatter"] = rs_out.tolist()
    ag8 = torch.empty(WORLD * 2, dtype=torch.float8_e4m3fn)
    work = C.all_gather_into(ag8, payload(r, 2, torch.float8_e4m3fn), None, async_op=True)
    work.wait()
    out["all_gather_into/fp8"] = bits(ag8)
    ag = torch.full((WORLD * 3,), -7.0)  # without a handle: the data is there on return
    assert C.all_gather_into(ag, payload(r, 3, torch.float32), None) is None
    out["all_gather_into/sync"] = bits(ag)
    out["broadcast_object"] = C.broadcast_object({"from": r}, 2, None)
    # all-to-all with uneven splits both ways: rank r sends r + j + 1 rows of value 10 r + j to rank j
    send = torch.cat([torch.full((r + j + 1,), float(10 * r + j)) for j in range(WORLD)])
    recv = torch.empty(sum(i + r + 1 for i in range(WORLD)))
    C.all_to_all_single(recv, send, [i + r + 1 for i in range(WORLD)], [r + j + 1 for j in range(WORLD)], None)
    out["all_to_all"] = recv.tolist()
    # a strided tensor is refused before any traffic: gloo's ring would sum the first numel elements
    # of its memory and leave the rest as they were
    try:
        C.all_reduce_sum((torch.arange(8, dtype=torch.float32) * (r + 1))[::2], None)
        out["all_reduce/strided"] = None
    except ValueError as exc:
        out["all_reduce/strided"] = str(exc)
    out["objects"] = C.all_gather_object({"rank": r}, None)

    # --- groups
    try:
        build_groups(3)
        out["groups/ep3"] = None
    except ValueError as exc:
        out["groups/ep3"] = str(exc)
    pg = build_groups(2)
    out["groups/ep2"] = {
        "dp": (pg.dp, pg.dp_rank), "ep": (pg.ep, pg.ep_rank, pg.ep_ranks),
        "expt_dp": (pg.expt_dp, pg.expt_dp_rank, pg.expt_dp_ranks),
        "sizes": (C.group_size(pg.ep_group), C.group_size(pg.expt_dp_group), C.group_size(pg.dp_group)),
        "describe": pg.describe(),
    }
    # collectives on subgroups use group ranks: gather along EP, broadcast from expert-DP rank 1
    got = gather_uneven(torch.full((pg.ep_rank + 1,), float(r)), [1, 2], pg.ep_group)
    out["groups/ep_gather"] = [x.tolist() for x in got]
    b = gather_uneven(torch.tensor([float(r)]), [1, 1], pg.expt_dp_group)
    out["groups/expt_dp_gather"] = [x.item() for x in b]
    out["groups/ep_broadcast"] = C.broadcast_object(r, 1, pg.ep_group)  # group rank 1's object
    # size-1 groups (ep=1: one rank per EP group) are no-ops / local copies
    one = build_groups(1)
    x = torch.tensor([float(r)])
    C.all_reduce_sum(x, one.ep_group)
    assert C.all_reduce_sum(x, one.ep_group, async_op=True).wait()
    # (outputs filled with -7: a copy that did not happen shows)
    y, rs, a2a = torch.full((1,), -7.0), torch.full((1,), -7.0), torch.full((1,), -7.0)
    C.all_gather_into(y, x, one.ep_group)
    C.reduce_scatter_sum(rs, x * 3, one.ep_group)
    C.all_to_all_single(a2a, x * 5, group=one.ep_group)
    try:
        C.all_to_all_single(torch.empty(2), x, group=one.ep_group)
        shapes = None
    except ValueError as exc:
        shapes = str(exc)
    C.barrier(one.ep_group)
    out["groups/size1"] = (one.ep, one.expt_dp, x.item(), y.item(), rs.item(), a2a.item(), shapes,
                           [t.tolist() for t in gather_uneven(x, [1], one.ep_group)],
                           C.all_gather_object("o", one.ep_group), C.broadcast_object(["mine"], 0, one.ep_group))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    # forkserver: ranks start in ~0.1 s once the server is up; launch itself is tested elsewhere.
    return launch(_rank_checks, LaunchConfig(world_size=WORLD, start_method="forkserver", deadline_s=180))


@pytest.mark.parametrize("dtype", list(INT_VIEW), ids=str)
def test_all_gather_uneven_bits(per_rank, dtype):
    expected = [bits(payload(j, SIZES[j], dtype)) for j in range(WORLD)]
    for r, seen in enumerate(per_rank):
        assert seen[f"uneven/{dtype}"] == expected, f"rank {r}"


def test_all_gather_uneven_into_view_and_aliased_send(per_rank):
    gathered = torch.cat([payload(j, SIZES[j], torch.float32) for j in range(WORLD)])
    guard = bits(torch.full((2,), 7.0))
    for r, seen in enumerate(per_rank):
        assert seen["into/buffer"] == guard + bits(gathered) + guard, f"rank {r}: wrote outside the view"
        assert seen["into/aliased"] == bits(gathered), f"rank {r}"


def test_all_gather_uneven_async_handle(per_rank):
    gathered = torch.cat([payload(j, SIZES[j], torch.bfloat16) for j in range(WORLD)])
    for r, seen in enumerate(per_rank):
        assert seen["async/type"] == "WorkList" and seen["async/done"], f"rank {r}"
        assert seen["async/bits"] == bits(gathered), f"rank {r}"


def test_all_gather_uneven_argument_errors(per_rank):
    assert 2 not in SIZES  # every rank's 2-element piece is the wrong size
    for r, seen in enumerate(per_rank):
        own, count, into, kind = seen["uneven/errors"]
        assert own and f"group rank {r} sends 2 elements but sizes[{r}] = {SIZES[r]}" in own, (r, own)
        assert count and "4 sizes" not in count and "3 sizes for a group of 4" in count
        assert into and "sum(sizes) = 9" in into
        assert kind and "sizes must be non-negative ints, got [3.0, 0, 5, 1]" in kind


def test_even_wrappers(per_rank):
    base = torch.arange(8, dtype=torch.float32)
    reduced = (base * sum(range(1, WORLD + 1))).tolist()
    fp8 = [b for j in range(WORLD) for b in bits(payload(j, 2, torch.float8_e4m3fn))]
    for r, seen in enumerate(per_rank):
        assert seen["all_reduce"] == [10.0, 2.0]
        assert seen["reduce_scatter"] == reduced[2 * r : 2 * r + 2]
        assert seen["all_gather_into/fp8"] == fp8
        assert seen["all_gather_into/sync"] == [b for j in range(WORLD) for b in bits(payload(j, 3, torch.float32))]
        assert seen["broadcast_object"] == {"from": 2}
        assert seen["all_to_all"] == [float(10 * i + r) for i in range(WORLD) for _ in range(i + r + 1)]
        assert seen["all_reduce/strided"] == ("all_reduce_sum: t must be contiguous (collectives write raw "
                                              "memory), got strides (2,) for shape (4,)")
        assert seen["objects"] == [{"rank": j} for j in range(WORLD)]


def test_groups_world4_ep2(per_rank):
    assert ep_group_ranks(4, 2) == [[0, 1], [2, 3]]
    assert expt_dp_group_ranks(4, 2) == [[0, 2], [1, 3]]
    for r, seen in enumerate(per_rank):
        g = seen["groups/ep2"]
        assert g["dp"] == (4, r)
        assert g["ep"] == (2, r % 2, (0, 1) if r < 2 else (2, 3))
        assert g["expt_dp"] == (2, r // 2, (0, 2) if r % 2 == 0 else (1, 3))
        assert g["sizes"] == (2, 2, 4)
        first = 0 if r < 2 else 2
        assert seen["groups/ep_gather"] == [[float(first)], [float(first + 1)] * 2]
        assert seen["groups/expt_dp_gather"] == [float(r % 2), float(2 + r % 2)]  # group ranks 0, 1
        assert seen["groups/ep_broadcast"] == first + 1
    assert per_rank[1]["groups/ep2"]["describe"] == "rank 1/4: dp 1/4, ep 1/2 [0, 1], expt_dp 0/2 [1, 3]"


def test_groups_ep_must_divide_world(per_rank):
    for seen in per_rank:
        assert seen["groups/ep3"] is not None and "ep=3 must divide the world size 4" in seen["groups/ep3"]
    with pytest.raises(ValueError, match="must divide"):
        ep_group_ranks(6, 4)
    with pytest.raises(ValueError, match="positive integer"):
        expt_dp_group_ranks(4, 0)


def test_size1_groups_are_noops(per_rank):
    for r, seen in enumerate(per_rank):
        assert seen["groups/size1"] == (1, 4, float(r), float(r), 3.0 * r, 5.0 * r,
                                        "all_to_all_single: one rank: shapes differ (2,) vs (1,)",
                                        [[float(r)]], ["o"], ["mine"])


_NO_GROUP = """
import torch.distributed as dist
from parity.distributed.groups import build_groups
assert not dist.is_initialized()
try:
    build_groups(1)
except RuntimeError as e:
    print(e)
"""


def test_build_groups_needs_a_process_group():
    # In a fresh interpreter: this test process may hold the session's single-rank group.
    r = subprocess.run([sys.executable, "-c", _NO_GROUP], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "initialised default process group" in r.stdout


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_sums_of_fp8_tensors_are_refused(dtype):
    """FP8 bytes travel only by gathers (as bytes); a sum of FP8 values would round at every hop, so
    both sums refuse them before touching a group (this process needs none)."""
    with pytest.raises(TypeError, match=f"all_reduce_sum: reducing {dtype} tensors is not supported"):
        C.all_reduce_sum(torch.zeros(4, dtype=dtype))
    with pytest.raises(TypeError, match=f"reduce_scatter_sum: reducing {dtype} tensors is not supported"):
        C.reduce_scatter_sum(torch.zeros(2, dtype=dtype), torch.zeros(4, dtype=dtype))
