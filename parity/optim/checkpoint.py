"""A stack's training state <-> torch.distributed.checkpoint (DCP), keyed so that another DP size
can load it.

What one stack saves (keys relative to the side's prefix):

| key | tensor | written by |
|---|---|---|
| ``model/<name>`` | bf16 / fp32 param (DistOpt params: views of the flat param buffer) | every replica (DCP keeps one) |
| ``model/<name>.fp8.<part>`` | ON's persisted FP8 weight: raw bytes and scales, as stored | every replica |
| ``layerwise/<name>.owner`` | LayerWise owner (rank in its DP / expert-DP group), 0-dim | every rank of the group |
| ``layerwise/<name>.master`` | fp32 master of a whole matrix (not for native fp32 params: the param is it) | its owner only |
| ``layerwise/<name>.momentum_buffer`` | Muon momentum | its owner only |
| ``distopt/<dtype>-<dense>/bucket<i>/<state>`` | DistOpt state (master, exp_avg, exp_avg_sq) of one bucket, flat | each rank its own shard (ShardedTensor) |
| ``distopt/adam_step`` | Adam's step count, 0-dim | every rank holding a shard piece |

FP8 weights: the persisted bytes and scales are saved and restored as they are. In ON they are the
only copy of the weight on every rank (the param has no bf16 storage, and a non-owner has no master
to re-derive them from without a gather), and they are what the next forward reads: the first
iteration of a (resumed) run gathers nothing (docs/spec/megatron.md s1.3). Re-deriving
them at load time would run the quantizer and the gather, the code under test, inside the restore.
The masters are saved too, since the next update starts from them. That the bytes equal
``Q(bf16(master))`` is what ON == OFF checks at every param_sync.

DistOpt state is saved per bucket as one flat tensor over the bucket's params *and* the
64-element alignment gaps between them (the tail padding that makes the bucket divisible by the DP
size is cut off). Each rank writes the part of its shard that falls inside, as a ShardedTensor
chunk. Param offsets inside a bucket do not depend on the DP size (bucket starts are multiples of
lcm(dp, 128), so 64-aligned), and so the flat tensor is the same at every DP size and DCP can
reshard it. A rank whose shard holds only alignment padding still writes its (zero) chunk. Without
that chunk the tensor is not fully covered and DCP refuses the save (docs/spec/megatron.md s5 item
12; the fault ``padding-only-shard`` drops it).

Writes are atomic (:mod:`parity.atomic`). DCP writes into a hidden staging directory beside the
path. Rank 0 then writes the marker file (sizes and sha256 of every file) and swaps the directory
into place. A directory without the marker is never loaded. A failed or interrupted save leaves
the previous checkpoint loadable at its path (mid-swap, from its backup; the next save puts it
back or replaces it), and the next save removes what a dead writer left.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from parity import atomic
from parity.distributed.collectives import all_gather_object, barrier, broadcast_object
from parity.distributed.determinism import empty
from parity.model import is_quantized_param
from parity.vocab import Fault

FORMAT = "parity-checkpoint/1"
MARKER = "parity-checkpoint.json"
FP8_PARTS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


class CheckpointError(Exception):
    """A checkpoint cannot be written, or is missing, incomplete, corrupt or of another run."""


def _sharded_tensor_api():
    # DCP's sharded-tensor type for arbitrary (non-DTensor) chunk layouts, the one Megatron's
    # torch_dist format uses; torch marks it deprecated in favour of DTensor, which cannot express
    # DistOpt's shard boundaries.
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    return ShardMetadata, Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties


# -- model -----------------------------------------------------------------------------------
def _model_state(stack, prefix: str) -> dict:
    out = {}
    for p in stack.params:
        name = stack.names[p]
        if is_quantized_param(p):
            if p.qt.columnwise_stale:
                raise CheckpointError(f"{name}: FP8 columnwise copy is stale (saved mid-gather)")
            for part in FP8_PARTS:
                t = getattr(p.qt, part)
                if t is not None:
                    out[f"{prefix}model/{name}.fp8.{part}"] = t
        else:
            out[f"{prefix}model/{name}"] = p.data
    return out


# -- LayerWise -------------------------------------------------------------------------------
def _owners(lw) -> dict:
    """param -> owner (rank in its DP or expert-DP group), for the groups this rank is in."""
    return {p: r for lists in (lw.dense_lists, lw.expert_lists) for r, lst in enumerate(lists) for p in lst}


def _layerwise_state(stack, prefix: str) -> dict:
    lw, out = stack.layerwise, {}
    for p, r in _owners(lw).items():
        out[f"{prefix}layerwise/{stack.names[p]}.owner"] = torch.tensor(r, dtype=torch.int64)
    for p, m in lw.masters.items():
        name = stack.names[p]
        if m is not p:
            out[f"{prefix}layerwise/{name}.master"] = m
        for k, v in (lw.muon.state.get(m, {}) if lw.muon else {}).items():
            if k == "momentum_buffer" and Fault.CHECKPOINT_DROPS_MOMENTUM in stack.cfg.faults:
                continue  # a resumed Muon starts from zero momentum
            if torch.is_tensor(v):
                out[f"{prefix}layerwise/{name}.{k}"] = v
    return out


# -- DistOpt ---------------------------------------------------------------------------------
def _buffer_tag(buf) -> str:
    if buf.key.is_expert:  # no sibling param is expert-parallel in this model
        raise CheckpointError("checkpointing an expert-parallel DistOpt buffer is not modelled")
    return f"{str(buf.key.param_dtype).replace('torch.', '')}-dense"


def _bucket_extent(buf, b) -> int:
    """Length of the saved flat tensor: up to the end of the bucket's last param (gaps between
    params included, the DP-dependent tail padding not)."""
    return max(buf.layout.index[p][1] for p in b.params) - b.start


def _bucket_pieces(stack, buf, b) -> list:
    return [pc for pc in stack.distopt.pieces if pc.buf is buf and b.start <= pc.lo < b.end]


def _piece_state(stack, pc, key: str) -> torch.Tensor:
    if key == "master":
        return pc.master
    return stack.distopt.optimizer.state[pc.master][key]


def _my_chunk(buf, b, extent: int) -> tuple[int, int]:
    """[lo, hi) of this rank's shard of bucket ``b`` inside the saved flat tensor (lo == hi: the
    shard is all tail padding)."""
    shard = b.numel // buf.dp
    r = dist.get_rank(buf.group) if buf.dp > 1 else 0
    lo, hi = r * shard, min((r + 1) * shard, extent)
    return lo, max(lo, hi)


def _distopt_buckets(stack):
    """(buffer tag, bucket index, buffer, bucket, extent, lo, hi) of every DistOpt bucket that
    holds params, with this rank's chunk [lo, hi) of it (:func:`_my_chunk`)."""
    for buf in stack.distopt.buffers:
        for bi, b in enumerate(buf.buckets):
            if b.params:
                extent = _bucket_extent(buf, b)
                yield (_buffer_tag(buf), bi, buf, b, extent, *_my_chunk(buf, b, extent))


