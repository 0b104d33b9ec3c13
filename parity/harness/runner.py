"""The lockstep runner: every rank builds both stacks of a scenario and steps them together.

Per step, side B (the reference: knob OFF) runs first and its phase tensors are cloned; then side A
(the stack under test: knob ON) runs and, at the end of each of its phases, its LIVE tensors are
compared bit for bit with B's, on the device they live on. Only summaries leave the rank (plus the
mismatching tensors, or all, when snapshots ask for them).
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parity.distributed.groups import build_groups
from parity.harness import golden
from parity.harness.compare import compare_tensors
from parity.harness.faults import HARNESS_FAULTS, bump_one_ulp
from parity.harness.scenario import Scenario
from parity.harness.snapshot import tensor_sha256
from parity.model import is_layer_wise_managed
from parity.optim.stack import Stack
from parity.vocab import Fault

MAX_MESSAGES = 50
HEARTBEAT = None  # set by the parent-side wrapper: HEARTBEAT(step, phase)


def _beat(step, phase):
    if HEARTBEAT is not None:
        HEARTBEAT(step, phase)


@dataclass
class RunOptions:
    """How to run (not what: that is the scenario)."""

    injections: tuple = ()
    """Parsed --inject items."""
    snapshot: str = "divergent"
    """'none' | 'divergent' | 'all'."""
    out_dir: str | None = None
    """Where snapshots go (OUT/snapshots/<scenario>/)."""
    fail_fast: bool = False
    """Stop at the first divergent step."""
    golden_digests: bool = True
    """Return per-tensor digests of side A for golden records."""
    progress: bool = True
    """Rank 0 prints 'step k/N' lines."""


def loss_bits(loss: torch.Tensor) -> str:
    return "0x" + struct.pack(">f", float(loss)).hex()


def _first_layer_wise_matrix(stack: Stack) -> str:
    for p in stack.params:
        if is_layer_wise_managed(p) and p.dtype != torch.float32:
            return stack.names[p]
    raise RuntimeError("model has no Muon-managed matrix")


def _resolve_param(param, star, phase, live):
    """``*``: the first Muon-managed matrix, as that phase holds it (its grad, its master, its
    bf16 value or FP8 bytes); in `forward`, the loss."""
    if param != "*":
        return param
    if phase == "forward":
        return "loss"
    for cand in (star, f"{star}.master", f"{star}.fp8.rowwise_data"):
        if cand in live:
            return cand
    return star


def rank_main(ctx, scenario: Scenario, opts: RunOptions) -> dict:
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch renames of collectives
    device = torch.device(ctx.device)
    rank = dist.get_rank()
    groups = build_groups(scenario.ep)
    stack_faults = {i.name for i in opts.injections if i.kind == "fault" and i.name not in HARNESS_FAULTS}
    harness_faults = {i.name for i in opts.injections if i.kind == "fault" and i.name in HARNESS_FAULTS}
    ulps = [i for i in opts.injections if i.kind == "ulp"]
    lifecycle = [i for i in opts.injections if i.kind in ("crash", "hang")]
    cfg_a, cfg_b = scenario.stack_configs(faults=stack_faults)
    t0 = time.perf_counter()
    A = Stack(cfg_a, groups, device)
    B = Stack(cfg_b, groups, device)
    build_s = time.perf_counter() - t0
    star = _first_layer_wise_matrix(A)

    res = {"rank": rank, "steps": [], "divergences": [], "compared": 0, "compared_by_phase": {},
           "messages": [], "golden": {}, "checks": [], "buffers": A.ddp.buffer_report(),
           "persistent_bytes": {"A": A.persistent_bytes(), "B": B.persistent_bytes()},
           "ownership": A.layerwise.ownership_table(), "first_divergence": None}

    def record(step, phase, diff):
        res["compared"] += 1
        res["compared_by_phase"][phase] = res["compared_by_phase"].get(phase, 0) + 1
        if diff.equal:
            return
        d = diff.to_dict()
        d.update(step=step, phase=phase, rank=rank)
        res["divergences"].append(d)
        if len(res["messages"]) < MAX_MESSAGES:
            res["messages"].append(diff.message())

    def check(step, name, ok, msg):
        res["checks"].append({"step": step, "check": name, "ok": bool(ok), "rank": rank,
                              "message": "" if ok else msg})

    # Ownership must be one table on every rank (all-gathered and compared).
    for expert, group, size in ((False, groups.dp_group, groups.dp), (True, groups.expt_dp_group, groups.expt_dp)):
        tables = [None] * size
        dist.all_gather_object(tables, A.layerwise.ownership_table(expert), group=group)
        check(-1, "ownership-agrees", all(t == tables[0] for t in tables),
              f"ranks of the {'expert-' if expert else ''}DP group disagree on LayerWise ownership "
              f"(a param owned by 0 or 2 ranks)")
    # Every trainable param is stepped by exactly one optimizer: LayerWise (some rank owns it)
    # or DistOpt (its buffer is sharded over the DP group).
    lw_names = {n for n, _ in A.layerwise.ownership_table()}
    do_names = {A.names[p] for b in A.distopt.buffers for p in b.params}
    orphans = sorted(set(A.names.values()) - lw_names - do_names)
    twice = sorted(lw_names & do_names)
    check(-1, "optimizer-coverage", not orphans and not twice,
          f"params stepped by no optimizer: {orphans[:3]}; by two: {twice[:3]}")
    # Only owners may keep a high-precision init copy, and only until their master exists.
    kept = [A.names[p] for p in A.params if getattr(p, "hp_init", None) is not None]
    check(-1, "init-copies-dropped", not kept,
          f"{len(kept)} FP8 params still hold a high-precision init copy after optimizer "
          f"construction (first: {kept[:2]})")

    # Masters at construction, before any update: ON seeded from the high-precision init must
    # equal OFF's clone of its bf16 param (a master from the FP8 dequant fails here).
    ma = {k: v for k, v in A.optimizer_state().items() if k.endswith(".master")}
    mb = {k: v for k, v in B.optimizer_state().items() if k.endswith(".master")}
    compare_maps(-1, "init", mb, ma, rank, record, check)

    pinned_drop = None
    snaps = {}
    scan_nonfinite = [False]
    params_a = [None]
    res["nonfinite"] = []
    for step in range(scenario.steps):
        _beat(step, "start")
        for inj in lifecycle:
            if inj.rank == rank and inj.step == step:
                if inj.kind == "crash":
                    os._exit(17)
                while True:
                    time.sleep(3600)
        if opts.progress and rank == 0:
            print(f"[parity] {scenario.name}: step {step + 1}/{scenario.steps}", flush=True)
        caps_b: dict = {}
        B.step(step, lambda ph, t: caps_b.__setitem__(ph, {k: v.detach().clone() for k, v in t.items()}))
        if A.overlap and step > 0:
            check(step, "deferred-gather-armed", A.ddp.armed() and B.ddp.armed(),
                  f"step {step}: a deferred param gather was not re-armed before the forward "
                  f"(param_gather_dispatched left set: pre-hooks would not gather)")
        caps_a: dict = {}
        step_rec = {"step": step}

        def on_a(phase, live):
            nonlocal pinned_drop
            _beat(step, phase)
            for inj in ulps:
                if inj.step == step and inj.phase == phase:
                    name = _resolve_param(inj.param, star, phase, live)
                    if name not in live:
                        raise KeyError(f"--inject: no tensor {name!r} in phase {phase}")
                    bump_one_ulp(live[name])
            ref = caps_b[phase]
            cur = live
            if phase == "param_sync":
                cur, ref, pinned_drop = _param_keys(live, ref, pinned_drop, step, harness_faults, check,
                                                    cfg_a.fp8_param_gather and not cfg_b.fp8_param_gather)
            if phase == "forward":
                step_rec["loss_bits"] = loss_bits(live["loss"])
                step_rec["loss"] = repr(float(live["loss"]))
                step_rec["loss_b_bits"] = loss_bits(ref["loss"])
            if phase == "forward" and not bool(torch.isfinite(live["loss"]).all()):
                scan_nonfinite[0] = True  # from here on, say where NaN/Inf sit (cheap until then)
            if scan_nonfinite[0] and len(res["nonfinite"]) < 50:
                for k, v in live.items():
                    if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                        res["nonfinite"].append({"step": step, "phase": phase, "tensor": k, "side": "ON",
                                                 "nan": int(torch.isnan(v).sum()),
                                                 "inf": int(torch.isinf(v).sum())})
            n_before = len(res["divergences"])
            compare_maps(step, phase, ref, cur, rank, record, check)
            if opts.golden_digests:
                golden.capture_phase(res["golden"], scenario, rank, step, phase, live)
            if phase == "param_sync":
                params_a[0] = live  # the replica check hashes these: no second param_tensors()
            if opts.snapshot == "all":
                caps_a[phase] = {k: v.detach().to("cpu", copy=True) for k, v in live.items()}
            elif opts.snapshot == "divergent" and len(res["divergences"]) > n_before:
                # Copy the differing tensors now: later phases update A's tensors in place.
                bad = {_tensor_of(d["path"]) for d in res["divergences"][n_before:]}
                caps_a[phase] = {k: v.detach().to("cpu", copy=True) for k, v in live.items() if k in bad}

        A.step(step, on_a)
        if A.grad_buffer_clean is not None:
            if Fault.ZEROS_VS_ZEROS in harness_faults:
                # The regressed check: compare A's grad buffers with B's after both were zeroed.
                a0 = [b.grad_data for buf in A.ddp.all_buffers() for b in buf.buckets]
                b0 = [b.grad_data for buf in B.ddp.all_buffers() for b in buf.buckets]
                A.ddp.zero_grad_buffer(); B.ddp.zero_grad_buffer()
                trivial = all(int(torch.count_nonzero(x)) == 0 and int(torch.count_nonzero(y)) == 0
                              for x, y in zip(a0, b0))
                check(step, "grad-buffer-clean", not trivial,
                      f"step {step}: grad-buffer comparison is zeros vs zeros: it cannot fail")
            else:
                check(step, "grad-buffer-clean", A.grad_buffer_clean,
                      f"step {step}: LayerWise grad_data not zero after force_sync (gather payload left)")
        _replica_checks(step, A, params_a[0], groups, check)
        step_div = [d for d in res["divergences"] if d["step"] == step]
        step_rec["n_div"] = len(step_div)
        res["steps"].append(step_rec)
        if opts.snapshot == "all" or (opts.snapshot == "divergent" and step_div):
            snaps[step] = _snapshot_tensors(caps_a, caps_b, step_div, opts.snapshot)
        if opts.fail_fast and (step_div or any(not c["ok"] for c in res["checks"])):
            break
    res["snapshots"] = _write_snapshots(snaps, scenario, rank, opts) if snaps else []
    res["build_s"] = build_s
    return res


def _param_keys(live, ref, pinned_drop, step, harness_faults, check, expect_drop):
    """ON holds FP8 weights only as FP8 parts; OFF holds them as bf16 too. The bf16 keys ON
    drops are pinned at step 0: the set must stay the same and must not be empty when ON has
    FP8 params (an empty or shrinking set means the comparison lost coverage)."""
    cur = live
    if Fault.VACUOUS_PARAM_COMPARE in harness_faults:
        cur = {}  # every param classified as quantized: nothing left to compare
        ref = {}
    dropped = sorted(set(ref) - set(cur))
    if pinned_drop is None:
        pinned_drop = dropped
        check(step, "dropped-set", bool(dropped) == expect_drop,
              f"step {step}: {len(dropped)} param_sync keys only in OFF; expected "
              f"{'some (the bf16 copies of FP8 weights)' if expect_drop else 'none'}")
    else:
        check(step, "dropped-set-stable", dropped == pinned_drop,
              f"step {step}: param_sync keys only in OFF changed from {len(pinned_drop)} to {len(dropped)}")
    ref = {k: v for k, v in ref.items() if k in cur}
    return cur, ref, pinned_drop


def compare_maps(step, phase, ref: dict, cur: dict, rank, record, check):
    """Compare two phase captures; an empty key set is itself a failure (a check that cannot fail)."""
    keys = sorted(set(ref) | set(cur))
    check(step, f"nonempty/{phase}", len(set(ref) & set(cur)) > 0,
          f"step {step}/{phase}/rank {rank}: nothing to compare (empty key set)")
    for k in keys:
        path = f"step {step}/{phase}/{k}/rank {rank}"
        if k not in ref or k not in cur:
            check(step, f"keys/{phase}", False, f"{path}: present only in {'ON' if k in cur else 'OFF'}")
            continue
        record(step, phase, compare_tensors(ref[k], cur[k], path))


def _replica_checks(step, stack: Stack, tensors: dict, groups, check):
    """Every DP replica of every param (and every all-reduced LayerWise grad) must be identical.
    ``tensors``: this step's param_sync tensors of ``stack``."""
    dense = {k: tensor_sha256(v) for k, v in tensors.items() if not _is_expert_name(k)}
    expert = {k: tensor_sha256(v) for k, v in tensors.items() if _is_expert_name(k)}
    for p in stack.params:
        buf_cfg = stack.ddp.group_of[id(p)]
        if not buf_cfg.use_distributed_optimizer:
            (expert if _is_expert_name(stack.names[p]) else dense)[f"main_grad:{stack.names[p]}"] = tensor_sha256(p.main_grad)
    for name, table, group, size in (("dp", dense, groups.dp_group, groups.dp),
                                     ("expert-dp", expert, groups.expt_dp_group, groups.expt_dp)):
        if size == 1 or not table:
            continue
        all_tables = [None] * size
        dist.all_gather_object(all_tables, table, group=group)
        bad = sorted(k for k in table if len({t.get(k) for t in all_tables}) > 1)
        check(step, f"replicas/{name}", not bad,
              f"step {step}: {len(bad)} tensors differ across {name} replicas, first: {bad[:3]}")


