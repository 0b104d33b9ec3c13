"""The lockstep runner: every rank builds both stacks of a scenario and steps them together.

Per step, the `ref` stack (the reference: knob OFF) runs first and its phase tensors are cloned;
then the `test` stack (the stack under test: knob ON) runs and, as it reports each phase, its LIVE
tensors are compared bit for bit with ref's, on the device they live on. Only summaries leave the
rank (plus the mismatching tensors, or all, when snapshots ask for them).

A stack reports phases as ``(step, phase, tensors, complete)``, possibly in parts. The params of
step N are reported while step N+1's forward consumes them (or by ``Stack.flush`` after the last
step), so a step is closed (its replica checks, record and snapshot) once both stacks have
reported all its phases. A phase both sides reported whole is compared and checked at once, and
then keeps only what the step's snapshot will write.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import time
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from parity.distributed.collectives import all_gather_into, all_gather_object, all_reduce_sum
from parity.distributed.groups import build_groups
from parity.ddp.buffers import AT_FINISH, BACKWARD, IN_FLIGHT, ON_DEMAND, PRE_HOOK
from parity.harness import golden
from parity.harness.compare import bit_view, compare_tensors
from parity.harness.faults import bump_one_ulp
from parity.harness.scenario import Scenario
from parity.harness.snapshot import tensor_sha256
from parity.harness.timing import PhaseClock, profile_file
from parity.model import is_expert_param, is_layer_wise_managed, is_quantized_param
from parity.optim.stack import Stack, fp8_parts
from parity.vocab import FIRED, STEP_PHASES, Check, Phase, Side

MAX_MESSAGES = 50
HEARTBEAT = None  # set by the parent-side wrapper: HEARTBEAT(step, phase)
# Snapshot files name the sides by these prefixes (read by triage and diff).
SNAPSHOT_PREFIX = {Side.TEST: "A", Side.REF: "B"}


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
    """Stop after the first step with a divergence or a failed check (its params, reported in
    the next forward, are still captured: by the flush)."""
    golden_digests: bool = True
    """Return per-tensor digests of the test stack for golden records."""
    progress: bool = True
    """Rank 0 prints 'step k/N' lines."""
    # -- checkpoint / resume (parity/harness/resume.py) --
    save_at: int | None = None
    """Checkpoint both sides to ``save_to`` after this many steps."""
    save_to: str | None = None
    """Directory of that checkpoint (written atomically)."""
    load_from: str | None = None
    """Resume both sides from this checkpoint: the run starts at the checkpoint's step."""
    reshard: bool = False
    """Allow loading a checkpoint saved at another world / ep."""
    verify_to: str | None = None
    """Right after the load, checkpoint both sides again here (the resharded-load check)."""
    digests_from: int | None = None
    """Record the sha256 of every tensor of both sides from this step on (resume comparison)."""
    profile: str | None = None
    """'cpu' or 'wall' (cProfile on that clock, OUT/profile/<scenario>/rank<r>.prof) or 'ops'
    (torch op counts, OUT/profile/<scenario>/rank<r>.ops.json), see timing.profiled; None: no
    profile."""

    def profile_path(self, scenario: str, rank: int) -> str | None:
        if self.profile is None:
            return None
        return profile_file(os.path.join(self.out_dir or ".", "profile", scenario), rank, self.profile)


@dataclass
class RankResult:
    """What one rank sends back to the parent (``report.merge_ranks`` reads ``to_dict()``)."""

    rank: int
    buffers: list
    """The test stack's DDP buffers (key, params, numel, padding, buckets)."""
    persistent_bytes: dict
    """Side -> bytes its Muon matrices persist as weights."""
    steps: list = field(default_factory=list)
    """Per closed step: loss bits of both sides, number of divergences."""
    divergences: list = field(default_factory=list)
    compared: int = 0
    compared_by_phase: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)
    golden: dict = field(default_factory=dict)
    """step -> {"records": {key: (dtype, shape, sha256)}, "loss": LossRecord}."""
    checks: list = field(default_factory=list)
    nonfinite: list = field(default_factory=list)
    first_divergence: dict | None = None
    snapshots: list = field(default_factory=list)
    build_s: float = 0.0
    timing: dict | None = None
    """step -> {"test"|"ref"|"harness": {phase or part: seconds}} (parity/harness/timing.py)."""
    memory: dict = field(default_factory=dict)
    """Peak host RSS of this rank and, on CUDA, peak device memory allocated (bytes)."""
    snapshot_io: dict = field(default_factory=dict)
    """Bytes of snapshot files this rank wrote and the writer thread's seconds writing them."""
    resume: dict | None = None
    """What loading the checkpoint did (resumed launches)."""
    checkpoint: dict | None = None
    """What saving the checkpoint did (the launch that saves)."""
    digests: dict = field(default_factory=dict)
    """step -> phase -> side -> {tensor: sha256}, from the resume step on (compared across launches)."""
    faults_fired: list = field(default_factory=list)
    """The injected catalogued faults whose deviation ran on this rank (parity.vocab.FaultSet)."""

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class _PhaseCapture:
    """One side's tensors of one (step, phase), merged from the parts the stack reported."""

    tensors: dict = field(default_factory=dict)
    complete: bool = False


@dataclass
class _StepState:
    """What a step keeps until it closes."""

    record: dict
    grad_hashes: dict = field(default_factory=dict)
    """sha256 of the test stack's all-reduced grads, taken when grad_reduce completed."""
    ref: dict = field(default_factory=dict)
    """phase -> _PhaseCapture of the ref stack (clones)."""
    test: dict = field(default_factory=dict)
    """phase -> _PhaseCapture of the test stack (live tensors, or clones when compared late)."""
    compared: dict = field(default_factory=dict)
    """phase -> keys compared so far."""
    pending: dict = field(default_factory=dict)
    """phase -> test tensors (cloned) reported before ref's phase was complete."""
    snap_test: dict = field(default_factory=dict)
    """phase -> test tensors copied for the snapshot."""
    snap_ref: dict = field(default_factory=dict)
    """phase -> ref tensors kept for the snapshot (on the CPU) once the phase was compared."""
    diverged: dict = field(default_factory=dict)
    """phase -> names of the tensors that differed (what a divergent snapshot writes)."""
    param_hashes: dict = field(default_factory=dict)
    """sha256 of the test stack's param_sync tensors, taken when that phase completed."""


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
    return LockstepRunner(ctx, scenario, opts).run().to_dict()