def distopt_piece_places(stack, prefix: str = "") -> list[tuple[str, int, object]]:
    """(key prefix of its bucket's saved tensors, offset in them, piece) of every DistOpt piece
    this rank holds: where a checkpoint of ``stack`` keeps each piece's state."""
    return [(f"{prefix}distopt/{tag}/bucket{bi}/", pc.lo - b.start, pc)
            for tag, bi, buf, b, _extent, _lo, _hi in _distopt_buckets(stack)
            for pc in _bucket_pieces(stack, buf, b)]


def _sharded(local: torch.Tensor | None, lo: int, buf, b, extent: int):
    """A flat ShardedTensor of ``extent`` elements split like bucket ``b``'s DP shards; this rank
    holds ``local`` at offset ``lo`` (None: no chunk here)."""
    ShardMetadata, Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties = _sharded_tensor_api()
    shard = b.numel // buf.dp
    device, me = buf.grad_data.device, dist.get_rank()

    def where(r):  # placements name global ranks; only this rank's device is known (and checked)
        g = dist.get_global_rank(buf.group, r) if buf.dp > 1 else me
        return f"rank:{g}/{device if g == me else device.type}"

    metas = [ShardMetadata([r * shard], [min((r + 1) * shard, extent) - r * shard], where(r))
             for r in range(buf.dp) if r * shard < extent]
    md = ShardedTensorMetadata(metas, torch.Size([extent]), TensorProperties(dtype=torch.float32))
    mine = dist.get_rank(buf.group) if buf.dp > 1 else 0
    shards = [] if local is None else [Shard(local, ShardMetadata([lo], [local.numel()], where(mine)))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, md, process_group=buf.group)


