"""all_reduce_sum and reduce_scatter_sum on gloo give gloo's own bits (docs/spec/platform.md s1.1).

The wrappers sum after one all-to-all, in the order of gloo's ring, instead of running the ring.
Each launch below runs both the wrapper and torch.distributed's own collective on the same inputs
and returns the integer views of both; the tests compare them in the parent. The inputs spread
over 2^-20..2^20 (so the order of the additions shows in nearly every element), hold -0.0, +-inf
and NaNs with payloads, and the sizes cover fewer elements than ranks, ragged chunks, and more
than one of gloo's 1 MiB segments per chunk.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parity.distributed import collectives as C
from parity.harness.launch import LaunchConfig, launch

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
# all-reduce sizes: below 2 x world (native path), ragged, at and past the exchange's byte limit
AR_SIZES = [1, 5, 8, 13, 100, 1023, 4096, 17408, 32768, 65536]
# reduce-scatter shard sizes; 300_000 x 4 ranks x 4 bytes spans several 1 MiB segments per chunk
RS_SIZES = [1, 3, 64, 1000, 4099, 300_000]


def _inputs(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(97 * salt + rank)
    t = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 21, (n,), generator=g).float())
    if n >= 6:
        t[0] = -0.0
        t[1] = torch.tensor([0x7FC00100 + rank], dtype=torch.int32).view(torch.float32)[0]
        t[2] = float("inf") if rank % 2 else float("-inf")
        t[3] = float("inf")
    return t.to(dtype)


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(INT_VIEW[t.dtype]).tolist()


def _rank_sums(ctx) -> dict:
    r, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in INT_VIEW:
        for n in AR_SIZES:
            x = _inputs(r, n, dtype, n)
            native = x.clone()
            dist.all_reduce(native)
            mine = x.clone()
            C.all_reduce_sum(mine, None)
            out[f"ar/{dtype}/{n}"] = (_bits(mine), _bits(native))
            h = C.all_reduce_sum(x, None, async_op=True)  # the sums land at wait()
            exchanged = isinstance(h, C._SumOnWait)
            h.wait()
            out[f"ar-async/{dtype}/{n}"] = (_bits(x), h.is_completed(), exchanged)
            if 2 * world <= n:  # the two-exchange all-reduce, whatever the sizes it is chosen for
                split = _inputs(r, n, dtype, n)
                h = C._split_exchange_and_sum(split, None, async_op=True)
                h.wait()
                now = _inputs(r, n, dtype, n)  # without a handle: the sums are there on return
                C._split_exchange_and_sum(now, None, async_op=False)
                out[f"split/{dtype}/{n}"] = (_bits(split), _bits(now), _bits(native))
        for n in RS_SIZES:
            x = _inputs(r, n * world, dtype, n + 1)
            native = torch.empty(n, dtype=dtype)
            C._reduce_scatter_single(native, x.clone())
            mine = torch.empty(n, dtype=dtype)
            C.reduce_scatter_sum(mine, x, None)
            out[f"rs/{dtype}/{n}"] = (_bits(mine), _bits(native))
            later = torch.empty(n, dtype=dtype)
            h = C.reduce_scatter_sum(later, x, None, async_op=True)
            exchanged = isinstance(h, C._SumOnWait)
            h.wait()
            out[f"rs-async/{dtype}/{n}"] = (_bits(later), h.is_completed(), exchanged)
    # several sums at once (the DDP's unoverlapped grad reductions): each with its own bits
    for dtype in INT_VIEW:
        ars = [_inputs(r, n, dtype, n + 7) for n in AR_SIZES]
        rss = [(torch.empty(n, dtype=dtype), _inputs(r, n * world, dtype, n + 11)) for n in RS_SIZES[:4]]
        native = [t.clone() for t in ars]
        for t in native:
            dist.all_reduce(t)
        native_rs = []
        for shard, inp in rss:
            o = torch.empty_like(shard)
            C._reduce_scatter_single(o, inp.clone())
            native_rs.append(o)
        exchanges = []  # the coalesced path must run, not one collective each (the same bits)
        chunk_exchange = C._chunk_exchange
        C._chunk_exchange = lambda *args: exchanges.append(1) or chunk_exchange(*args)
        try:
            C.sums_coalesced(ars, rss, None)
        finally:
            C._chunk_exchange = chunk_exchange
        out[f"coalesced/{dtype}"] = ([_bits(t) for t in ars] + [_bits(o) for o, _ in rss],
                                     [_bits(t) for t in native] + [_bits(o) for o in native_rs], len(exchanges))
    # mixed dtypes are not coalesced: one collective each, with its own bits
    mixed = [_inputs(r, 100, torch.float32, 5), _inputs(r, 100, torch.bfloat16, 6)]
    mixed_rs = [(torch.empty(3, dtype=torch.float32), _inputs(r, 3 * world, torch.float32, 9))]
    native = [t.clone() for t in mixed]
    for t in native:
        dist.all_reduce(t)
    native_rs = torch.empty(3)
    C._reduce_scatter_single(native_rs, mixed_rs[0][1].clone())
    C.sums_coalesced(mixed, mixed_rs, None)
    out["coalesced/mixed"] = ([_bits(t) for t in mixed] + [_bits(mixed_rs[0][0])],
                              [_bits(t) for t in native] + [_bits(native_rs)])
    return out


def test_coalesced_sums_have_each_collectives_bits(per_rank):
    for r, seen in enumerate(per_rank):
        for dtype in INT_VIEW:
            mine, native, exchanges = seen[f"coalesced/{dtype}"]
            assert exchanges == 1, f"rank {r}, {dtype}: {exchanges} coalesced exchanges"
            assert len(mine) == len(AR_SIZES) + 4
            for i, (a, b) in enumerate(zip(mine, native)):
                assert a == b, f"rank {r}, {dtype}, tensor {i}"
        mine, native = seen["coalesced/mixed"]
        assert mine == native, f"rank {r}, mixed dtypes"


@pytest.fixture(scope="module", params=[3, 4], ids=lambda w: f"world{w}")
def per_rank(request) -> list[dict]:
    return launch(_rank_sums, LaunchConfig(world_size=request.param, start_method="forkserver", deadline_s=240))


@pytest.mark.parametrize("op, sizes", [("ar", AR_SIZES), ("rs", RS_SIZES)], ids=["all_reduce_sum", "reduce_scatter_sum"])
def test_sums_have_gloos_bits(per_rank, op, sizes):
    world = len(per_rank)
    for r, seen in enumerate(per_rank):
        for dtype in INT_VIEW:
            for n in sizes:
                mine, native = seen[f"{op}/{dtype}/{n}"]
                assert mine == native, f"rank {r}, {dtype}, {n}"
                later, done, exchanged = seen[f"{op}-async/{dtype}/{n}"]
                assert later == native and done, f"rank {r}, {dtype}, {n}, async"
                # the comparison is only worth something where the exchange ran, not gloo twice
                nbytes = n * torch.tensor([], dtype=dtype).element_size()
                want = op == "rs" or (2 * world <= n and nbytes <= C.EXCHANGE_MAX_BYTES)
                assert exchanged == want, f"rank {r}, {dtype}, {n}: exchange ran: {exchanged}"
                if op == "ar" and 2 * world <= n:
                    split, now, native = seen[f"split/{dtype}/{n}"]
                    assert split == native and now == native, f"rank {r}, {dtype}, {n}, split exchange"


def test_the_sums_depend_on_the_order():
    """The inputs are such that a plain rank-order sum differs from gloo's (else the tests above
    could not tell the ring's order from any other)."""
    world, n = 4, 17408
    xs = torch.stack([_inputs(r, n, torch.float32, n) for r in range(world)])
    plain = xs[0] + xs[1] + xs[2] + xs[3]
    ring = torch.empty(n)
    C._ring_sum_into(ring, xs, 0, n)
    differ = (plain.view(torch.int32) != ring.view(torch.int32)).sum().item()
    assert differ > n // 10, differ


