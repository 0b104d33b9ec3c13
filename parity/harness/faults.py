"""Fault injection: named stack faults (each reverts one fix, or plants a bug both sides share)
and harness-level injections.

``--inject`` accepts:
- ``ulp:STEP:PHASE:PARAM``: after PHASE of STEP, move one element of the live tensor of the stack
  under test by one ULP (PARAM as reports name it; ``*``: the first Muon-managed matrix).
- ``crash:RANK:STEP[:PHASE]`` / ``hang:RANK:STEP[:PHASE]``: that rank dies / stops answering at
  the start of that step, or, with PHASE, right after the stack under test reports that phase of
  it (mid-step: its peers are then waiting for it inside the step's collectives).
- a catalogue name (see CATALOGUE): the stack under test runs with that fix reverted; a shared
  fault (SHARED_FAULTS) goes into both stacks. The stacks record which faults took their deviation
  (parity.vocab.FaultSet); `parity run` refuses, after the run, a fault that took it nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from parity.harness.errors import UsageError
from parity.vocab import STEP_PHASES, Fault

if TYPE_CHECKING:  # parsing --inject needs no torch (bad input is answered before torch loads)
    import torch

# name -> (what the fault does, docs/spec/megatron.md s5 item)
CATALOGUE = {
    Fault.SPLIT_GRAD_BUFFERS: ("FP8 Muon grads keyed uint8: two all-reduce buffers where OFF has one", 1),
    Fault.NUMEL_ONLY_OWNERSHIP: ("ownership sorted by numel only; ties broken by rank-local insertion order", 2),
    Fault.QUANTIZED_CLASSIFIER_ALWAYS_TRUE: ("params classified as quantized by probing `dequantize`, which every "
                                             "tensor has: ON reports no bf16/fp32 param at param_sync", 3),
    Fault.SAMPLE_BEFORE_DEFERRED_GATHER: ("params sampled right after step() while the gather is still deferred", 5),
    Fault.NO_REARM_IN_FINISH_GRAD_SYNC: ("finish_grad_sync leaves param_gather_dispatched set: the next forward's "
                                         "pre-hooks do not gather", 5),
    Fault.FORCE_SYNC_STALE: ("force_sync returns without finalizing a pending LayerWise gather", 6),
    Fault.RANK0_EMPTY_SLOT: ("gather helper reads dtype/device from rank 0's (possibly empty) list", 7),
    Fault.FP32_VIA_BF16: ("native fp32 Muon params gathered through the bf16-staged path", 8),
    Fault.MIXED_BUCKET_HEAD: ("bucket staging decided by its first param instead of any param", 9),
    Fault.MASTER_FROM_FP8_DEQUANT: ("fp32 master seeded from the FP8 dequantization, not the init value", 10),
    Fault.KEEP_NONOWNED_INIT_COPY: ("non-owned params keep their high-precision init copy", 11),
    Fault.FP32_MASTER_DIRECT_TO_FP8: ("FP8 param written as Q(fp32 master) instead of Q(bf16(master))", 13),
    Fault.MERGE_ALLREDUCE_AND_REDUCE_SCATTER_BUCKETS: ("all-reduce and reduce-scatter buckets merged in one group", 14),
    Fault.GATHER_PAYLOAD_NOT_ZEROED: ("grad buffer keeps the gather payload after the copy-back", 16),
    Fault.FP8_STAGED_PAYLOAD_NOT_ZEROED: ("an FP8-staged bucket (ON's path only) keeps the gather payload after the "
                                          "requantizing copy-back: the first microbatch's FP8 wgrad overwrites it, "
                                          "so ON == OFF and only ON's own buffers show it", 16),
    Fault.STAGING_NOT_PERSISTED: ("copy-back re-derives the staging decision instead of reading the persisted one", 9),
    Fault.ROUTING_PREDICATE_MISMATCH: ("buffer routing ignores use_muon=False: a 2-D Adam param lands in a "
                                   "LayerWise buffer that no optimizer steps", 21),
    Fault.UINT8_DISTOPT_BUFFER_NEXT_TO_LAYERWISE: ("uint8 DistOpt buffer grouped by upstream's rule: LayerWise "
                                                   "buckets join the FP8 bucket's reduce-scatter group", 20),
    Fault.DISTOPT_FP8_NOT_REQUANTIZED: ("FP8 DistOpt params keep their old bytes: the gathered bf16 masters "
                                        "are never requantized into them", 22),
    Fault.GRAD_NORM_DOUBLE_COUNTS_REPLICATED: ("grad norm and zeros count every all-reduced LayerWise grad on "
                                               "every replica instead of once (its owner), on both sides: "
                                               "the clip and the zero count are wrong while ON == OFF", 23),
    Fault.GRAD_NORM_COUNTS_UNREDUCED_SHARD: ("grad norm and zeros count whole DistOpt main_grads, unreduced "
                                             "regions outside the rank's shard included, on both sides", 24),
    Fault.FORCE_SYNC_PAYLOAD_NOT_ZEROED: ("force_sync's copy-back leaves the payload in grad_data: the next step "
                                          "zeroes it first, so only the post-condition check sees it (a "
                                          "zeros-vs-zeros comparison after that zeroing passes)", 4),
    Fault.PREHOOKS_NOT_REGISTERED: ("the forward pre-hooks of one bucket group are missing: its params are "
                                    "never gathered under overlap", 5),
    Fault.WAIT_WRONG_HANDLE: ("a pre-hook waits on and copies back the gather it just launched (the next "
                              "group's) instead of its own group's", 5),
    Fault.FP8_CACHE_NOT_REFRESHED: ("a bf16 weight's first-microbatch FP8 cache is not requantized after the "
                                    "param update: the forward uses the stale FP8 weight", 16),
    Fault.PAYLOAD_IN_GRAD_DURING_ACCUMULATION: ("the deferred gather is re-armed before every microbatch: later "
                                                "microbatches gather into (and zero) the grads accumulated so "
                                                "far", 16),
    Fault.FTZ_SUBNORMAL_SCALE_INV: ("master -> FP8 write flushes a subnormal scale_inv (2^-127, a tiny "
                                    "block's) to zero, as a fast-math (FTZ) cast kernel may", 25),
    Fault.STALE_SCALE_INV: ("master -> FP8 write updates the bytes but not the scale_inv grid: "
                            "invisible until a block's pow2 scale flips", 26),
    Fault.PADDING_ONLY_SHARD: ("checkpoint save drops the DistOpt chunk of a rank whose bucket shard holds "
                               "only alignment padding", 12),
    Fault.WRAPPER_PREFIXED_NAMES: ("ON names its params as a wrapper module does (`module.` prefix): no key "
                                   "of ON's matches one of OFF's, and a comparison by key compares nothing", 27),
    Fault.OPTIMIZER_REPORTED_ONCE: ("the optimizer state is reported at the first step only: later steps' "
                                    "masters and moments leave the comparison", 28),
    Fault.RANK1_SKIPS_RANK0_SLOT: ("rank 1 skips rank 0's slot of every LayerWise gather's copy-back, on both "
                                   "sides: its replicas of rank 0's params stay stale while ON == OFF", 29),
    Fault.CHECKPOINT_DROPS_MOMENTUM: ("the checkpoint leaves out Muon's momentum, on both sides: the resumed run "
                                      "restarts it from zero while ON == OFF", 30),
    Fault.MASTER_LOSES_QKV_SPLIT: ("the fp32 master drops the fused QKV split, on both sides: Muon "
                                   "orthogonalizes q, k and v as one matrix while ON == OFF", 31),
    Fault.RESHARD_DROPS_MOVED_MOMENTUM: ("a resharded load restores Muon's momentum only where the owner "
                                         "stayed, on both sides: a new owner starts from zero", 32),
    Fault.MUON_NORMALIZE_WITHOUT_EPS: ("Newton-Schulz normalizes by the Frobenius norm without eps, on both "
                                       "sides: a never-routed expert's zero update becomes NaN while the "
                                       "loss stays finite and ON == OFF", 33),
    Fault.LAYERWISE_OVERLAP_FLAG_OFF: ("LayerWise reads overlap_param_gather off from its own config while "
                                       "DDP overlaps: its buckets get no owner lists, and the pre-hooks "
                                       "gather nothing", 18),
    Fault.MXFP8_COLUMNWISE_FROM_ROWWISE: ("an MXFP8 param's columnwise bytes are copied from its rowwise bytes "
                                          "instead of quantized along the columns: the backward GEMMs read "
                                          "wrong FP8 values", 34),
    Fault.FINAL_NORM_PAST_HOOKS: ("the final norm is run through .forward(), past its forward pre-hooks, on both "
                                  "sides: its params leave param_sync unnoticed while ON == OFF (under "
                                  "overlap it also reads them before their gather lands)", 35),
    Fault.PREHOOKS_ON_EAGER_GROUPS: ("the forward pre-hooks also hook the FP8 DistOpt groups the optimizer "
                                     "gathers right after its step: every window gathers their raw FP8 bytes "
                                     "again, over each rank's requantized ones", 36),
    Fault.SHARD_END_EXCLUDED: ("every DistOpt shard leaves out its last element, on both sides: no rank's "
                               "Adam steps it, it stays at its init while ON == OFF and the replicas agree",
                               37),
    Fault.DISTOPT_SHARDS_REVERSED: ("DistOpt numbers its shards in reverse rank order, on both sides: each "
                                    "rank steps another rank's region with its unreduced grads, and the "
                                    "all-gather sends regions nobody stepped: the params stop training "
                                    "while ON == OFF and the replicas agree", 38),
    Fault.PREHOOKS_SKIP_EXPERT_GROUPS: ("the groups the forward pre-hooks gather leave out the expert groups, "
                                        "on both sides: their params are never gathered under overlap "
                                        "(the choice of groups must not set what the gather check "
                                        "expects)", 5),
    Fault.GRAD_REDUCE_INTO_COPY: ("the LayerWise grads are all-reduced into a copy (as a collective on a "
                                  "`.contiguous()` of a strided view is), on both sides: every rank keeps "
                                  "its local grads, owners step on them, and ON == OFF while the params' "
                                  "replicas agree", 39),
    Fault.FP8_PARAMS_NOT_BUILT: ("the model is built without FP8 params although FP8 param gather is on: ON "
                                 "runs OFF's code, so every comparison passes", 40),
    Fault.EXPERT_FP8_PARAMS_NOT_BUILT: ("the expert layers are built without FP8 params (the knob reaches the dense "
                                        "layers only): ON's experts keep bf16 weights and quantize them on the "
                                        "fly as OFF's do, so every comparison passes", 48),
    Fault.GROUP_TAKES_RUN_DISTOPT_FLAG: ("bucket groups take use_distributed_optimizer from the run's DistOpt "
                                         "setting, not from their buffers', on both sides: LayerWise grads are "
                                         "reduce-scattered and owners step on partial sums while ON == OFF "
                                         "and the params' replicas agree", 41),
    Fault.EXPERT_GRADS_SCALED_BY_EXPERT_DP: ("expert grads scaled by 1/expert-DP (the group that sums them) instead "
                                             "of 1/DP, on both sides: at EP > 1 they are EP times too large, and "
                                             "every check passes", 42),
    Fault.ZERO_GRAD_SKIPS_DENSE_BUFFERS: ("the grad zeroing at the start of a step skips the dense buffers, on "
                                          "both sides: bf16 grads accumulate onto the last step's while an FP8 "
                                          "weight's first-microbatch wgrad overwrites and hides it", 43),
    Fault.SAVE_COPIES_INTO_LIVE_STATE: ("the checkpoint save assembles Adam's moments with the copy reversed, on "
                                        "both sides: it zeroes the live moments and saves zeros, so the resumed "
                                        "run equals the uninterrupted one and ON == OFF", 44),
    Fault.LOAD_REBINDS_MASTERS: ("the checkpoint load fills new LayerWise master tensors and points the stack at "
                                 "them while Muon keeps stepping the old ones, on both sides: the matrices "
                                 "stop training after the load, ON == OFF, and a resharded load saved "
                                 "again equals its checkpoint", 45),
    Fault.WGRAD_OVERWRITES_EVERY_MICROBATCH: ("an FP8 linear's fused wgrad overwrites main_grad on every "
                                              "microbatch, not on the first only, on both sides: each weight "
                                              "keeps the last microbatch's grad", 46),
    Fault.CHECKPOINT_CHUNKS_REVERSED: ("the checkpoint writes each rank's DistOpt chunk back to front and the "
                                       "load reads it so, on both sides: a load at the same DP size is "
                                       "unchanged, a resharded one scrambles the masters and moments while "
                                       "saving it again gives the checkpoint back", 47),
    Fault.EMPTY_EXPERT_SKIPS_WGRAD: ("an expert that got no tokens skips its (zero) wgrad and with it the "
                                     "grad-ready report, on both sides: under overlap its bucket group's "
                                     "reduction is never launched by the backward hooks and is reduced late "
                                     "in every step, as upstream lets it be, with the same bits", 49),
    Fault.CLIP_SKIPS_DISTOPT_GRADS: ("the clip scales the LayerWise grads only, not the DistOpt shards, on both "
                                     "sides: Adam steps with unclipped grads while the norm, the zeros and "
                                     "ON == OFF all hold", 50),
    Fault.CLIP_SCALES_UP: ("the clip scales the grads by its coefficient whether or not it is below 1, on both "
                           "sides: a step whose norm is under the limit has its grads scaled up to it", 50),
    Fault.WEIGHT_DECAY_ON_NORMS: ("Adam decays the norms' weights (1-D params) like every other param, on both "
                                  "sides, where upstream's default param groups give them weight decay 0 "
                                  "(parity's own stack did until the thirty-first session)", 51),
    Fault.MOE_PROBS_AFTER_FC2: ("a routed expert's prob scales its output after fc2 instead of its "
                                "activation before it, on both sides: fc2 quantizes unscaled rows "
                                "(parity's own stack did until the thirty-third session)", 52),
    Fault.LR_SCHEDULE_SKIPS_DISTOPT: ("the LR schedule sets the LayerWise child's lr only, on both sides: the "
                                      "DistOpt child's Adam steps at the lr it was built with", 53),
    Fault.NEXT_GATHER_NOT_PREFETCHED: ("a pre-hook waits on its group's gather but never launches the next "
                                       "group's: every gather starts when its own params are needed, and no "
                                       "gather overlaps compute (the bytes are the same)", 54),
    Fault.LAYERWISE_BF16_TRUNCATES: ("every bf16 rounding of a LayerWise master (the bf16 params' copy, the "
                                     "gather's bf16 staging, the source of an FP8 param's requantize) "
                                     "truncates instead of rounding to nearest even, on both sides: ON == OFF "
                                     "and the replicas hold", 55),
}
# Every fault is in stack code (what it trains or what it reports), of the stack under test or, for
# a shared one, of both; none edits the harness's comparison. (Two former harness faults weakened a
# check without any stack deviation, so their failures proved nothing:
# `zeros-vs-zeros` gave way to force-sync-payload-not-zeroed, which grad-buffer-clean catches, and
# `vacuous-param-compare` to quantized-classifier-always-true, which dropped-set-replaced catches.)
SHARED_FAULTS = {Fault.EMPTY_EXPERT_SKIPS_WGRAD, Fault.CLIP_SKIPS_DISTOPT_GRADS, Fault.CLIP_SCALES_UP,
                 Fault.WEIGHT_DECAY_ON_NORMS, Fault.RANK1_SKIPS_RANK0_SLOT, Fault.CHECKPOINT_DROPS_MOMENTUM,
                 Fault.MASTER_LOSES_QKV_SPLIT, Fault.RESHARD_DROPS_MOVED_MOMENTUM,
                 Fault.MUON_NORMALIZE_WITHOUT_EPS, Fault.FINAL_NORM_PAST_HOOKS, Fault.SHARD_END_EXCLUDED,
                 Fault.DISTOPT_SHARDS_REVERSED, Fault.GRAD_NORM_DOUBLE_COUNTS_REPLICATED,
                 Fault.GRAD_NORM_COUNTS_UNREDUCED_SHARD, Fault.PREHOOKS_SKIP_EXPERT_GROUPS,
                 Fault.GRAD_REDUCE_INTO_COPY, Fault.GROUP_TAKES_RUN_DISTOPT_FLAG,
                 Fault.EXPERT_GRADS_SCALED_BY_EXPERT_DP, Fault.ZERO_GRAD_SKIPS_DENSE_BUFFERS,
                 Fault.SAVE_COPIES_INTO_LIVE_STATE, Fault.LOAD_REBINDS_MASTERS,
                 Fault.WGRAD_OVERWRITES_EVERY_MICROBATCH, Fault.CHECKPOINT_CHUNKS_REVERSED,
                 Fault.MOE_PROBS_AFTER_FC2, Fault.LR_SCHEDULE_SKIPS_DISTOPT, Fault.LAYERWISE_BF16_TRUNCATES}
"""Faults in a code path both sides run, so injected into both: ON == OFF holds, and only a check
that does not compare the two (the replicas agree; a resumed run equals the uninterrupted one; a
resharded load equals what was saved; training stays finite; the run equals its golden) can see
them."""
GOLDEN_ONLY_FAULTS = {Fault.EXPERT_GRADS_SCALED_BY_EXPERT_DP,
                      Fault.WGRAD_OVERWRITES_EVERY_MICROBATCH, Fault.WEIGHT_DECAY_ON_NORMS,
                      Fault.MOE_PROBS_AFTER_FC2, Fault.LR_SCHEDULE_SKIPS_DISTOPT}
"""Shared faults that every in-run check passes: only a golden of this platform sees them (their
selftest cases expect a golden difference and nothing else)."""


@dataclass(frozen=True)
class Injection:
    kind: str  # "ulp" | "crash" | "hang" | "fault"
    step: int = -1
    phase: str = ""
    param: str = ""
    rank: int = -1
    name: Fault | None = None

    def __str__(self):
        if self.kind == "ulp":
            return f"ulp:{self.step}:{self.phase}:{self.param}"
        if self.kind in ("crash", "hang"):
            return f"{self.kind}:{self.rank}:{self.step}" + (f":{self.phase}" if self.phase else "")
        return str(self.name)


def parse_injection(spec: str) -> Injection:
    parts = spec.split(":")
    try:
        if parts[0] == "ulp":
            if len(parts) != 4:
                raise ValueError
            _, step, phase, param = parts
            _check_phase(spec, phase)
            return Injection("ulp", step=int(step), phase=phase, param=param)
        if parts[0] in ("crash", "hang"):
            if len(parts) not in (3, 4):
                raise ValueError
            phase = parts[3] if len(parts) == 4 else ""
            if phase:
                _check_phase(spec, phase)
            return Injection(parts[0], rank=int(parts[1]), step=int(parts[2]), phase=phase)
    except ValueError:
        raise UsageError(f"--inject {spec!r}: expected ulp:STEP:PHASE:PARAM, crash:RANK:STEP[:PHASE] or "
                         f"hang:RANK:STEP[:PHASE]") from None
    if spec in CATALOGUE:
        return Injection("fault", name=Fault(spec))
    raise UsageError(f"--inject {spec!r}: unknown fault; known: ulp:..., crash:..., hang:..., "
                     + ", ".join(sorted(CATALOGUE)))


def _check_phase(spec: str, phase: str) -> None:
    if phase not in STEP_PHASES:
        raise UsageError(f"--inject {spec}: unknown phase {phase!r}; allowed: {', '.join(STEP_PHASES)}")


def bump_one_ulp(t: torch.Tensor, index: int = 0) -> None:
    """Move element ``index`` of ``t`` (in place) to the next representable value away from zero."""
    import torch

    flat = t.view(-1)
    if t.dtype == torch.uint8:  # raw fp8 bytes: the next code is one ULP (skip NaN 0x7F/0xFF)
        v = int(flat[index])
        flat[index] = v + 1 if (v & 0x7F) < 0x7E else v - 1
        return
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}
    iv = flat.view(ints[t.dtype])
    iv[index] += 1