def _is_expert_name(k: str) -> bool:
    return ".experts." in k


def _tensor_of(path: str) -> str:
    """'step 3/grad_reduce/layers.0.x.weight/rank 1' -> 'layers.0.x.weight'."""
    return path.split("/", 2)[2].rsplit("/rank", 1)[0]


def _snapshot_tensors(caps_a, caps_b, step_div, mode):
    out = {}
    want = {(d["phase"], _tensor_of(d["path"])) for d in step_div}
    for side, caps in (("A", caps_a), ("B", caps_b)):
        for ph, d in caps.items():
            for k, v in d.items():
                if mode == "all" or (ph, k) in want:
                    out[f"{side}/{ph}/{k}"] = v.detach().to("cpu", copy=True)
    return out


def _write_snapshots(snaps, scenario, rank, opts):
    from parity.harness.platform import platform_fingerprint
    from parity.harness.snapshot import snapshot_filename, write_snapshot

    if not opts.out_dir:
        return []
    d = os.path.join(opts.out_dir, "snapshots", scenario.name)
    os.makedirs(d, exist_ok=True)
    fp = platform_fingerprint(scenario.device, "nccl" if scenario.device == "cuda" else "gloo")
    written = []
    for step, tensors in snaps.items():
        path = os.path.join(d, snapshot_filename(step, rank))
        meta = {"scenario": scenario.name, "step": str(step), "rank": str(rank),
                "fingerprint": scenario.fingerprint(), **{f"platform.{k}": str(v) for k, v in fp.items()}}
        write_snapshot(path, tensors, meta)
        written.append(path)
    return written
