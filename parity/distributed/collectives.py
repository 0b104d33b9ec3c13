"""Thin, explicit collective wrappers: every collective the training stack and the runner issue
goes through one of these.

Every wrapper takes the group explicitly (None means the default group) and is a no-op, or a
local copy, on a group of one rank, so single-rank runs need no communicator traffic.

Two things the raw ``torch.distributed`` calls do not give on every backend:

- An uneven all-gather ("all-gather-v"). gloo refuses ``all_gather`` with different sizes, so
  :func:`all_gather_uneven_into` sends every rank's piece to every rank in one all-to-all on gloo,
  and on NCCL issues one broadcast per group rank, in rank order, as PyTorch's NCCL backend does
  for uneven ``all_gather``. Sizes are known to every rank and are not exchanged. With
  ``async_op`` it returns one handle (:class:`WorkList`), so the caller can overlap the gather
  with other work as it would a single collective.
- Gathers on gloo in one exchange. gloo's all-gather is a ring of world - 1 dependent hops; with
  more ranks than CPUs every hop waits for the scheduler. The even and uneven all-gathers
  therefore run as one all-to-all on gloo (every rank sends its piece to every rank); a gather
  only moves bytes, so the result is the same on any path.
- FP8 data movement. gloo rejects float8 dtypes ("Invalid scalar type"), so the wrappers that only
  move bytes (all-gathers, all-to-all) send float8 tensors as ``uint8`` views. The bits
  arrive unchanged. Reductions on float8 are refused, as they are meaningless.
- Sums on gloo in one exchange. gloo's all-reduce (and its reduce-scatter, which reduces the same
  way) is a ring of 2 x (world - 1) dependent hops; with more ranks than CPUs every hop waits for
  the scheduler. :func:`all_reduce_sum` (small tensors) and :func:`reduce_scatter_sum` therefore
  exchange the contributions in one all-to-all and add them here, in the ring's own order
  (docs/spec/platform.md s1.1), so the bits are gloo's. Large all-reduces on 8 ranks or more
  run as two such exchanges instead (a reduce-scatter, then an all-gather of the sums), which
  move as little data as the ring. On NCCL the native collectives run.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from parity.distributed.determinism import empty

__all__ = [
    "AllReduceRoute",
    "CompletedWork",
    "WorkList",
    "all_gather_into",
    "all_gather_object",
    "all_gather_uneven_into",
    "all_reduce_route",
    "all_reduce_sum",
    "all_to_all_single",
    "barrier",
    "broadcast_object",
    "group_rank",
    "group_size",
    "reduce_scatter_sum",
    "ring_chunk_sizes",
    "sums_coalesced",
]

# torch 2.13 renamed the single-tensor collectives; keep working on the older names (torch 2.11).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_FLOAT8_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


class CompletedWork:
    """Stands in for a ``dist.Work`` handle when nothing was sent (a group of one rank)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class WorkList:
    """One handle over several ``dist.Work`` handles (the per-root broadcasts of an uneven
    all-gather): ``wait`` waits for all of them, in issue order."""

    def __init__(self, works: Sequence[Any]):
        self.works = list(works)

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return dist.group.WORLD if group is None else group


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (None: the default group)."""
    return dist.get_world_size(_group(group))


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This rank's rank within ``group`` (None: the default group)."""
    return dist.get_rank(_group(group))


def _done(async_op: bool) -> CompletedWork | None:
    return CompletedWork() if async_op else None