class LockstepRunner:
    """Both stacks of one scenario on this rank, stepped in lockstep and compared."""

    def __init__(self, ctx, scenario: Scenario, opts: RunOptions):
        self.scenario, self.opts = scenario, opts
        self.device = torch.device(ctx.device)
        self.rank = dist.get_rank()
        self.groups = build_groups(scenario.ep)
        faults = [i.name for i in opts.injections if i.kind == "fault"]
        FIRED.clear()  # what this run's stacks deviate, not an earlier run's in this process
        self.ulps = [i for i in opts.injections if i.kind == "ulp"]
        self.lifecycle = [i for i in opts.injections if i.kind in ("crash", "hang")]
        cfg_test, cfg_ref = scenario.stack_configs(faults=set(faults))
        t0 = time.perf_counter()
        self.test = Stack(cfg_test, self.groups, self.device)
        self.ref = Stack(cfg_ref, self.groups, self.device)
        build_s = time.perf_counter() - t0
        self.flushing = False
        self.test.timer, self.ref.timer = self._timer(Side.TEST), self._timer(Side.REF)
        # FP8 param gather on the test side only: ON keeps every FP8 linear's weight as FP8 bytes
        # alone, so OFF alone reports those weights in bf16; with the knob alike, nothing is dropped
        one_sided_fp8 = cfg_test.fp8_param_gather and not cfg_ref.fp8_param_gather
        self.expect_drop = sorted(self.test.names[w] for w in self.test.fp8_linears) if one_sided_fp8 else []
        # grads reduced while backward runs (either side) leave no pre-reduce capture to compare
        overlapped = self.test.ddp.config.overlap_grad_reduce or self.ref.ddp.config.overlap_grad_reduce
        self.step_phases = [ph for ph in STEP_PHASES if not (ph == Phase.GRAD_LOCAL and overlapped)]
        self.star = _first_layer_wise_matrix(self.test)
        # The elements the grad norm must count: the dense params (on every rank) and every
        # expert's (each EP rank holds its own experts).
        expert_numel = torch.tensor([sum(p.numel() for p in self.test.params if is_expert_param(p))],
                                    dtype=torch.int64, device=self.device)
        all_reduce_sum(expert_numel, self.groups.ep_group)
        self.trainable_elements = (sum(p.numel() for p in self.test.params if not is_expert_param(p))
                                   + int(expert_numel))
        # Grads each buffer is laid out to all-reduce (its own flag, docs/spec/megatron.md s2.3),
        # whatever collective the bucket group that carries them runs: a group that reduce-scatters
        # them leaves the replicas apart, and the replica check sees it.
        self.all_reduced = {self.test.names[p] for b in self.test.ddp.all_buffers()
                            if not b.config.use_distributed_optimizer for p in b.params}
        self.result = RankResult(
            rank=self.rank, buffers=self.test.ddp.buffer_report(),
            persistent_bytes={Side.TEST.value: self.test.persistent_bytes(),
                              Side.REF.value: self.ref.persistent_bytes()},
            build_s=build_s)
        self.states: dict[int, _StepState] = {}
        self.scan_nonfinite = False
        self.reduces_seen: dict = {}  # side -> each bucket group's grad_reduces read so far
        self.snapshots = _snapshot_writer(scenario, self.rank, opts)
        self.stopped = False
        self.last_beat = None
        self.clock = PhaseClock(self.device)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> RankResult:
        self._construction_checks()
        self.clock.start()
        self._compare_init()
        start, steps = 0, self.scenario.steps
        if self.opts.load_from:  # resume: both sides from a checkpoint (parity/harness/resume.py)
            # (here, not at the top: only runs that need it import torch.distributed.checkpoint)
            from parity.harness.resume import resume_pair

            start, self.result.resume = resume_pair(self.opts, self.scenario, self._stacks(), self.device)
            for side, stack in self._stacks().items():
                self._optimizer_targets_check(start, side, stack)
                self._masters_check(start, side, stack, "after the checkpoint load")
            self.clock.harness_done(start, "checkpoint")  # the load, not the first step's forward
        for step in range(start, steps):
            self._run_step(step)
            if self.opts.fail_fast and _any_rank(self.stopped, self.device):
                break  # every rank stops at the same step, or those still stepping wait on the others
        self._flush()
        if self.snapshots is not None:
            with self.clock.part(steps - 1, "snapshot"):  # the writer's last files
                self.result.snapshots = self.snapshots.close()
            self.result.snapshot_io = {"bytes": self.snapshots.bytes_written,
                                       "write_s": round(self.snapshots.write_seconds, 4)}
        self.result.timing = self.clock.to_dict()
        self.result.memory = _peak_memory(self.device)
        self.result.faults_fired = sorted(map(str, FIRED))
        return self.result

    def _stacks(self) -> dict:
        return {Side.TEST: self.test, Side.REF: self.ref}

    def _run_step(self, step: int) -> None:
        _beat(step, "start")
        if self.opts.digests_from == step:
            from parity.harness.resume import record_rng

            record_rng(self.result.digests, step, self.device)
        self._lifecycle(step, "")
        if self.opts.progress and self.rank == 0:
            print(f"[parity] {self.scenario.name}: step {step + 1}/{self.scenario.steps}", flush=True)
        self._state(step)
        self.ref.step(step, self._on_ref)
        self.test.step(step, self._on_test)
        # lr, grad norm, zeros and clip coefficient of this step, test and ref (_b)
        self.states[step].record.update(self.test.last_step_stats,
                                        **{f"{k}_b": v for k, v in self.ref.last_step_stats.items()})
        self._after_test_step(step)
        if self.opts.save_at == step + 1:
            _beat(step, "checkpoint")
            for stack in (self.ref, self.test):
                if stack.overlap:  # training makes the params current before a save
                    stack.force_param_sync()
            self._grad_buffer_check(step)  # (the next step zeroes the buffers: read it now)
            from parity.harness.resume import save_pair, saved_state_differences

            before = {side: _live_state_digests(stack) for side, stack in self._stacks().items()}
            self.result.checkpoint = save_pair(self.opts.save_to, self.scenario, self._stacks(), step + 1,
                                               self.device)
            held = saved_state_differences(self.opts.save_to, self._stacks())
            for side, stack in self._stacks().items():
                after = _live_state_digests(stack)
                moved = sorted(k for k in set(before[side]) | set(after) if before[side].get(k) != after.get(k))
                self._check(step, Check.SAVE_LEAVES_STATE, not moved,
                            f"step {step}/{side.value}/rank {self.rank}: the checkpoint save changed {len(moved)} live "
                            f"tensor(s) of the stack, first {moved[:3]}")
                n, wrong = held[side]
                self._check(step, Check.CHECKPOINT_HOLDS_STATE, not wrong,
                            f"step {step}/{side.value}/rank {self.rank}: {len(wrong)} of {n} state tensor(s) of the "
                            f"stack differ from the checkpoint's gathered view, first {wrong[:3]}", examined=n)
            self.clock.harness_done(step, "checkpoint")
        self._close_ready_steps()
        res = self.result  # (this step closes only in the next forward: not waited for)
        if self.opts.fail_fast and (res.divergences or any(not c["ok"] for c in res.checks)):
            self.stopped = True
        self.clock.harness_done(step, "checks")

    def _flush(self) -> None:
        """Both stacks report what is still open (the last step's params)."""
        self.flushing = True
        try:
            self.ref.flush(self._on_ref)
            self.test.flush(self._on_test)
        finally:
            self.flushing = False
        self._gather_checks()
        self._close_ready_steps(final=True)
        self.clock.harness_done(self.scenario.steps - 1, "checks")

    def _timer(self, side: Side):
        def mark(step, phase):
            if self.flushing and phase == Phase.FORWARD:  # a forward only the capture needs
                self.clock.harness_done(step - 1, "flush")
            else:
                self.clock.stack_reached(step, side.value, str(phase))
        return mark

    # -- phase reports ---------------------------------------------------------------------
    def _state(self, step: int) -> _StepState:
        return self.states.setdefault(step, _StepState(record={"step": step}))

    def _on_ref(self, step, phase, tensors, complete=True) -> None:
        phase = str(phase)
        self.clock.stack_reached(step, "ref", phase)
        self._take_ref(step, phase, tensors, complete)
        if complete:
            self._side_checks(step, phase, Side.REF, self.ref)
        self.clock.harness_done(step)

    def _take_ref(self, step, phase, tensors, complete) -> None:
        st = self._state(step)
        cap = st.ref.setdefault(phase, _PhaseCapture())
        cap.tensors.update({k: v.detach().clone() for k, v in tensors.items()})
        if complete:
            cap.complete = True
            pending = st.pending.pop(phase, None)
            if pending is not None:  # test reported this phase first: compare it now
                self._compare(step, phase, pending)
                if st.test.get(phase, _PhaseCapture()).complete:
                    self._complete_phase(step, phase)

    def _on_test(self, step, phase, live, complete=True) -> None:
        phase = str(phase)
        self.clock.stack_reached(step, "test", phase)
        self._take_test(step, phase, live, complete)
        if complete:
            self._side_checks(step, phase, Side.TEST, self.test)
        self.clock.harness_done(step)

    def _lifecycle(self, step, phase) -> None:
        """Crash or hang this rank where an injection says: at the start of ``step`` (no phase), or
        once the stack under test has reported ``phase`` of it (mid-step, peers inside collectives)."""
        for inj in self.lifecycle:
            if (inj.rank, inj.step, inj.phase) == (self.rank, step, phase):
                if inj.kind == "crash":
                    os._exit(17)
                while True:
                    time.sleep(3600)

    def _take_test(self, step, phase, live, complete) -> None:
        if step >= 0 and self.last_beat != (step, phase):
            self.last_beat = (step, phase)
            _beat(step, phase)
            self._lifecycle(step, phase)
        st = self._state(step)
        for inj in self.ulps:
            if inj.step == step and inj.phase == phase:
                name = _resolve_param(inj.param, self.star, phase, live)
                if name in live:
                    bump_one_ulp(live[name])
                    st.record.setdefault("ulp_applied", []).append(str(inj))
        cap = st.test.setdefault(phase, _PhaseCapture())
        if phase == Phase.FORWARD and not bool(torch.isfinite(live.get("loss", torch.zeros(1))).all()):
            self.scan_nonfinite = True  # from here on, say where NaN/Inf sit (cheap until then)
        self._scan_nonfinite(step, phase, live)
        ref = st.ref.get(phase)
        if ref is not None and ref.complete:
            cap.tensors.update(live)
            self._compare(step, phase, live)
        else:  # ref has not reported this phase yet (a test stack that reports early)
            copies = {k: v.detach().clone() for k, v in live.items()}
            cap.tensors.update(copies)
            st.pending.setdefault(phase, {}).update(copies)
        if complete:
            cap.complete = True
            if ref is not None and ref.complete:
                self._complete_phase(step, phase)

    def _compare(self, step, phase, cur: dict) -> None:
        """Compare one report of the test stack with ref's (complete) capture of that phase."""
        st = self.states[step]
        ref = st.ref[phase].tensors
        n_before = len(self.result.divergences)
        done = st.compared.setdefault(phase, set())
        for k in cur:  # in the order the stack reported them: the golden record's order too
            if k in ref and k not in done:
                done.add(k)
                self._record(step, phase, compare_tensors(ref[k], cur[k], f"step {step}/{phase}/{k}/rank {self.rank}"))
        opts = self.opts
        if opts.snapshot == "all":
            with self.clock.part(step, "snapshot"):
                st.snap_test.setdefault(phase, {}).update({k: v.detach().to("cpu", copy=True)
                                                           for k, v in cur.items()})
        elif opts.snapshot == "divergent" and len(self.result.divergences) > n_before:
            # Copy the differing tensors now: later phases update the live tensors in place.
            bad = {_tensor_of(d["path"]) for d in self.result.divergences[n_before:]}
            st.diverged.setdefault(phase, set()).update(bad)
            with self.clock.part(step, "snapshot"):
                st.snap_test.setdefault(phase, {}).update(
                    {k: v.detach().to("cpu", copy=True) for k, v in cur.items() if k in bad})

    def _another_ranks_expert(self, name: str) -> bool:
        """Whether ``name`` belongs to an expert that another EP rank holds (its ulp injection
        lands there; the rank that holds it refuses a name it lacks)."""
        m = _EXPERT_INDEX.search(name)
        if m is None or not self.scenario.moe:
            return False
        held = {int(h.group(1)) for n in self.test.names.values() if (h := _EXPERT_INDEX.search(n))}
        return int(m.group(1)) < self.scenario.model_config().num_experts and int(m.group(1)) not in held

    def _complete_phase(self, step, phase) -> None:
        """Both sides reported all of this phase: whole-set checks, hashes, golden records."""
        st = self.states[step]
        cur, ref = st.test[phase].tensors, st.ref[phase].tensors
        for inj in self.ulps:
            if inj.step == step and inj.phase == phase and str(inj) not in st.record.get("ulp_applied", []):
                name = _resolve_param(inj.param, self.star, phase, cur)
                if not self._another_ranks_expert(name):
                    raise KeyError(f"--inject: no tensor {name!r} in phase {phase}")
        self._check(step, f"{Check.NONEMPTY}/{phase}", len(st.compared.get(phase, ())) > 0,
                    f"step {step}/{phase}/rank {self.rank}: nothing to compare (empty key set)")
        one_sided = set(cur) - set(ref)
        if phase == Phase.GRAD_REDUCE:  # all-reduced grads: every replica must hold the same
            st.grad_hashes = {f"main_grad:{k}": tensor_sha256(v) for k, v in cur.items()
                              if k in self.all_reduced and self._replicated(k)}
        if phase == Phase.PARAM_SYNC:
            self._coverage_check(step, cur, ref)
            self._dropped_set_checks(step, cur, ref)  # keys only in ref: the pinned dropped set
            st.param_hashes = {k: tensor_sha256(v) for k, v in cur.items() if self._replicated(k)}
        else:
            one_sided |= set(ref) - set(cur)
        for k in sorted(one_sided):
            self._check(step, f"{Check.KEYS}/{phase}", False, f"step {step}/{phase}/{k}/rank {self.rank}: present "
                        f"only in {'ON' if k in cur else 'OFF'}")
        if not one_sided:
            self._check(step, f"{Check.KEYS}/{phase}", True, "")
        if phase == Phase.FORWARD:
            st.record["loss_bits"] = loss_bits(cur["loss"])
            st.record["loss"] = repr(float(cur["loss"]))
            st.record["loss_b_bits"] = loss_bits(ref["loss"])
        if self.opts.digests_from is not None and step >= self.opts.digests_from:
            from parity.harness.resume import record_digests

            record_digests(self.result.digests, step, phase, cur, ref)
        if self.opts.golden_digests and phase != Phase.INIT:
            with self.clock.part(step, "golden"):
                self._record_golden(step, phase, cur)
        self._release(st, step, phase)

    def _release(self, st, step, phase) -> None:
        """Keep of a compared phase only what its step's snapshot writes. The step closes a
        forward later (its params are reported as the next forward consumes them): holding every
        phase's ref clones until then held two steps of them at once."""
        ref = st.ref[phase]
        if self.snapshots is not None and step >= 0:  # (init is not snapshotted)
            keep = set(ref.tensors) if self.opts.snapshot == "all" else st.diverged.get(phase, set())
            if keep:
                with self.clock.part(step, "snapshot"):  # (a CPU rank's clones are private already)
                    st.snap_ref[phase] = {k: v.to("cpu") for k, v in ref.tensors.items() if k in keep}
        ref.tensors = {}
        st.test[phase].tensors = {}

    def _record_golden(self, step, phase, tensors) -> None:
        golden.capture_phase(self.result.golden, self.scenario, self.rank, step, phase, tensors)

    def _record(self, step, phase, diff) -> None:
        res = self.result
        res.compared += 1
        res.compared_by_phase[phase] = res.compared_by_phase.get(phase, 0) + 1
        if diff.equal:
            return
        d = diff.to_dict()
        d.update(step=step, phase=str(phase), rank=self.rank)
        res.divergences.append(d)
        if len(res.messages) < MAX_MESSAGES:
            res.messages.append(diff.message())

    def _check(self, step, name, ok, msg, examined: int | None = None) -> None:
        """Record one evaluation of a check; ``examined``: how many things it looked at (where a
        configuration can leave it none: a rank without masters), so a vacuous pass shows."""
        rec = {"step": step, "check": str(name), "ok": bool(ok), "rank": self.rank, "message": "" if ok else msg}
        if examined is not None:
            rec["examined"] = examined
        self.result.checks.append(rec)

    def _scan_nonfinite(self, step, phase, live) -> None:
        # The optimizer's state from step 0 on: a NaN there need not reach the loss (a never-routed
        # expert's master), and both sides may share it, so no comparison sees it.
        if not (self.scan_nonfinite or phase == Phase.OPTIMIZER):
            return
        floats = [(k, v) for k, v in live.items() if v.is_floating_point()]
        if not floats:
            return
        finite = torch.stack([torch.isfinite(v).all() for _, v in floats]).tolist()  # one sync on a GPU
        if all(finite):  # a non-finite value is an event: the merge makes the failed check of every rank's
            self._check(step, Check.FINITE, True, "")
        for (k, v), ok in zip(floats, finite):
            if len(self.result.nonfinite) >= 50:
                return
            if not ok:
                self.result.nonfinite.append({"step": step, "phase": str(phase), "tensor": k,
                                              "side": "ON",  # report.py's name for the test side
                                              "nan": int(torch.isnan(v).sum()), "inf": int(torch.isinf(v).sum())})

    # -- checks ----------------------------------------------------------------------------
    def _construction_checks(self) -> None:
        test, groups = self.test, self.groups
        for side, stack in self._stacks().items():
            self._optimizer_targets_check(-1, side, stack)
        # Ownership must be one table on every rank (all-gathered and compared).
        for expert, group in ((False, groups.dp_group), (True, groups.expt_dp_group)):
            tables = all_gather_object(test.layerwise.ownership_table(expert), group)
            self._check(-1, Check.OWNERSHIP_AGREES, all(t == tables[0] for t in tables),
                        f"ranks of the {'expert-' if expert else ''}DP group disagree on LayerWise "
                        f"ownership (a param owned by 0 or 2 ranks)")
        # Every trainable param is stepped by exactly one optimizer: LayerWise (some rank owns
        # it) or DistOpt (its buffer is sharded over the DP group).
        lw_names = {n for n, _ in test.layerwise.ownership_table()}
        do_names = {test.names[p] for b in test.distopt.buffers for p in b.params}
        orphans = sorted(set(test.names.values()) - lw_names - do_names)
        twice = sorted(lw_names & do_names)
        self._check(-1, Check.OPTIMIZER_COVERAGE, not orphans and not twice,
                    f"params stepped by no optimizer: {orphans[:3]}; by two: {twice[:3]}")
        # ...and every element of a DistOpt param by exactly one rank's shard piece.
        for expert, group in ((False, groups.dp_group), (True, groups.expt_dp_group)):
            numel = {test.names[p]: p.numel() for b in test.distopt.buffers if b.key.is_expert == expert
                     for p in b.params}
            if not numel:  # (the same on every rank of the group: none of them gathers)
                continue
            mine = []
            for pc in test.distopt.pieces:
                if pc.buf.key.is_expert == expert:
                    start = pc.buf.layout.index[pc.param][0]
                    mine.append((test.names[pc.param], pc.lo - start, pc.hi - start))
            pieces = [x for rank in all_gather_object(mine, group) for x in rank]
            bad = _untiled(pieces, numel)
            self._check(-1, Check.DISTOPT_SHARDS_TILE, not bad,
                        f"{len(bad)} DistOpt params whose elements the {'expert-' if expert else ''}DP "
                        f"ranks' shard pieces do not cover exactly once, first: {bad[:2]}")
        # Only owners may keep a high-precision init copy, and only until their master exists.
        kept = [test.names[p] for p in test.params if getattr(p, "hp_init", None) is not None]
        self._check(-1, Check.INIT_COPIES_DROPPED, not kept,
                    f"{len(kept)} FP8 params still hold a high-precision init copy after optimizer "
                    f"construction (first: {kept[:2]})")

    def _compare_init(self) -> None:
        """Masters at construction, before any update: the test stack's seeded from the
        high-precision init must equal ref's clone of its bf16 param (a master from the FP8
        dequant fails here)."""
        def masters(stack):
            return {k: v for k, v in stack.optimizer_state().items() if k.endswith(".master")}

        step, phase = -1, Phase.INIT
        self._on_ref(step, phase, masters(self.ref))
        self._on_test(step, phase, masters(self.test))

    def _coverage_check(self, step, cur, ref) -> None:
        """Every param each stack holds is at param_sync, by its bits or by its FP8 bytes: params
        are reported as the forward consumes them, so one the forward reaches past its module's
        hooks would leave the comparison unnoticed."""
        for side, stack, got in (("ON", self.test, cur), ("OFF", self.ref, ref)):
            missing = [n for n in stack.names.values() if n not in got and f"{n}.fp8.rowwise_data" not in got]
            self._check(step, Check.PARAM_SYNC_COVERS, not missing,
                        f"step {step}/param_sync/rank {self.rank}: {len(missing)} params {side} holds not "
                        f"reported, first: {missing[:3]}")

    def _dropped_set_checks(self, step, cur, ref) -> None:
        _check_dropped_set(cur, ref, step, self._check, self.expect_drop)

    def _after_test_step(self, step: int) -> None:
        self._grad_buffer_check(step)
        self._gather_checks()

    def _side_checks(self, step: int, phase: str, side: Side, stack: Stack) -> None:
        """Invariants of one side's own state, checked on both sides as each completes a phase:
        a shared bug leaves ON == OFF and the replicas in agreement, and only these see it.

        After the optimizer: the grad norm and the zeros counted every trainable element exactly
        once over the ranks (docs/spec/megatron.md s2.14). After the params were consumed by the
        next forward (before its optimizer step moves the masters): every param this rank holds
        a master for holds that master rounded to its dtype, i.e. the rank stepped the region
        the sync gave it (s2.8); and every grad buffer is zero before that step's backward."""
        if phase == Phase.GRAD_REDUCE:
            self._grad_reduce_check(step, side, stack)
        if phase == Phase.OPTIMIZER and stack.last_grad_stats is not None:
            counted = stack.last_grad_stats.elements
            self._check(step, Check.GRAD_NORM_COUNTS_ONCE, counted == self.trainable_elements,
                        f"step {step}/{side.value}: the grad norm counted {counted} elements over the ranks, "
                        f"the model has {self.trainable_elements}")
            if stack.last_grad_stats.clip_coef is not None:
                self._clip_check(step, side, stack)
        if phase == Phase.PARAM_SYNC and stack.capture_at_consumption and not self.flushing:
            # Reported at the end of the step's first forward, before its backward: the step's
            # zeroing and (under overlap) the pre-hooks' copy-back left every grad buffer empty,
            # or the first backward accumulates onto what is left (a bf16 grad does; an FP8
            # weight's first-microbatch wgrad overwrites and hides it).
            dirty = [i for i, b in enumerate(stack.ddp.all_buffers()) if bool(b.grad_data.any())]
            self._check(step, Check.GRADS_ZERO_BEFORE_BACKWARD, not dirty,
                        f"step {step + 1}/{side.value}/rank {self.rank}: {len(dirty)} grad buffer(s) not zero "
                        f"after the first forward, before the backward (buffers {dirty[:4]})")
        if phase == Phase.PARAM_SYNC:
            self._masters_check(step, side, stack, "after the param sync")

    def _grad_reduce_check(self, step: int, side: Side, stack: Stack) -> None:
        """Each bucket group launched exactly one grad reduction in the step, as its own record
        says: in finish_grad_sync without overlap; under overlap_grad_reduce from its backward
        hooks, except in the stack's first step, which learns how many reports to wait for and
        reduces in finish_grad_sync (docs/spec/megatron.md s1.3 step 3). A group none of whose
        params ever reports is reduced late every step, which upstream lets pass: the overlap is
        lost without any bit changing (s5 item 49)."""
        groups = stack.ddp.bucket_groups
        first = side not in self.reduces_seen
        seen = self.reduces_seen.get(side, [0] * len(groups))
        overlapped = stack.ddp.config.overlap_grad_reduce and not first
        want = [BACKWARD] if overlapped else [AT_FINISH]
        bad = [i for i, g in enumerate(groups) if g.grad_reduces[seen[i]:] != want]
        self.reduces_seen[side] = [len(g.grad_reduces) for g in groups]
        detail = ""
        if bad:
            g = groups[bad[0]]
            detail = (f"bucket group {bad[0]} ({stack.names[g.params[0]]}, ...) launched "
                      f"{g.grad_reduces[seen[bad[0]]:] or 'no reduction'}")
        self._check(step, Check.GRAD_REDUCE_LAUNCH, not bad,
                    f"step {step}/{side.value}/rank {self.rank}: {len(bad)} bucket group(s) did not launch "
                    f"exactly one reduction {'from the backward hooks' if overlapped else 'in finish_grad_sync'}; "
                    f"first: {detail}")

    def _clip_check(self, step: int, side: Side, stack: Stack) -> None:
        """With clipping on, the grads the optimizers stepped with (read after the step) have the
        norm the clip aimed at (docs/spec/megatron.md s2.14): the norm itself, bit for bit, where
        the coefficient is >= 1 (nothing scaled); coefficient x norm where it is < 1, to
        CLIP_NORM_RTOL (each scaled element and the sums round again). A clip that missed some
        grads (one optimizer's, a copy) or scaled grads it should not have is off by far more."""
        st = stack.last_grad_stats
        now = stack.stepped_grad_norm()
        coef, norm = float(st.clip_coef), float(st.norm)
        if coef < 1.0:
            ok = abs(float(now) - coef * norm) <= CLIP_NORM_RTOL * coef * norm
        else:
            ok = torch.equal(bit_view(now), bit_view(st.norm))
        self._check(step, Check.CLIP_REACHES_STEPPED_GRADS, ok,
                    f"step {step}/{side.value}: the grads the optimizers stepped with have norm {float(now)!r}; "
                    f"the clip (coefficient {coef!r} of norm {norm!r}) aimed at {min(coef, 1.0) * norm!r}")

    def _masters_check(self, step: int, side: Side, stack: Stack, when: str) -> None:
        """Every param this rank holds an fp32 master for holds that master rounded to its dtype
        (docs/spec/megatron.md s2.8): after each param sync, and after a checkpoint load."""
        pairs = list(stack.master_pairs())
        bad = [name for name, values, master in pairs
               if not torch.equal(bit_view(values), bit_view(master.to(values.dtype)))]
        self._check(step, Check.PARAMS_HOLD_MASTERS, not bad,
                    f"step {step}/{side.value}/rank {self.rank}: {len(bad)} param(s) not their master's "
                    f"rounding {when}, first {bad[:3]}", examined=len(pairs))

    def _optimizer_targets_check(self, step: int, side: Side, stack: Stack) -> None:
        """The tensors each optimizer steps (its own param lists) are the masters the stack holds
        and copies into the params, and a LayerWise master carries the fused-QKV split Muon reads
        from it, as its param does: after construction and after a checkpoint load, which may fill
        new tensors (docs/spec/megatron.md s5 items 31, 45)."""
        def stepped(opt):
            return {id(t) for g in opt.param_groups for t in g["params"]} if opt is not None else set()

        lw, do = stack.layerwise, stack.distopt
        ok = (stepped(lw.muon) == {id(m) for m in lw.masters.values()}
              and stepped(do.optimizer) == {id(pc.master) for pc in do.pieces})
        self._check(step, Check.OPTIMIZERS_STEP_MASTERS, ok,
                    f"step {step}/{side.value}/rank {self.rank}: an optimizer steps tensors other than the masters "
                    f"the stack holds (Muon: {len(stepped(lw.muon))} stepped, {len(lw.masters)} held; Adam: "
                    f"{len(stepped(do.optimizer))} stepped, {len(do.pieces)} pieces)")
        apart = [stack.names[p] for p, m in lw.masters.items()  # (no split on the param: none on its master)
                 if getattr(m, "qkv_split_shapes", None) != getattr(p, "qkv_split_shapes", None)]
        self._check(step, Check.MASTERS_CARRY_QKV_SPLIT, not apart,
                    f"step {step}/{side.value}/rank {self.rank}: {len(apart)} master(s) whose fused-QKV split "
                    f"differs from their param's, first {apart[:3]}")

    def _grad_buffer_check(self, step: int) -> None:
        """After a forced param sync (each step in the force_sync pair; before a checkpoint save):
        the LayerWise grad buffers the gather landed in hold no payload."""
        clean = self.test.grad_buffer_clean
        if clean is not None:
            self._check(step, Check.GRAD_BUFFER_CLEAN, clean,
                        f"step {step}: LayerWise grad_data (DP > 1) not zero after force_sync (gather payload left)")

    def _gather_checks(self) -> None:
        """Under overlap: in every window between two optimizer steps, each bucket group that
        has something to gather gathered exactly once before its params' first use: by the
        optimizer right after its step where it holds FP8 DistOpt params, else the way this
        stack finishes gathers (a pre-hook, or force_sync). Read from the groups' own records;
        what to expect, from the groups' buckets (Stack.gather_report)."""
        test = self.test
        self.ref.closed_windows.clear()  # the reference is not checked
        while test.closed_windows:
            w = test.closed_windows.pop(0)
            bad = []
            rows = test.gather_report(w)
            for row in rows:
                exp = [row["by"]] * row["expect"]
                if not row["used"] or row["before_first_use"] != exp or row["total"] != exp:
                    bad.append(row)
            msg = ""
            if bad:
                r = bad[0]
                use = f"before the first use of {r['first_param']}" if r["used"] else "(params never used)"
                msg = (f"step {w.step}: bucket group {r['group']} ({r['first_param']}): gathers {use}: "
                       f"{r['before_first_use'] or 'none'}, in the whole window: {r['total'] or 'none'}; "
                       f"expected exactly {r['expect']} by {r['by']} ({len(bad)} group(s) wrong)")
            self._check(w.step, Check.PARAM_GATHER_ONCE, not bad, msg)
            if w.source == PRE_HOOK:
                hooked = [r["group"] for r in rows if r["by"] == PRE_HOOK and r["expect"]]
                self._prefetch_check(w.step, test.prefetch_report(w), hooked)

    def _prefetch_check(self, step: int, rows: list[dict], hooked: list[int]) -> None:
        """The overlap the chain of pre-hooks exists for: a pre-hook that waits on its group's
        gather launches the next group's, so a group's gather must be in flight when its own
        pre-hook comes to it exactly where the group that is to launch it (the next in bucket
        order of its kind) waited earlier in the window; elsewhere (the first group the forward
        reaches, or one reached before its launcher, as with several buffers) its own pre-hook
        launches it (docs/spec/megatron.md s2.10). No value shows a lost prefetch: a gather
        launched on demand lands the same bytes, only without overlapping any compute. Each
        group the window's pre-hooks gather (``hooked``) waits exactly once."""
        waited, wrong = set(), []
        for r in rows:
            want = IN_FLIGHT if r["launcher"] in waited else ON_DEMAND
            if r["arrival"] != want:
                wrong.append((r, want))
            waited.add(r["group"])
        recorded, msg = sorted(r["group"] for r in rows), ""
        if recorded != sorted(hooked):
            msg = (f"step {step}: pre-hook waits recorded for bucket groups {recorded}, expected one for each "
                   f"group the pre-hooks gather: {sorted(hooked)}")
        elif wrong:
            r, want = wrong[0]
            msg = (f"step {step}: bucket group {r['group']} ({r['first_param']}): its pre-hook found the gather "
                   f"{r['arrival']}, expected {want} (group {r['launcher']}'s pre-hook "
                   f"{'waited before it' if want == IN_FLIGHT else 'had not run'}; {len(wrong)} of {len(rows)} "
                   f"pre-hook waits wrong): the gathers do not overlap as the chain orders them")
        self._check(step, Check.PARAM_GATHER_PREFETCHED, not msg, msg, examined=len(rows))

    def _replicated(self, name: str) -> bool:
        """Does another rank hold a replica of this tensor (its DP group has more than one rank)?
        Only those are hashed for the replica checks: a hash reads the whole tensor on the host."""
        return (self.groups.expt_dp if _is_expert_name(name) else self.groups.dp) > 1

    def _replica_checks(self, step: int, st: _StepState) -> None:
        """Every DP replica of every param (and every all-reduced LayerWise grad) must be
        identical: this step's param_sync tensors of the test stack, and its grad hashes."""
        dense, expert = {}, {}
        for k, h in list(st.param_hashes.items()) + list(st.grad_hashes.items()):
            (expert if _is_expert_name(k) else dense)[k] = h
        groups = self.groups
        for name, table, group, size in (("dp", dense, groups.dp_group, groups.dp),
                                         ("expert-dp", expert, groups.expt_dp_group, groups.expt_dp)):
            if size == 1 or not table:
                continue
            if _same_on_every_rank(_table_digest(table).to(self.device), group, size):
                bad = []
            else:  # find which tensors differ: every rank of the group takes this branch
                all_tables = all_gather_object(table, group)
                bad = sorted(k for k in table if len({t.get(k) for t in all_tables}) > 1)
            self._check(step, f"{Check.REPLICAS}/{name}", not bad,
                        f"step {step}: {len(bad)} tensors differ across {name} replicas, first: {bad[:3]}",
                        examined=len(table))

    # -- closing steps ---------------------------------------------------------------------
    def _closed(self, st: _StepState) -> bool:
        return all(ph in st.test and st.test[ph].complete and ph in st.ref and st.ref[ph].complete
                   for ph in (Phase.FORWARD, Phase.PARAM_SYNC))

    def _close_ready_steps(self, final: bool = False) -> None:
        """Close, in step order, every step whose phases both stacks have reported."""
        for step in sorted(self.states):
            st = self.states[step]
            if step < 0:
                del self.states[step]
                continue
            if not self._closed(st) and not final:
                return
            for phase in self.step_phases:  # a phase one side stopped reporting is a comparison lost
                missing = [side for side, caps in (("ON", st.test), ("OFF", st.ref))
                           if phase not in caps or not caps[phase].complete]
                self._check(step, f"{Check.REPORTED}/{phase}", not missing,
                            f"step {step}/{phase}/rank {self.rank}: not reported whole by {' and '.join(missing)}")
            self._replica_checks(step, st)
            res = self.result
            step_div = [d for d in res.divergences if d["step"] == step]
            st.record["n_div"] = len(step_div)
            st.record.pop("ulp_applied", None)
            res.steps.append(st.record)
            mode = self.opts.snapshot
            if mode == "all" or (mode == "divergent" and step_div):
                if self.snapshots is not None:
                    with self.clock.part(step, "snapshot"):
                        self.snapshots.submit(step, _snapshot_tensors(st, step_div, mode))
            del self.states[step]