def _state_keys(stack) -> list[str]:
    """The DistOpt state tensors every rank saves, agreed over the DP group: a rank that holds no
    piece cannot see which keys Adam has created."""
    do = stack.distopt
    mine = {"master"}
    if do.optimizer is not None:
        for pc in do.pieces:
            mine |= {k for k, v in do.optimizer.state.get(pc.master, {}).items() if torch.is_tensor(v)}
    groups = {id(buf.group): buf for buf in do.buffers if buf.dp > 1}
    for buf in groups.values():
        mine = set().union(*map(set, all_gather_object(sorted(mine), buf.group)))
    return sorted(mine)


def _distopt_state(stack, prefix: str) -> dict:
    do, out = stack.distopt, {}
    keys = _state_keys(stack)
    for tag, bi, buf, b, extent, lo, hi in _distopt_buckets(stack):
        if lo == hi:
            continue  # a shard of tail padding lies outside the saved tensor
        pieces = _bucket_pieces(stack, buf, b)
        if not pieces and Fault.PADDING_ONLY_SHARD in stack.cfg.faults:
            continue  # the padding-only chunk is built but never written back
        for key in keys:
            chunk = torch.zeros(hi - lo, dtype=torch.float32, device=buf.grad_data.device)
            for pc in pieces:
                s = pc.lo - b.start - lo
                if key != "master" and Fault.SAVE_COPIES_INTO_LIVE_STATE in stack.cfg.faults:
                    _piece_state(stack, pc, key).copy_(chunk[s:s + (pc.hi - pc.lo)])  # the copy reversed
                    continue
                chunk[s:s + (pc.hi - pc.lo)].copy_(_piece_state(stack, pc, key))
            if Fault.CHECKPOINT_CHUNKS_REVERSED in stack.cfg.faults:
                chunk = chunk.flip(0)  # written back to front (the load reads it so: no change at one DP size)
            out[f"{prefix}distopt/{tag}/bucket{bi}/{key}"] = _sharded(chunk, lo, buf, b, extent)
    steps = {do.optimizer.state[pc.master]["step"] for pc in do.pieces
             if do.optimizer is not None and "step" in do.optimizer.state.get(pc.master, {})}
    if len(steps) > 1:
        raise CheckpointError(f"DistOpt pieces disagree on Adam's step count: {sorted(steps)}")
    if steps:
        out[f"{prefix}distopt/adam_step"] = torch.tensor(steps.pop(), dtype=torch.int64)
    return out


def stack_state(stack, prefix: str = "") -> dict:
    """Everything a resumed run of ``stack`` needs, as a flat DCP state dict of LIVE tensors
    (DistOpt chunks are copies: a bucket's shard is assembled from its pieces)."""
    out = _model_state(stack, prefix)
    out.update(_layerwise_state(stack, prefix))
    out.update(_distopt_state(stack, prefix))
    return out


# -- load ------------------------------------------------------------------------------------
def _need(saved: Mapping, key: str, like: torch.Tensor) -> None:
    md = saved.get(key)
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint has no tensor {key!r}: it was written by another model or config")
    if tuple(md.size) != tuple(like.shape) or md.properties.dtype != like.dtype:
        raise CheckpointError(f"checkpoint tensor {key!r} is {md.properties.dtype} {tuple(md.size)}; this "
                              f"stack holds {like.dtype} {tuple(like.shape)}")