def _bytes_if_float8(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a uint8 view of it for float8 dtypes (which gloo cannot send)."""
    return t.view(torch.uint8) if t.dtype in _FLOAT8_DTYPES else t


def _refuse_float8(t: torch.Tensor, what: str) -> None:
    if t.dtype in _FLOAT8_DTYPES:
        raise TypeError(f"{what}: reducing {t.dtype} tensors is not supported; reduce in a wider dtype")


def _copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.data_ptr() != src.data_ptr() or dst.stride() != src.stride():
        dst.copy_(src)


# ---------------------------------------------------------------------------------------------
# Uneven all-gather
# ---------------------------------------------------------------------------------------------


def _check_uneven_args(send: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup) -> tuple[int, int]:
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    if me < 0:
        raise ValueError("all_gather_uneven: this rank is not a member of the group")
    if len(sizes) != world:
        raise ValueError(f"all_gather_uneven: got {len(sizes)} sizes for a group of {world} ranks")
    try:
        bad = [s for s in sizes if operator.index(s) < 0]
    except TypeError:
        bad = [None]
    if bad:
        raise ValueError(f"all_gather_uneven: sizes must be non-negative ints, got {list(sizes)}")
    if send.dim() != 1:
        raise ValueError(f"all_gather_uneven: send must be 1-D, got shape {tuple(send.shape)}")
    if send.numel() != sizes[me]:
        raise ValueError(
            f"all_gather_uneven: group rank {me} sends {send.numel()} elements but sizes[{me}] = {sizes[me]}"
        )
    return world, me


def all_gather_uneven_into(
    out_flat: torch.Tensor,
    send: torch.Tensor,
    sizes: Sequence[int],
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
):
    """Uneven all-gather into a preallocated flat buffer.

    Group rank ``i``'s elements land in ``out_flat[sum(sizes[:i]) : sum(sizes[:i+1])]``.
    ``out_flat`` may be a view into a larger buffer (it is written in place), and ``send`` may
    already be this rank's slot of ``out_flat``.

    Implementation: on gloo one all-to-all (:func:`_gather_by_exchange`); otherwise one broadcast
    rooted at each group rank, in group-rank order, skipping ranks whose size is 0. Both only
    copy, so the result is bit-exact on any backend.

    Args:
        out_flat: 1-D contiguous receive buffer of ``sum(sizes)`` elements, dtype of ``send``.
        send: this rank's 1-D tensor of ``sizes[group_rank]`` elements.
        sizes: element count of every group rank, identical on all ranks (not exchanged).
        group: the process group; None for the default group.
        async_op: return a handle (:class:`WorkList`) instead of waiting; ``out_flat`` holds
            the result only after ``handle.wait()``.

    Returns:
        ``out_flat``, or with ``async_op`` the handle.
    """
    group = _group(group)
    world, me = _check_uneven_args(send, sizes, group)
    sizes = [operator.index(s) for s in sizes]
    total = sum(sizes)
    if out_flat.dim() != 1 or out_flat.numel() != total:
        raise ValueError(
            f"all_gather_uneven_into: out_flat must be 1-D with sum(sizes) = {total} elements, "
            f"got shape {tuple(out_flat.shape)}"
        )
    if not out_flat.is_contiguous():
        raise ValueError("all_gather_uneven_into: out_flat must be contiguous (collectives write raw memory)")
    if out_flat.dtype != send.dtype or out_flat.device != send.device:
        raise ValueError(
            f"all_gather_uneven_into: out_flat is {out_flat.dtype} on {out_flat.device}, "
            f"send is {send.dtype} on {send.device}"
        )

    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    mine = out_flat[offsets[me] : offsets[me + 1]]
    _copy_unless_same(mine, send)
    if world == 1:
        return CompletedWork() if async_op else out_flat

    out_bytes = _bytes_if_float8(out_flat)
    if _is_gloo(out_flat, group):
        work = _gather_by_exchange(out_bytes, _bytes_if_float8(send), sizes, me, group)
        return _handle([work], out_flat, async_op)
    works = []
    for root in range(world):
        if sizes[root] == 0:
            continue
        slot = out_bytes[offsets[root] : offsets[root + 1]]
        # Issued asynchronously, in the same order on every rank.
        works.append(dist.broadcast(slot, src=dist.get_global_rank(group, root), group=group, async_op=True))
    return _handle(works, out_flat, async_op)


def _handle(works: list, out: torch.Tensor, async_op: bool):
    handle = WorkList(works)
    if async_op:
        return handle
    handle.wait()
    return out


def _is_gloo(t: torch.Tensor, group: dist.ProcessGroup) -> bool:
    return t.device.type == "cpu" and dist.get_backend(group) == "gloo"


def _gather_by_exchange(out: torch.Tensor, send: torch.Tensor, sizes: Sequence[int], me: int,
                        group: dist.ProcessGroup):
    """All-gather as one asynchronous all-to-all: this rank sends ``send`` to every group rank (itself
    included) and receives ``sizes[i]`` elements from rank i into its slot of ``out``. The copies
    of ``send`` are a new tensor, so ``send`` may be this rank's slot of ``out``."""
    world = len(sizes)
    return dist.all_to_all_single(out, send.repeat(world), output_split_sizes=list(sizes),
                                  input_split_sizes=[sizes[me]] * world, group=group, async_op=True)


# ---------------------------------------------------------------------------------------------
# Even collectives
# ---------------------------------------------------------------------------------------------


class AllReduceRoute(StrEnum):
    """How :func:`all_reduce_sum` sums a contiguous tensor on gloo. All three give the same bits;
    the choice is speed."""

    NATIVE = "native"
    """gloo's own ring."""
    EXCHANGE = "exchange"
    """one all-to-all, then the ring-order sum of each chunk locally."""
    SPLIT = "split"
    """two exchanges (large tensors at large worlds)."""


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False):
    """In-place sum all-reduce of contiguous ``t``. Returns a work handle when ``async_op``, else None.

    A strided ``t`` is refused on every group size: gloo's ring reads and writes the first numel
    elements of its memory as if they were the tensor (measured: torch 2.13, a ``[::2]`` view came
    back half summed, no error); one contract for every backend."""
    _refuse_float8(t, "all_reduce_sum")
    if not t.is_contiguous():
        raise ValueError(f"all_reduce_sum: t must be contiguous (collectives write raw memory), got strides "
                         f"{t.stride()} for shape {tuple(t.shape)}")
    world = group_size(group)
    if world == 1:
        return _done(async_op)
    route = AllReduceRoute.NATIVE
    if _on_gloo(t, group):
        route = all_reduce_route(world, t.numel(), t.element_size())
    if route == AllReduceRoute.SPLIT:
        return _split_exchange_and_sum(t.view(-1), group, async_op)
    if route == AllReduceRoute.EXCHANGE:
        return _exchange_and_sum(t.view(-1), t.view(-1).expand(world, -1), 0, t.numel(), group, async_op)
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_group(group), async_op=async_op)