def _peak_memory(device) -> dict:
    import resource

    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    if device.type == "cuda":
        out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def _table_digest(table: dict) -> torch.Tensor:
    """sha256 of a name -> hash table (names in sorted order) as 32 uint8."""
    h = hashlib.sha256()
    for k in sorted(table):
        h.update(f"{k}\0{table[k]}\0".encode())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)


def _same_on_every_rank(digest: torch.Tensor, group, size: int) -> bool:
    """Whether every rank of ``group`` holds the same ``digest``: one gather of 32 bytes a rank
    (instead of every rank's whole table, which is only gathered to name what differs)."""
    everyone = torch.empty(size * digest.numel(), dtype=torch.uint8, device=digest.device)
    all_gather_into(everyone, digest, group)
    return bool((everyone.view(size, -1) == digest).all())


def _any_rank(flag: bool, device) -> bool:
    """True on every rank when ``flag`` is true on any (a divergence can be rank-local: an expert
    lives on one EP rank only)."""
    t = torch.tensor([int(bool(flag))], device=device)
    all_reduce_sum(t)
    return bool(t.item())


def _check_dropped_set(live, ref, step, check, expect: list) -> None:
    """The param_sync keys only OFF reports, ``dropped``, against ``expect``: the bf16 names of the
    FP8 linears' weights where only ON persists FP8 params (read from the stack under test's own
    modules), else none. Checked every step, so a weight that falls back to bf16 at any step, or
    the knob reaching only part of the model, shows (a non-empty set would pass both). Each
    dropped key must also be replaced by ON's FP8 bytes of that param: a param ON merely stopped
    reporting, as a classifier that calls every tensor quantized makes it do, is a comparison
    lost, not an FP8 weight."""
    dropped = sorted(set(ref) - set(live))
    lost = [k for k in dropped if f"{k}.fp8.rowwise_data" not in live]
    check(step, Check.DROPPED_SET_REPLACED, not lost,
          f"step {step}: {len(lost)} param_sync keys only in OFF have no FP8 bytes in ON (first: {lost[:1]})",
          examined=len(dropped))
    missing, extra = sorted(set(expect) - set(dropped)), sorted(set(dropped) - set(expect))
    check(step, Check.DROPPED_SET, not missing and not extra,
          f"step {step}: {len(dropped)} param_sync keys only in OFF, {len(expect)} expected (the bf16 "
          f"copies of FP8 linear weights); ON reports in bf16: {missing[:2]}, OFF alone reports: {extra[:2]}",
          examined=len(set(expect) | set(dropped)))


