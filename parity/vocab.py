"""The project's one vocabulary: recipes, layouts, phases, sides, checks and faults.

Every layer imports these names from here (this module imports nothing from parity), so a typo in
a recipe, phase or fault name is an error at the point where the string enters, not a silent no-op.
The descriptions of the faults live with the catalogue in ``parity.harness.faults``.
"""

from __future__ import annotations

from enum import StrEnum


class Recipe(StrEnum):
    """FP8 recipes the LayerWise FP8 param gather supports."""

    BLOCKWISE = "blockwise"  # 1x128 activations/grads, 128x128 weights, fp32 pow2 scales (Hopper)
    MXFP8 = "mxfp8"          # 1x32 blocks, E8M0 scales (Blackwell)


class Layout(StrEnum):
    """Param layouts of LayerWise buffers."""

    COMPACT = "compact"  # decoupled: params packed without padding (the only layout with FP8 gather)
    PADDED = "padded"    # shard-aligned, DistOpt-style


class Phase(StrEnum):
    """Points in one training step at which the two sides are compared, in dataflow order."""

    INIT = "init"                # fp32 masters right after construction (step -1)
    FORWARD = "forward"          # loss and logits
    GRAD_LOCAL = "grad_local"    # main_grad before the reduce collective
    GRAD_REDUCE = "grad_reduce"  # main_grad after all-reduce / reduce-scatter
    OPTIMIZER = "optimizer"      # masters and optimizer state after the update
    PARAM_SYNC = "param_sync"    # params (bf16, fp32, FP8 bytes and scales) after the gather


STEP_PHASES: tuple[Phase, ...] = (Phase.FORWARD, Phase.GRAD_LOCAL, Phase.GRAD_REDUCE,
                                  Phase.OPTIMIZER, Phase.PARAM_SYNC)
"""The phases of every step (``INIT`` happens once, before step 0)."""


class Side(StrEnum):
    """The two stacks of a lockstep pair."""

    TEST = "test"  # the stack under test (the knob ON); faults apply here only, shared ones to both
    REF = "ref"    # the reference (the knob OFF)


class Check(StrEnum):
    """The harness's checks of the stacks' own state, as report.json names them. A family's checks
    carry what they looked at after a slash (``nonempty/forward``, ``replicas/expert-dp``)."""

    NONEMPTY = "nonempty"                  # /<phase>: something was compared (resume: across launches)
    KEYS = "keys"                          # /<phase>: both sides report the same tensors
    REPORTED = "reported"                  # /<phase>: both sides reported the phase whole
    REPLICAS = "replicas"                  # /<group>: the ranks of a group hold the same params
    DROPPED_SET = "dropped-set"            # the keys only OFF reports are the FP8 linears' weights
    DROPPED_SET_REPLACED = "dropped-set-replaced"  # ... and ON reports their FP8 bytes instead
    OWNERSHIP_AGREES = "ownership-agrees"
    OPTIMIZER_COVERAGE = "optimizer-coverage"
    DISTOPT_SHARDS_TILE = "distopt-shards-tile"
    INIT_COPIES_DROPPED = "init-copies-dropped"
    PARAM_SYNC_COVERS = "param-sync-covers"
    GRAD_NORM_COUNTS_ONCE = "grad-norm-counts-once"
    GRADS_ZERO_BEFORE_BACKWARD = "grads-zero-before-backward"
    GRAD_REDUCE_LAUNCH = "grad-reduce-launch"
    CLIP_REACHES_STEPPED_GRADS = "clip-reaches-stepped-grads"
    PARAMS_HOLD_MASTERS = "params-hold-masters"
    OPTIMIZERS_STEP_MASTERS = "optimizers-step-masters"
    MASTERS_CARRY_QKV_SPLIT = "masters-carry-qkv-split"
    GRAD_BUFFER_CLEAN = "grad-buffer-clean"
    PARAM_GATHER_ONCE = "param-gather-once"
    PARAM_GATHER_PREFETCHED = "param-gather-prefetched"  # each pre-hook launched the next group's gather
    SAVE_LEAVES_STATE = "save-leaves-state"
    CHECKPOINT_HOLDS_STATE = "checkpoint-holds-state"
    FINITE = "finite"                      # no NaN or Inf in training (the merged scan)

    @staticmethod
    def family(name: str) -> "Check":
        """The check a recorded name belongs to (``keys/forward`` -> KEYS)."""
        return Check(name.split("/", 1)[0])