def all_reduce_route(world: int, numel: int, element_size: int) -> AllReduceRoute:
    """The route :func:`all_reduce_sum` takes for ``numel`` elements of ``element_size`` bytes."""
    # Fewer elements than 2 x world stay on gloo's ring: there it was the faster of the two (the
    # bits are the same; 1 element at world 8: 0.7-0.8 ms a call against 1.2-1.4 ms, measurements.md).
    if numel < 2 * world:
        return AllReduceRoute.NATIVE
    nbytes = numel * element_size
    if world >= SPLIT_MIN_WORLD and nbytes >= SPLIT_MIN_BYTES:
        return AllReduceRoute.SPLIT
    return AllReduceRoute.EXCHANGE if nbytes <= EXCHANGE_MAX_BYTES else AllReduceRoute.NATIVE


def reduce_scatter_sum(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
):
    """Sum reduce-scatter: ``inp`` (group size x ``out`` elements) -> this rank's chunk in ``out``."""
    _refuse_float8(inp, "reduce_scatter_sum")
    world = group_size(group)
    if inp.numel() != out.numel() * world:
        raise ValueError(
            f"reduce_scatter_sum: input has {inp.numel()} elements, expected {world} x {out.numel()}"
        )
    if world == 1:
        _copy_unless_same(out, inp.view_as(out))
        return _done(async_op)
    if _on_gloo(inp, group) and out.is_contiguous():
        n = out.numel()
        start = dist.get_rank(_group(group)) * n
        return _exchange_and_sum(out.view(-1), inp.reshape(world, n), start, inp.numel(), group, async_op)
    return _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=_group(group), async_op=async_op)


# ---------------------------------------------------------------------------------------------
# Sums on gloo: one exchange, then gloo's ring order (docs/spec/platform.md s1.1)
# ---------------------------------------------------------------------------------------------