def load_targets(stack, saved: Mapping[str, object], prefix: str = ""):
    """(state dict to hand to DCP's load, finish) for ``stack``. The dict holds the stack's LIVE
    tensors where they can be loaded in place. ``finish()`` runs after the load: it writes the
    DistOpt chunks into the shard pieces, creates optimizer state as training had it, and returns
    what moved (LayerWise params whose owner changed)."""
    tgt: dict = {}
    for key, t in _model_state(stack, prefix).items():
        _need(saved, key, t)
        tgt[key] = t

    lw = stack.layerwise
    owners = {}
    for p, r in _owners(lw).items():
        key = f"{prefix}layerwise/{stack.names[p]}.owner"
        owners[p] = (r, torch.zeros((), dtype=torch.int64))
        _need(saved, key, owners[p][1])
        tgt[key] = owners[p][1]
    muon_state, rebound = {}, {}
    for p, m in lw.masters.items():
        name = stack.names[p]
        if m is not p:
            _need(saved, f"{prefix}layerwise/{name}.master", m)
            if Fault.LOAD_REBINDS_MASTERS in stack.cfg.faults:
                m = rebound[p] = torch.empty_like(m)  # loaded into a new tensor the optimizer never sees
            tgt[f"{prefix}layerwise/{name}.master"] = m
        head = f"{prefix}layerwise/{name}."
        for key in saved:
            k = key[len(head):] if key.startswith(head) else None
            if k and k not in ("master", "owner"):
                v = torch.zeros_like(m)
                _need(saved, key, v)
                tgt[key] = muon_state[(p, k)] = v

    do = stack.distopt
    chunks = []
    for tag, bi, buf, b, extent, lo, hi in _distopt_buckets(stack):
        head = f"{prefix}distopt/{tag}/bucket{bi}/"
        keys = sorted(k for k in saved if k.startswith(head))
        if "master" not in {k[len(head):] for k in keys}:
            raise CheckpointError(f"checkpoint has no DistOpt state {head}master: written by another config")
        for key in keys:
            if tuple(saved[key].size) != (extent,):
                raise CheckpointError(f"checkpoint tensor {key!r} has {tuple(saved[key].size)} elements; "
                                      f"this layout's bucket holds {extent}: written with another bucket layout")
            local = torch.zeros(hi - lo, dtype=torch.float32, device=buf.grad_data.device) if hi > lo else None
            tgt[key] = _sharded(local, lo, buf, b, extent)
            if local is not None:
                chunks.append((buf, b, lo, key[len(head):], local))
    step_key = f"{prefix}distopt/adam_step"
    adam_step = torch.zeros((), dtype=torch.int64)
    if do.pieces and step_key in saved:
        tgt[step_key] = adam_step

    def finish() -> dict:
        for p, m in rebound.items():  # the stack's references move to the new tensors; Muon's do not
            lw.masters[p] = p.main_param = m
        moved = {p for p, (r, saved_r) in owners.items() if int(saved_r) != r}
        for (p, k), v in muon_state.items():
            if p in moved and Fault.RESHARD_DROPS_MOVED_MOMENTUM in stack.cfg.faults:
                continue  # restored only where the owner stayed: a new owner's Muon starts from zero
            lw.muon.state[lw.masters[p]][k] = v
        for buf, b, lo, key, local in chunks:
            for pc in _bucket_pieces(stack, buf, b):
                s = pc.lo - b.start - lo
                src = local[s:s + (pc.hi - pc.lo)]
                if Fault.CHECKPOINT_CHUNKS_REVERSED in stack.cfg.faults:
                    src = local.flip(0)[s:s + (pc.hi - pc.lo)]
                if key == "master":
                    pc.master.copy_(src)
                    continue
                st = do.optimizer.state[pc.master]
                st.setdefault(key, torch.zeros_like(pc.master)).copy_(src)
                st["step"] = int(adam_step)
        return {"owners_moved": sorted(stack.names[p] for p in moved), "owned": len(owners)}

    return tgt, finish