CLIP_NORM_RTOL = 1e-4
"""Relative tolerance of clip-reaches-stepped-grads where the clip scaled: the recomputed norm and
coefficient x norm differ by the roundings of the scaled elements and of two fp32 reductions (at
most 1.7e-7 over 48 clipped steps, docs/measurements.md, thirty-first session); a clip that
skipped a part of the grads misses by that part's share of the squared norm times
(1 - coefficient^2) / 2 (0.2% for a tenth at coefficient 0.98)."""

_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def _live_state_digests(stack) -> dict:
    """sha256 of every param (an FP8 one by its FP8 parts) and every optimizer tensor (masters,
    moments), read from the stack directly, not through the checkpoint code: a save must leave
    them as they were."""
    live = {}
    for p in stack.params:
        name = stack.names[p]
        live.update(fp8_parts(name, p.qt) if is_quantized_param(p) else {name: p.data})
    live.update(stack.optimizer_state())
    return {k: tensor_sha256(v) for k, v in live.items()}


def _is_expert_name(k: str) -> bool:
    return ".experts." in k


def _untiled(pieces, numel: dict) -> list:
    """Params whose (name, lo, hi) pieces do not tile [0, numel) exactly: (name, what is wrong)."""
    spans = {}
    for name, lo, hi in pieces:
        spans.setdefault(name, []).append((lo, hi))
    bad = []
    for name, n in sorted(numel.items()):
        at = 0
        for lo, hi in sorted(spans.get(name, [])):
            if lo != at:
                bad.append((name, f"elements {min(at, lo)}:{max(at, lo)} " + ("missed" if lo > at else "twice")))
                break
            at = hi
        else:
            if at != n:
                bad.append((name, f"elements {at}:{n} missed"))
    return bad