@pytest.mark.parametrize("numel, world, size, want", [
    (1, 4, 4, [1, 0, 0, 0]),
    (17, 4, 4, [6, 6, 5, 0]),  # 8 segments of 3 elements (9 bytes rounded up), 2 per chunk
    (65536, 8, 4, [8192] * 8),
    # 1.5 MiB over 4 ranks: 8 segments of 49152 elements, 2 per chunk
    (393216, 4, 4, [98304] * 4),
    # 20 MiB over 4 ranks: 20 segments of 1 MiB, 5 per chunk
    (5 << 20, 4, 4, [1310720] * 4),
])
def test_ring_chunk_sizes(numel, world, size, want):
    assert C.ring_chunk_sizes(numel, world, size) == want


@pytest.mark.parametrize("world, numel, size, want", [
    (8, 15, 4, "native"),      # fewer elements than 2 x world: gloo's ring
    (8, 16, 4, "exchange"),
    (8, 16383, 4, "exchange"),  # just under 64 KiB
    (8, 16384, 4, "split"),     # 64 KiB from world 8: two exchanges
    (8, 32768, 2, "split"),     # bf16, 64 KiB
    (8, 1 << 22, 4, "split"),   # past the single exchange's limit, still split
    (7, 16384, 4, "exchange"),  # below world 8 never split
    (4, 32768, 4, "exchange"),  # 128 KiB: the single exchange's limit
    (4, 32769, 4, "native"),
    (2, 4, 4, "exchange"),
    (2, 3, 4, "native"),
])
def test_all_reduce_route(world, numel, size, want):
    """The routing at its boundaries: the worlds-3/4 launches above never reach the split, and a
    world-8 launch would cost the suite's time."""
    assert C.all_reduce_route(world, numel, size) is C.AllReduceRoute(want)