# -- RNG -------------------------------------------------------------------------------------
def rng_state(device) -> dict:
    """This process's generators: torch CPU, the rank's CUDA device, Python's ``random``."""
    version, internal, gauss = random.getstate()
    out = {"torch": torch.get_rng_state(),
           "python": torch.tensor([version, *internal], dtype=torch.int64),
           "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64)}
    if torch.device(device).type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: Mapping[str, torch.Tensor], device) -> None:
    torch.set_rng_state(state["torch"])
    py = [int(x) for x in state["python"].tolist()]
    gauss = float(state["python_gauss"][0])
    random.setstate((py[0], tuple(py[1:]), None if gauss != gauss else gauss))
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# -- files -----------------------------------------------------------------------------------
def _file_entry(path: str) -> list:
    """[size, sha256] of one file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return [os.path.getsize(path), h.hexdigest()]


def _write_marker(root: str, manifest: dict) -> None:
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
    atomic.replace_file(os.path.join(root, MARKER), write)


def locate(path: str) -> str:
    """The directory holding the checkpoint saved at ``path``: itself, or, while a save that was
    cut short between its two renames has not been followed by another, the previous checkpoint's
    backup. ``path`` itself when neither exists (the caller's error names it)."""
    found = atomic.resolve(Path(path), MARKER)
    return str(found) if found is not None else path


def save(path: str, state: dict, manifest: dict) -> dict:
    """Collective: write ``state`` (every rank's part) as a DCP checkpoint at ``path``, atomically.
    Returns {"seconds", "bytes", "files", "write_s" (DCP), "marker_s" (hashing + rename)}."""
    path = os.path.abspath(path)
    rank = dist.get_rank()
    t0 = time.perf_counter()
    tmp = None
    if rank == 0:
        try:
            tmp = str(atomic.staging_dir(Path(path), MARKER))
        except OSError as e:
            tmp = OSError(f"cannot create a checkpoint next to {path}: {e.strerror or e}")
    tmp = broadcast_object(tmp)
    if isinstance(tmp, Exception):
        raise CheckpointError(str(tmp))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dcp.save(state, storage_writer=FileSystemWriter(tmp))
        t_written = time.perf_counter()
    except (Exception, CheckpointException) as e:  # (DCP's exception derives from BaseException)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        # DCP raises on every rank; none may raise (and get the run torn down) before the partial
        # directory is gone.
        try:
            barrier()
        except Exception:
            pass
        raise CheckpointError(f"checkpoint save failed: {_dcp_reason(e)}") from None
    outcome = None
    if rank == 0:
        try:
            files = {n: _file_entry(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
            _write_marker(tmp, {**manifest, "format": FORMAT, "files": files})
            atomic.publish_dir(Path(tmp), Path(path))
            outcome = {"bytes": sum(s for s, _ in files.values()), "files": len(files),
                       "write_s": t_written - t0, "marker_s": time.perf_counter() - t_written}
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = f"cannot finish the checkpoint at {path}: {e.strerror or e}"
    outcome = broadcast_object(outcome)
    if isinstance(outcome, str):
        raise CheckpointError(outcome)
    return {**outcome, "seconds": time.perf_counter() - t0}


def _dcp_reason(e: BaseException) -> str:
    """One line from DCP's exception, which carries the failing ranks' tracebacks: their last
    line says what went wrong (for a plan that does not cover a tensor, the first such key: torch
    2.13 names it, 2.11 does not)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    last = lines[-1] if lines else type(e).__name__
    if last.startswith("ValueError: Failed to validate global plan"):
        return last.split("; key:")[0][len("ValueError: "):] + " (and more)" * ("; key:" in last)
    return last[:500]


def read_manifest(path: str, verify_files: bool = True) -> dict:
    """The marker of a finished checkpoint; with ``verify_files`` every listed file is checked
    for presence, size and sha256 (a partial, truncated or corrupt checkpoint is refused)."""
    path = locate(path)
    marker = os.path.join(path, MARKER)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r} (not a directory)")
    if not os.path.exists(marker):
        raise CheckpointError(f"{path!r} is not a finished checkpoint: no {MARKER} marker (an interrupted "
                              f"or partial save); refusing to load it")
    try:
        with open(marker) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{marker!r}: unreadable marker ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or \
            not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{marker!r}: not a {FORMAT} marker")
    if verify_files:
        for name, (size, sha) in manifest["files"].items():
            file = os.path.join(path, name)
            got = _file_entry(file) if os.path.basename(name) == name and os.path.isfile(file) else None
            if got is None:
                raise CheckpointError(f"checkpoint {path!r} is incomplete: file {name} is missing")
            if got[0] != size:
                raise CheckpointError(f"checkpoint {path!r} is truncated or altered: {name} has {got[0]} "
                                      f"bytes, the marker says {size}")
            if got[1] != sha:
                raise CheckpointError(f"checkpoint {path!r} is corrupt: {name} does not match its sha256 "
                                      f"in the marker")
    return manifest


def saved_entries(path: str) -> dict:
    """key -> DCP storage metadata of every entry in the checkpoint."""
    path = locate(path)
    try:
        return dict(FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path!r}: unreadable DCP metadata ({type(e).__name__})") from None


def load(path: str, targets: dict) -> float:
    """Collective: fill ``targets`` from the checkpoint at ``path``; returns the seconds it took."""
    path = locate(path)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dcp.load(targets, storage_reader=FileSystemReader(path))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"checkpoint load from {path!r} failed: {_dcp_reason(e)}") from None
    return time.perf_counter() - t0


def read_full(path: str, keys=None) -> dict:
    """Every tensor of the checkpoint (or ``keys``), whole, in this process (no process group):
    the gathered view used to check a resharded load."""
    path = locate(path)
    entries = saved_entries(path)
    out = {k: empty(tuple(md.size), dtype=md.properties.dtype, device="cpu") for k, md in entries.items()
           if isinstance(md, TensorStorageMetadata) and (keys is None or k in keys)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading in a single process" is the intent
        dcp.load(out, storage_reader=FileSystemReader(path), no_dist=True)
    return out