def _tensor_of(path: str) -> str:
    """'step 3/grad_reduce/layers.0.x.weight/rank 1' -> 'layers.0.x.weight'."""
    return path.split("/", 2)[2].rsplit("/rank", 1)[0]


def _snapshot_tensors(st: _StepState, step_div, mode) -> dict:
    out = {}
    want = {(d["phase"], _tensor_of(d["path"])) for d in step_div}
    for side, caps in ((Side.TEST, st.snap_test), (Side.REF, st.snap_ref)):
        for ph, d in caps.items():
            for k, v in d.items():
                if mode == "all" or (str(ph), k) in want:  # private CPU copies already
                    out[f"{SNAPSHOT_PREFIX[side]}/{ph}/{k}"] = v
    return out


def _snapshot_writer(scenario, rank, opts):
    """A streaming writer of this rank's snapshot files (None when snapshots have nowhere to go):
    each closed step is written as soon as it closes, so host memory holds about one step."""
    from parity.harness.platform import platform_fingerprint
    from parity.harness.snapshot import StreamingSnapshotWriter

    if not opts.out_dir or opts.snapshot == "none":
        return None
    fp = platform_fingerprint(scenario.device, "nccl" if scenario.device == "cuda" else "gloo")
    meta = {"scenario": scenario.name, "fingerprint": scenario.fingerprint(),
            **{f"platform.{k}": str(v) for k, v in fp.items()}}
    return StreamingSnapshotWriter(os.path.join(opts.out_dir, "snapshots", scenario.name), rank, meta)