EXCHANGE_MAX_BYTES = 128 << 10
"""Largest tensor all-reduced by the exchange (every rank receives group size x these bytes); a
larger one runs gloo's ring, which moves less data per rank. The bits are the same either way.
Measured with tools/bench_collectives.py on 2 CPUs (docs/measurements.md): the exchange is 1.1-5x
faster up to 16384 fp32 elements at worlds 2, 4 and 8, 1.0-3x at 32768, and slower from 65536 at
worlds 4 and 8."""

SPLIT_MIN_WORLD = 8
SPLIT_MIN_BYTES = 64 << 10
"""From this group size and tensor size up, the all-reduce runs as two exchanges (a reduce-scatter,
then an all-gather of the sums: :func:`_split_exchange_and_sum`): every rank then sends about
twice its tensor, as on the ring, in two hops instead of the ring's 2 x (world - 1). Measured on
2 CPUs at world 8 (docs/measurements.md, nineteenth session): 3.0-3.5 ms wall and 5.4-6.8 ms CPU a
call for 16384-65536 fp32 elements, against 3.8-4.1 / 7.1-7.7 on the ring and 3.4-9.7 / 6.4-18.7
by the single exchange; at worlds 2 and 4 it was never the cheapest of the three."""

_GLOO_MAX_SEGMENT_BYTES = 1 << 20  # gloo's largest ring message


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _on_gloo(t: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether the sum of ``t`` over ``group`` may be exchanged and added here (fp32 and bf16 on
    gloo: the dtypes whose bits were checked against gloo's, tests/integration/test_gloo_sums.py)."""
    return t.dtype in (torch.float32, torch.bfloat16) and _is_gloo(t, _group(group))


def ring_chunk_sizes(numel: int, world: int, element_size: int) -> list[int]:
    """Elements in each of the ``world`` chunks of gloo's ring all-reduce of ``numel`` elements,
    in element order. Chunk ``c`` is summed along the ring so that group rank ``c`` adds last."""
    total = numel * element_size
    max_segment = element_size * max(1, _GLOO_MAX_SEGMENT_BYTES // element_size)
    segments = _ceil_div(max(_ceil_div(total, max_segment), 2 * world), world) * world
    segment = _ceil_div(_ceil_div(total, segments), element_size)  # elements: the bytes rounded up
    per_chunk = segment * (segments // world)
    return [max(0, min(numel, (c + 1) * per_chunk) - c * per_chunk) for c in range(world)]


_RING_ORDER_CACHE_MAX = 1 << 20
"""Largest ring order (world x length elements, 8 MiB) kept for reuse; larger ones (big
reduce-scatter shards) are built per call, so the cache never holds a bucket-sized index."""


def _ring_order(numel: int, world: int, element_size: int, start: int, length: int) -> torch.Tensor:
    """int64 [world, length]: row k holds, for the elements ``start + i``, the group rank whose
    value the ring adds k-th. In chunk c the partial sum starts at rank c - 1 and travels down
    the ring, each rank adding its own value to what it received: x[c-1], then x[c-2] + that,
    ..., x[c] + that."""
    if world * length <= _RING_ORDER_CACHE_MAX:
        return _cached_ring_order(numel, world, element_size, start, length)
    return _build_ring_order(numel, world, element_size, start, length)


def _build_ring_order(numel: int, world: int, element_size: int, start: int, length: int) -> torch.Tensor:
    sizes = torch.tensor(ring_chunk_sizes(numel, world, element_size))
    chunk = torch.repeat_interleave(torch.arange(world), sizes)[start : start + length]
    k = torch.arange(1, world + 1).unsqueeze(1)
    return (chunk.unsqueeze(0) - k) % world


_cached_ring_order = functools.lru_cache(maxsize=64)(_build_ring_order)


def _ring_sum_into(out: torch.Tensor, rows: torch.Tensor, start: int, numel: int) -> None:
    """``out[i]`` = the ring's sum of ``rows[:, i]`` (row r: group rank r's contribution) for the
    elements ``start + i`` of an all-reduce of ``numel`` elements.

    The contributions are first put in each element's ring order (one gather), then added row
    after row: every element sees the same additions, in the same order, as in gloo's ring.
    """
    world, length = rows.shape
    ordered = rows.gather(0, _ring_order(numel, world, rows.element_size(), start, length))
    acc = ordered[0]
    for k in range(1, world):
        acc.add_(ordered[k])  # acc + x: with two NaNs, x's payload survives, as in gloo
    if acc.dtype == torch.bfloat16:
        # gloo rounds each bf16 sum with c10's scalar conversion, which writes every NaN as
        # 0x7FC0; torch's vectorized one writes 0xFFFF
        acc.view(torch.int16).masked_fill_(torch.isnan(acc), 0x7FC0)
    out.copy_(acc)


class _SumOnWait:
    """Handle of an exchange whose sums are added when it is waited for."""

    def __init__(self, work: Any, finish):
        self.work, self.finish = work, finish

    def wait(self, timeout: Any = None) -> bool:
        self.work.wait() if timeout is None else self.work.wait(timeout)
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True

    def is_completed(self) -> bool:
        return self.finish is None


def _exchange_and_sum(out, send_rows, start: int, numel: int, group, async_op: bool):
    """Send row j of ``send_rows`` [world, L] to group rank j, receive every rank's row for this
    rank, and write their ring-order sums (elements ``start..`` of ``numel``) into ``out``."""
    world, length = send_rows.shape
    recv = empty((world, length), dtype=send_rows.dtype, device=send_rows.device)
    send = send_rows.contiguous()
    work = dist.all_to_all_single(recv, send, group=_group(group), async_op=async_op)
    handle = _SumOnWait(work if async_op else CompletedWork(), lambda: _ring_sum_into(out, recv, start, numel))
    if async_op:
        return handle
    handle.wait()
    return None


def _split_exchange_and_sum(flat: torch.Tensor, group, async_op: bool):
    """All-reduce of ``flat`` as a reduce-scatter and an all-gather, one all-to-all each
    (:func:`_chunk_exchange`). The all-gather starts when the handle is waited for."""
    handle = _chunk_exchange([flat], [], group)
    if async_op:
        return handle
    handle.wait()
    return None


def sums_coalesced(all_reduce: Sequence[torch.Tensor], reduce_scatter: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   group: dist.ProcessGroup | None = None) -> None:
    """Several sums over one group at once: every tensor of ``all_reduce`` is all-reduced in
    place, and for every ``(out, inp)`` of ``reduce_scatter`` this rank's chunk of the sum of
    ``inp`` lands in ``out``; each with the bits its own :func:`all_reduce_sum` or
    :func:`reduce_scatter_sum` gives.

    On gloo, when all of them share one float dtype, they take two exchanges in all
    (:func:`_chunk_exchange`), as a group call coalesces NCCL collectives. Elsewhere, on two
    ranks (whose ring is one exchange each way already: coalescing measured slower there), and
    for all-reduces of fewer than 2 x group size elements, one collective each."""
    world = group_size(group)
    ar = [t for t in all_reduce if 2 * world <= t.numel()]
    jobs = ar + [inp for _, inp in reduce_scatter]
    coalesce = (world > 2 and jobs and all(t.is_contiguous() and t.dtype == jobs[0].dtype for t in jobs)
                and _on_gloo(jobs[0], group) and all(o.is_contiguous() for o, _ in reduce_scatter))
    if not coalesce:
        for t in all_reduce:
            all_reduce_sum(t, group)
        for out, inp in reduce_scatter:
            reduce_scatter_sum(out, inp, group)
        return
    for t in all_reduce:
        if 2 * world > t.numel():
            all_reduce_sum(t, group)  # gloo's own ring, as all_reduce_sum does
    _chunk_exchange([t.view(-1) for t in ar], [(o.view(-1), i.view(-1)) for o, i in reduce_scatter], group).wait()


def _chunk_exchange(all_reduce: list, reduce_scatter: list, group) -> "_SumOnWait":
    """Sums by chunks, gloo's bits: group rank r sums chunk r of every tensor (its chunk of the
    ring for an all-reduce, its shard for a reduce-scatter). One all-to-all, launched here, brings
    it every rank's elements of those chunks; waiting on the handle adds each chunk in its
    collective's ring order, writes the reduce-scatter shards, and sends the all-reduced chunks to
    every rank in a second all-to-all. All tensors are flat, contiguous and of one dtype."""
    g = _group(group)
    world, me = dist.get_world_size(g), dist.get_rank(g)
    # (flat tensor, element offset of every rank's chunk, chunk lengths, where this rank's sums go)
    plans = []
    for t in all_reduce:
        sizes = ring_chunk_sizes(t.numel(), world, t.element_size())
        plans.append((t, [sum(sizes[:j]) for j in range(world)], sizes, None))
    for out, inp in reduce_scatter:
        n = out.numel()
        plans.append((inp, [j * n for j in range(world)], [n] * world, out))
    send = torch.cat([flat[off[j]:off[j] + size[j]] for j in range(world) for flat, off, size, _ in plans])
    mine = sum(size[me] for _, _, size, _ in plans)
    recv = empty((world * mine,), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, output_split_sizes=[mine] * world, group=g, async_op=True,
                                  input_split_sizes=[sum(size[j] for _, _, size, _ in plans) for j in range(world)])
    gathered_plans = plans[:len(all_reduce)]

    def finish():
        rows = recv.view(world, mine)
        sums = empty((sum(size[me] for _, _, size, _ in gathered_plans),), dtype=send.dtype, device=send.device)
        col = 0
        for flat, off, size, out in plans:
            dst = sums[col:col + size[me]] if out is None else out
            _ring_sum_into(dst, rows[:, col:col + size[me]], off[me], flat.numel())
            col += size[me]
        if not gathered_plans:
            return
        lengths = [sum(size[j] for _, _, size, _ in gathered_plans) for j in range(world)]
        if len(gathered_plans) == 1:  # its chunks, in rank order, are the tensor itself
            _gather_by_exchange(gathered_plans[0][0], sums, lengths, me, g).wait()
            return
        gathered = empty((sum(lengths),), dtype=sums.dtype, device=sums.device)
        _gather_by_exchange(gathered, sums, lengths, me, g).wait()
        pos = 0
        for j in range(world):
            for flat, off, size, _ in gathered_plans:
                flat[off[j]:off[j] + size[j]].copy_(gathered[pos:pos + size[j]])
                pos += size[j]

    return _SumOnWait(work, finish)


def all_gather_into(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
):
    """Even all-gather of ``inp`` into ``out`` (group size x ``inp`` elements, rank order)."""
    world = group_size(group)
    if out.numel() != inp.numel() * world:
        raise ValueError(f"all_gather_into: output has {out.numel()} elements, expected {world} x {inp.numel()}")
    if world == 1:
        _copy_unless_same(out, inp.view_as(out))
        return _done(async_op)
    if _is_gloo(out, _group(group)) and out.is_contiguous():
        work = _gather_by_exchange(_bytes_if_float8(out).view(-1), _bytes_if_float8(inp).reshape(-1),
                                   [inp.numel()] * world, group_rank(group), _group(group))
        if async_op:
            return work
        work.wait()
        return None
    return _all_gather_single(
        _bytes_if_float8(out), _bytes_if_float8(inp), group=_group(group), async_op=async_op
    )


def all_to_all_single(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_split_sizes: Sequence[int] | None = None,
    in_split_sizes: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
):
    """All-to-all along dim 0, with optional per-rank split sizes (rows), as ``dist.all_to_all_single``."""
    if group_size(group) == 1:
        if out.shape != inp.shape:
            raise ValueError(f"all_to_all_single: one rank: shapes differ {tuple(out.shape)} vs {tuple(inp.shape)}")
        _copy_unless_same(out, inp)
        return _done(async_op)
    return dist.all_to_all_single(
        _bytes_if_float8(out),
        _bytes_if_float8(inp),
        output_split_sizes=None if out_split_sizes is None else list(out_split_sizes),
        input_split_sizes=None if in_split_sizes is None else list(in_split_sizes),
        group=_group(group),
        async_op=async_op,
    )


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Gather a picklable object from every group rank; returns the list in group-rank order."""
    world = group_size(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=_group(group))
    return out


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Group rank ``src``'s picklable ``obj`` on every rank (the others' ``obj`` is ignored)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(_group(group), src), group=_group(group))
    return box[0]


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` has reached this call."""
    if group_size(group) > 1:
        dist.barrier(group=_group(group))