class Fault(StrEnum):
    """Catalogued faults: each reverts one fix of the stack, or (a shared fault) plants a bug in a code
    path both sides run (parity.harness.faults)."""

    SPLIT_GRAD_BUFFERS = "split-grad-buffers"
    NUMEL_ONLY_OWNERSHIP = "numel-only-ownership"
    QUANTIZED_CLASSIFIER_ALWAYS_TRUE = "quantized-classifier-always-true"
    SAMPLE_BEFORE_DEFERRED_GATHER = "sample-before-deferred-gather"
    NO_REARM_IN_FINISH_GRAD_SYNC = "no-rearm-in-finish-grad-sync"
    FORCE_SYNC_STALE = "force-sync-stale"
    RANK0_EMPTY_SLOT = "rank0-empty-slot"
    FP32_VIA_BF16 = "fp32-via-bf16"
    MIXED_BUCKET_HEAD = "mixed-bucket-head"
    MASTER_FROM_FP8_DEQUANT = "master-from-fp8-dequant"
    KEEP_NONOWNED_INIT_COPY = "keep-nonowned-init-copy"
    FP32_MASTER_DIRECT_TO_FP8 = "fp32-master-direct-to-fp8"
    MERGE_ALLREDUCE_AND_REDUCE_SCATTER_BUCKETS = "merge-allreduce-and-reduce-scatter-buckets"
    GATHER_PAYLOAD_NOT_ZEROED = "gather-payload-not-zeroed"
    FP8_STAGED_PAYLOAD_NOT_ZEROED = "fp8-staged-payload-not-zeroed"
    STAGING_NOT_PERSISTED = "staging-not-persisted"
    ROUTING_PREDICATE_MISMATCH = "routing-predicate-mismatch"
    UINT8_DISTOPT_BUFFER_NEXT_TO_LAYERWISE = "uint8-distopt-buffer-next-to-layerwise"
    DISTOPT_FP8_NOT_REQUANTIZED = "distopt-fp8-not-requantized"
    GRAD_NORM_DOUBLE_COUNTS_REPLICATED = "grad-norm-double-counts-replicated"
    GRAD_NORM_COUNTS_UNREDUCED_SHARD = "grad-norm-counts-unreduced-shard"
    FORCE_SYNC_PAYLOAD_NOT_ZEROED = "force-sync-payload-not-zeroed"
    PREHOOKS_NOT_REGISTERED = "prehooks-not-registered"
    WAIT_WRONG_HANDLE = "wait-wrong-handle"
    FP8_CACHE_NOT_REFRESHED = "fp8-cache-not-refreshed"
    PAYLOAD_IN_GRAD_DURING_ACCUMULATION = "payload-in-grad-during-accumulation"
    FTZ_SUBNORMAL_SCALE_INV = "ftz-subnormal-scale-inv"
    STALE_SCALE_INV = "stale-scale-inv"
    PADDING_ONLY_SHARD = "padding-only-shard"
    WRAPPER_PREFIXED_NAMES = "wrapper-prefixed-names"
    OPTIMIZER_REPORTED_ONCE = "optimizer-reported-once"
    RANK1_SKIPS_RANK0_SLOT = "rank1-skips-rank0-slot"
    CHECKPOINT_DROPS_MOMENTUM = "checkpoint-drops-momentum"
    MASTER_LOSES_QKV_SPLIT = "master-loses-qkv-split"
    RESHARD_DROPS_MOVED_MOMENTUM = "reshard-drops-moved-momentum"
    MUON_NORMALIZE_WITHOUT_EPS = "muon-normalize-without-eps"
    LAYERWISE_OVERLAP_FLAG_OFF = "layerwise-overlap-flag-off"
    MXFP8_COLUMNWISE_FROM_ROWWISE = "mxfp8-columnwise-from-rowwise"
    FINAL_NORM_PAST_HOOKS = "final-norm-past-hooks"
    PREHOOKS_ON_EAGER_GROUPS = "prehooks-on-eager-groups"
    SHARD_END_EXCLUDED = "shard-end-excluded"
    DISTOPT_SHARDS_REVERSED = "distopt-shards-reversed"
    PREHOOKS_SKIP_EXPERT_GROUPS = "prehooks-skip-expert-groups"
    GRAD_REDUCE_INTO_COPY = "grad-reduce-into-copy"
    FP8_PARAMS_NOT_BUILT = "fp8-params-not-built"
    EXPERT_FP8_PARAMS_NOT_BUILT = "expert-fp8-params-not-built"
    GROUP_TAKES_RUN_DISTOPT_FLAG = "group-takes-run-distopt-flag"
    EXPERT_GRADS_SCALED_BY_EXPERT_DP = "expert-grads-scaled-by-expert-dp"
    ZERO_GRAD_SKIPS_DENSE_BUFFERS = "zero-grad-skips-dense-buffers"
    SAVE_COPIES_INTO_LIVE_STATE = "save-copies-into-live-state"
    LOAD_REBINDS_MASTERS = "load-rebinds-masters"
    WGRAD_OVERWRITES_EVERY_MICROBATCH = "wgrad-overwrites-every-microbatch"
    CHECKPOINT_CHUNKS_REVERSED = "checkpoint-chunks-reversed"
    EMPTY_EXPERT_SKIPS_WGRAD = "empty-expert-skips-wgrad"
    CLIP_SKIPS_DISTOPT_GRADS = "clip-skips-distopt-grads"
    CLIP_SCALES_UP = "clip-scales-up"
    WEIGHT_DECAY_ON_NORMS = "weight-decay-on-norms"
    MOE_PROBS_AFTER_FC2 = "moe-probs-after-fc2"
    LR_SCHEDULE_SKIPS_DISTOPT = "lr-schedule-skips-distopt"
    NEXT_GATHER_NOT_PREFETCHED = "next-gather-not-prefetched"
    LAYERWISE_BF16_TRUNCATES = "layerwise-bf16-truncates"


FIRED: set[Fault] = set()
"""The injected faults whose deviation this process has taken (see FaultSet)."""


class FaultSet(frozenset):
    """The faults a stack runs with. Stack code tests ``Fault.X in faults`` where it is about to
    deviate (any other condition of the deviation tested first), so a test that finds its fault is
    the deviation taken, and is recorded in FIRED: a run can then tell an injected fault whose code
    path never ran from one that ran and went unseen. Where telling whether the deviation changes
    anything costs work a clean run should not do, the site asks :meth:`injected` first. One
    deviation is recorded although it may change no bit: Newton-Schulz without eps (set when the
    optimizer is built), which differs from the correct one only on a (near-)zero update."""

    def __contains__(self, fault) -> bool:
        hit = frozenset.__contains__(self, fault)
        if hit:
            FIRED.add(fault)
        return hit

    def injected(self, fault) -> bool:
        """Whether ``fault`` is injected, without recording it as taken."""
        return frozenset.__contains__(self, fault)
