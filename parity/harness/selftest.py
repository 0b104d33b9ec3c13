"""`parity selftest`: inject every catalogued fault on the smallest scenario that exposes it and
show the expected check catches it, at the expected place. Each scenario also runs clean and
must pass: a fault "caught" by a check that fires on clean runs too proves nothing.

A fault that moves both sides alike is caught by the golden check alone: its case compares the
faulted run's record with the record of the same scenario run clean here and now, as `parity run`
compares it with a stored golden (a stored one exists only for the platform that made it)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from parity.harness.faults import CATALOGUE, Injection
from parity.harness.driver import run_scenario
from parity.harness.runner import RunOptions
from parity.vocab import Check

QUICK_SET = "quick"
"""Every case runs on a scenario of this shipped set (scenarios/quick.toml), named quick-<key>:
a passing selftest is the proof that `parity run --set quick` catches the whole catalogue."""


@dataclass(frozen=True)
class Expect:
    """What must happen: a bit mismatch first seen at (step, phase[, tensor]), a failed check, a
    golden record first differing at (step, phase[, tensor]), or an error whose text contains
    ``error``."""

    kind: str
    phase: str | None = None
    step: int | None = None
    tensor: str | None = None
    check: str | None = None
    error: str | None = None

    def __post_init__(self):
        if self.check is not None:
            Check.family(self.check)  # a misspelt check is an error here, not a case never caught

    def __str__(self):
        if self.kind in ("mismatch", "golden"):
            where = [f"step {self.step}" if self.step is not None else None, self.phase,
                     f"*{self.tensor}*" if self.tensor else None]
            head = "mismatch at " if self.kind == "mismatch" else "golden differs at "
            return head + " / ".join(w for w in where if w)
        if self.kind == "check":
            return f"check {self.check} fails" + (f" at step {self.step}" if self.step is not None else "")
        return f"error: {self.error}"


CASES = {  # fault -> (quick scenario key, what must happen; a tuple: all of it, in the same run)
    "split-grad-buffers": ("w4-moe", Expect("mismatch", phase="grad_reduce")),
    "numel-only-ownership": ("w4-dense", Expect("check", check="ownership-agrees", step=-1)),
    "quantized-classifier-always-true": ("w4-dense", Expect("check", check="dropped-set-replaced", step=0)),
    "sample-before-deferred-gather": ("w4-moe-overlap", Expect("mismatch", phase="param_sync", step=0)),
    # the same bytes land, on demand: only the record of where each pre-hook found its gather
    # shows it, in the first window the pre-hooks gather (step 0's optimizer to step 1's forward)
    "next-gather-not-prefetched": ("w4-moe-overlap", Expect("check", check="param-gather-prefetched", step=0)),
    # the stale params show, and so does the missing gather, read from the bucket groups' records
    "no-rearm-in-finish-grad-sync": ("w4-moe-overlap", (Expect("mismatch", phase="param_sync", step=1),
                                                        Expect("check", check="param-gather-once", step=1))),
    "force-sync-stale": ("w4-force-sync-pair", (Expect("mismatch", phase="param_sync", step=0),
                                                Expect("check", check="param-gather-once", step=0))),
    "rank0-empty-slot": ("w4-moe", Expect("error", error="IndexError")),
    "fp32-via-bf16": ("w4-moe", Expect("mismatch", phase="param_sync", step=0, tensor="ape")),
    "mixed-bucket-head": ("w4-moe-overlap", Expect("error", error="cannot flatten an FP8 parameter")),
    "master-from-fp8-dequant": ("w4-dense", Expect("mismatch", phase="init", step=-1)),
    "keep-nonowned-init-copy": ("w4-dense", Expect("check", check="init-copies-dropped", step=-1)),
    "fp32-master-direct-to-fp8": ("w1-moe", Expect("mismatch", phase="param_sync", step=0, tensor=".fp8.")),
    "merge-allreduce-and-reduce-scatter-buckets": ("w4-dense", Expect("mismatch", phase="grad_reduce", step=0)),
    "gather-payload-not-zeroed": ("w4-overlap-pair", Expect("mismatch", phase="grad_reduce", step=1)),
    # ON's FP8-staged buckets only, dense: the dirt lies under FP8 weights' grads, which the first
    # microbatch's wgrad overwrites (docs/spec/te.md s9), so ON == OFF; only ON's own grad buffers,
    # read before the next backward, show it (a check of the reference side alone cannot)
    "fp8-staged-payload-not-zeroed": ("w2-overlap-mb2", Expect("check", check="grads-zero-before-backward", step=0)),
    "staging-not-persisted": ("w4-moe-overlap", Expect("mismatch", phase="param_sync", step=0)),
    "routing-predicate-mismatch": ("w2-adam-matrix", Expect("check", check="optimizer-coverage", step=-1)),
    "uint8-distopt-buffer-next-to-layerwise": ("w2-fp8-head-overlap", Expect(
        "error", error="Cannot merge buckets with differing effective use_distributed_optimizer")),
    "distopt-fp8-not-requantized": ("w2-fp8-head-overlap", Expect("mismatch", phase="param_sync", step=0,
                                                          tensor="head.weight.fp8")),
    # in both stacks (shared faults: the norm's code does not depend on the knob): ON == OFF holds;
    # the elements counted over the ranks, set against the model's, see the double count
    "grad-norm-double-counts-replicated": ("w4-moe-clip", Expect("check", check="grad-norm-counts-once", step=0)),
    "grad-norm-counts-unreduced-shard": ("w4-dense", Expect("check", check="grad-norm-counts-once", step=0)),
    "force-sync-payload-not-zeroed": ("w4-force-sync-pair", Expect("check", check="grad-buffer-clean", step=0)),
    "prehooks-not-registered": ("w4-moe-overlap", Expect("mismatch", phase="param_sync", step=0)),
    "wait-wrong-handle": ("w4-moe-overlap", Expect("mismatch", phase="param_sync", step=0)),
    "fp8-cache-not-refreshed": ("w2-bf16-overlap-pair-mb2", Expect("mismatch", phase="param_sync", step=0,
                                                                    tensor=".fp8.")),
    "payload-in-grad-during-accumulation": ("w2-overlap-mb2", Expect("check", check="param-gather-once", step=0)),
    "ftz-subnormal-scale-inv": ("w2-ep2-stress", Expect("mismatch", phase="param_sync", step=0,
                                                        tensor="experts.7.fc2.weight.fp8.")),
    "stale-scale-inv": ("w2-ep2-stress", Expect("mismatch", phase="param_sync", step=0, tensor=".fp8.")),
    "padding-only-shard": ("w4-padded-gap-shard-resume", Expect(
        "error", error="checkpoint save failed: Failed to validate global plan")),  # torch 2.13 adds the key
    # in both stacks (a shared fault): ON == OFF holds; the resumed run parts from the uninterrupted one
    "checkpoint-drops-momentum": ("w4-padded-gap-shard-resume", Expect("mismatch", phase="optimizer", step=1)),
    "wrapper-prefixed-names": ("w4-dense", Expect("check", check="nonempty/init", step=-1)),
    "optimizer-reported-once": ("w4-dense", Expect("check", check="reported/optimizer", step=1)),
    # in both stacks (a shared fault): ON == OFF holds, the dense and the expert replicas part
    "rank1-skips-rank0-slot": ("w4-moe", (Expect("check", check="replicas/dp", step=0),
                                          Expect("check", check="replicas/expert-dp", step=0))),
    # in both stacks (a shared fault): ON == OFF; the masters, set against their params when the
    # optimizer is built, lack the split Muon reads (the golden also parts at step 0's update)
    "master-loses-qkv-split": ("w1-moe", Expect("check", check="masters-carry-qkv-split", step=-1)),
    # in both stacks (a shared fault): ON == OFF holds; the state loaded at world 4 != the saved one
    "reshard-drops-moved-momentum": ("w2-to-w4-reshard", Expect("mismatch", phase="load", step=1,
                                                                tensor="momentum_buffer")),
    # in both stacks (a shared fault): the dead expert's zero update is 0/0; the loss stays finite
    "muon-normalize-without-eps": ("w2-ep2-stress", Expect("check", check="finite", step=0)),
    # the comparison sees stale non-owned params too; the gather count says why
    "layerwise-overlap-flag-off": ("w4-moe-overlap", (Expect("mismatch", phase="param_sync", step=0),
                                                      Expect("check", check="param-gather-once", step=0))),
    "mxfp8-columnwise-from-rowwise": ("w2-mxfp8-stress", Expect("mismatch", phase="param_sync", step=0,
                                                                tensor="columnwise_data")),
    # in both stacks (a shared fault), without overlap: training is unchanged, ON == OFF, and only
    # the coverage of param_sync sees the params that left it
    "final-norm-past-hooks": ("w4-dense", Expect("check", check="param-sync-covers", step=0)),
    # the re-gathered bytes equal the requantized ones here: only the groups' own records see it
    "prehooks-on-eager-groups": ("w2-fp8-head-overlap", Expect("check", check="param-gather-once", step=0)),
    # in both stacks (a shared fault): the elements no rank steps agree everywhere; only the tiling
    # of the shard pieces sees them, before the first step
    "shard-end-excluded": ("w4-dense", Expect("check", check="distopt-shards-tile", step=-1)),
    # in both stacks (a shared fault): the pieces tile every param and ON == OFF; only the params
    # the sync hands each rank, set against the masters it stepped, see that nothing trains
    "distopt-shards-reversed": ("w4-dense", Expect("check", check="params-hold-masters", step=0)),
    # in both stacks (a shared fault): ON's FP8 owners leave their write to the gather, so ON != OFF;
    # the groups' records, set against what their own buckets call for (not against the groups
    # the pre-hooks were given, which no longer expected a gather), say which gathers are missing
    "prehooks-skip-expert-groups": ("w4-moe-overlap", (Expect("mismatch", phase="param_sync", step=0),
                                                       Expect("check", check="param-gather-once", step=0))),
    # in both stacks (a shared fault): ON == OFF and the owners' params reach every replica; only
    # the replicas of the all-reduced grads, hashed across the DP group, disagree
    "grad-reduce-into-copy": ("w4-dense", Expect("check", check="replicas/dp", step=0)),
    # ON == OFF in every tensor: only the keys ON reports (no FP8 bytes where the scenario asked for
    # FP8 params) show that the knob never reached the stack
    "fp8-params-not-built": ("w1-moe", Expect("check", check="dropped-set", step=0)),
    # ON == OFF in every tensor and the dropped set is not empty: only the set itself, against
    # the FP8 linears of the stack under test, shows which weights ON persists in bf16
    "expert-fp8-params-not-built": ("w1-moe", Expect("check", check="dropped-set", step=0)),
    # in both stacks (a shared fault), under overlap: the dead expert's groups never hear from its
    # weights and are reduced late in every step, as upstream lets them be (same bits); only the
    # groups' own record of who launched each reduction shows it, from the second step
    "empty-expert-skips-wgrad": ("w2-mxfp8-stress", Expect("check", check="grad-reduce-launch", step=1)),
    # in both stacks (shared faults): the norm, the zeros and ON == OFF hold; the norm of the grads
    # the optimizers stepped with, read after the step, is not what the clip aimed at (the scenario
    # clips at steps 0 and 1, not at step 2)
    "clip-skips-distopt-grads": ("w4-moe-clip", Expect("check", check="clip-reaches-stepped-grads", step=0)),
    "clip-scales-up": ("w4-moe-clip", Expect("check", check="clip-reaches-stepped-grads", step=2)),
    # in both stacks (a shared fault): every in-run check passes; the golden's norm masters differ
    # at step 0's update (tests/integration/test_optim_single_rank.py also steps a zero grad)
    "weight-decay-on-norms": ("w4-dense", Expect("golden", phase="optimizer", step=0, tensor="norm")),
    # in both stacks (a shared fault): every in-run check passes; the golden's first forward differs
    "moe-probs-after-fc2": ("w1-moe", Expect("golden", phase="forward", step=0)),
    # in both stacks (a shared fault): every in-run check passes; the schedule's lr first moves at
    # step 1 (cosine without warmup), where the golden's Adam masters differ
    "lr-schedule-skips-distopt": ("w2-fp8-head-overlap", Expect("golden", phase="optimizer", step=1)),
    # in both stacks (a shared fault): the replica check hashes the grads each buffer is laid out
    # to all-reduce (its own flag), not those its group happens to all-reduce: they disagree
    "group-takes-run-distopt-flag": ("w4-dense", Expect("check", check="replicas/dp", step=0)),
    # in both stacks (a shared fault): every in-run check passes; the golden's expert grads differ
    # (tests/integration/test_scenarios.py also sets EP 1, 2 and 4 against each other)
    "expert-grads-scaled-by-expert-dp": ("w4-moe", Expect("golden", phase="grad_reduce", step=0, tensor="experts")),
    # in both stacks (a shared fault): ON == OFF; the buffers, read before the next backward, are
    # not empty (recorded at step 0: the params of step 0 are what that forward consumed)
    "zero-grad-skips-dense-buffers": ("w4-dense", Expect("check", check="grads-zero-before-backward", step=0)),
    # in both stacks (a shared fault): the save changed what training holds, so the resumed run
    # and the uninterrupted one agree; the state read around the save (not through it) moved
    "save-copies-into-live-state": ("w4-padded-gap-shard-resume", Expect("check", check="save-leaves-state", step=0)),
    # in both stacks (a shared fault), on a resharded load: the optimizers' own param lists, set
    # against the masters the stack holds, show that Muon steps tensors nothing reads
    "load-rebinds-masters": ("w2-to-w4-reshard", Expect("check", check="optimizers-step-masters", step=1)),
    # in both stacks (a shared fault): every in-run check passes; the golden's reduced grads differ
    # (tests/integration/test_stack_single_rank.py also sets two microbatches of one batch against one)
    "wgrad-overwrites-every-microbatch": ("w2-overlap-mb2", Expect("golden", phase="grad_reduce", step=0)),
    # in both stacks (a shared fault): the checkpoint's gathered view holds each DistOpt piece at
    # the wrong offset, seen right after the save; on the resharded load the reshard check (the
    # loaded state saved again) undoes it, and the params set against their loaded masters do not
    "checkpoint-chunks-reversed": ("w2-to-w4-reshard", (Expect("check", check="checkpoint-holds-state", step=0),
                                                        Expect("check", check="params-hold-masters", step=1))),
    # in both stacks (a shared fault): ON == OFF and the replicas hold; the bf16 params the sync
    # leaves, set against the LayerWise masters each rank stepped, do not (OFF's Muon matrices:
    # ON's are FP8 and go through the same rounding unseen by this check)
    "layerwise-bf16-truncates": ("w4-dense", Expect("check", check="params-hold-masters", step=0)),
}
CASES = {fault: (key, exp if isinstance(exp, tuple) else (exp,)) for fault, (key, exp) in CASES.items()}
"""The cases as written above, each case's expectations as a tuple."""


def scenario(key: str):
    from parity.harness.scenario import load_set

    by_name = {s.name: s for s in load_set(QUICK_SET)}
    return by_name[f"{QUICK_SET}-{key}"]


def _golden_first(entry: dict) -> dict | None:
    """The first differing record of a failed golden comparison (None: none made, or it passed)."""
    if entry.get("golden") != "fail":
        return None
    return entry["golden_detail"]["first"]


def observe(entry: dict) -> str:
    if entry["status"] == "error":
        return "error: " + " ".join((entry.get("error") or "").split())
    fd = entry.get("first_divergence")
    parts = []
    if fd:
        parts.append(f"mismatch at step {fd['step']} / {fd['phase']} / {fd['tensor']}")
    for c in entry.get("failed_checks", []):
        parts.append(f"check {c['check']} fails at step {c['step']}")
    if (g := _golden_first(entry)) is not None:
        parts.append(f"golden differs at step {g['step']} / {g['phase']} / {g['tensor']}")
    return "; ".join(dict.fromkeys(parts)) or "nothing"


def first_caught(entry: dict) -> str:
    """Where the run first failed: the earliest step of a divergence or failed check, and its
    phase or check (construction is step -1); for an error, where it was raised."""
    if entry["status"] == "error":
        step = (entry.get("failure") or {}).get("step")
        return f"error at step {step}" if isinstance(step, int) else "error"
    hits = []
    fd = entry.get("first_divergence")
    if fd:
        hits.append((fd["step"], fd["phase"]))
    hits += [(c["step"], c["check"]) for c in entry.get("failed_checks", [])]
    if (g := _golden_first(entry)) is not None:
        hits.append((g["step"], "golden"))
    if not hits:
        return "-"
    step, where = min(hits, key=lambda h: h[0])
    return f"step {step} / {where}"


def caught(exp: Expect, entry: dict) -> bool:
    if exp.kind == "error":
        text = (entry.get("error") or "") + (entry.get("failure", {}).get("launcher") or "")
        return entry["status"] == "error" and exp.error in text
    if entry["status"] == "error":
        return False
    if exp.kind == "check":
        return any(c["check"].startswith(exp.check) and (exp.step is None or c["step"] == exp.step)
                   for c in entry.get("failed_checks", []))
    fd = entry.get("first_divergence") if exp.kind == "mismatch" else _golden_first(entry)
    return bool(fd) and (exp.phase is None or fd["phase"] == exp.phase) and \
        (exp.step is None or fd["step"] == exp.step) and (exp.tensor is None or exp.tensor in fd["tensor"])


_CLEAN: dict = {}  # scenario key -> (passes, its golden record or None); cached per process


def _opts(fault: str | None = None, digests: bool = False) -> RunOptions:
    # fail_fast: a case asserts where its fault is first caught, and a clean run that passes runs
    # whole anyway; the steps after the first failing one add nothing but time.
    return RunOptions(injections=(Injection("fault", name=fault),) if fault else (), progress=False,
                      snapshot="none", golden_digests=digests, fail_fast=True)


def _known(names, known, what: str) -> list:
    names = list(names) if names else list(CATALOGUE)
    unknown = [n for n in names if n not in known]
    if unknown:
        from parity.harness.errors import UsageError
        raise UsageError(f"{what}: {unknown}; known: {', '.join(known)}")
    return names


def _record(key: str, results: list[dict]):
    from parity.harness.golden import record_from_results
    from parity.harness.goldens_cli import platform_of

    s = scenario(key)
    return record_from_results(s, results, platform_of(s))


def _clean(key: str, digests: bool, out) -> tuple[bool, object]:
    """(passes, golden record if ``digests`` and it passes) of the scenario run without a fault; a
    run made with digests serves a later call without."""
    hit = _CLEAN.get(key)
    if hit is None or (digests and hit[0] and hit[1] is None):
        t0 = time.perf_counter()
        e, results = run_scenario(scenario(key), _opts(digests=digests), timeout_s=30)
        passes = e["status"] == "pass"
        _CLEAN[key] = (passes, _record(key, results) if digests and passes else None)
        out(f"[selftest] clean {key}: {e['status']} ({time.perf_counter() - t0:.1f} s)")
    return _CLEAN[key]


def run_selftest(faults=None, out=print, *, clean_runs: bool = True) -> list[dict]:
    """One row per fault: injected into its quick-set scenario, caught where expected, and (with
    ``clean_runs``) the scenario run without it must pass. ``clean_runs=False`` is for a caller
    that runs every quick-set scenario whole itself (the test suite's tests/integration/
    test_scenarios.py, with its golden): then ``clean_passes`` is None and ``caught`` is the
    detection (by a fault that fired) alone; a golden case makes its clean record here either way."""
    from parity.harness.golden import compare

    names = _known(faults, CASES, "selftest: no case for")
    rows = []
    for name in names:
        key, expects = CASES[name]
        by_golden = any(e.kind == "golden" for e in expects)
        clean, clean_record = _clean(key, by_golden, out) if clean_runs or by_golden else (None, None)
        clean = clean if clean_runs else None
        t0 = time.perf_counter()
        entry, results = run_scenario(scenario(key), _opts(name, by_golden), timeout_s=30)
        if clean_record is not None and entry["status"] != "error":
            c = compare(clean_record, _record(key, results))
            entry["golden"], entry["golden_detail"] = c.status, c.to_dict()
        # Caught by the stack: the fault's deviation ran (the stacks record it; a run that ends in
        # the error the fault raises returns no record, and its expected error text ties it to it).
        fired = entry["status"] == "error" or name in entry["faults_fired"]
        ok = all(caught(e, entry) for e in expects) and fired and clean is not False
        rows.append({"fault": name, "scenario": f"{QUICK_SET}-{key}", "expected": " and ".join(map(str, expects)),
                     "observed": observe(entry), "first_caught": first_caught(entry), "in_quick": True,
                     "caught": ok, "fired": fired, "clean_passes": clean,
                     "seconds": round(time.perf_counter() - t0, 1)})
        out(f"[selftest] {name}: {'caught' if ok else 'NOT CAUGHT'} ({rows[-1]['observed'][:160]})")
    return rows


MARKS = {"caught": "X", "error": "E", "ran": "o", "never ran": ".", "caught, never ran": "X!"}
"""A matrix cell: the run failed (X) or errored (E) with the fault; it passed although the fault's
deviation ran (o: the checks did not see it there, or it changed no bit there) or never ran (.: the
scenario does not reach it; the stacks' record, parity.vocab.FaultSet). X! (failed, but the
deviation never ran) is a check failing for another reason than the fault: the matrix exits 1."""
LEGEND = ("X caught (the run fails), E the run errors, o the fault's deviation ran and every check passed, "
          ". the scenario never reaches it, X! failed although the deviation never ran (a check failing "
          "for another reason), - the scenario does not pass clean (not run). Golden off: a fault only "
          "a golden sees shows o.")


def fault_matrix(scenarios, faults, out=print, *, timeout_s: float = 60.0) -> dict:
    """Every fault in ``faults`` injected into every scenario (fail-fast, golden off): which
    scenarios catch which fault, which run its deviation unseen, which never reach it. Each
    scenario first runs clean; a scenario that does not pass clean gets no column of results."""
    from parity.harness.errors import ParityError

    names = _known(faults, CATALOGUE, "selftest --matrix: unknown fault")
    clean = {}
    for s in scenarios:
        try:
            e, _ = run_scenario(s, _opts(), timeout_s=timeout_s)
            clean[s.name] = e["status"]
        except ParityError as err:  # a scenario this machine cannot run (a CUDA one, too many ranks)
            clean[s.name] = f"not run: {err}"
        out(f"[selftest] clean {s.name}: {clean[s.name]}")
    cells = []
    for name in names:
        for s in scenarios:
            if clean[s.name] != "pass":
                continue
            e, _ = run_scenario(s, _opts(name), timeout_s=timeout_s)
            fired = name in e.get("faults_fired", ())
            outcome = ("error" if e["status"] == "error" else
                       ("caught" if fired else "caught, never ran") if e["status"] == "fail" else
                       "ran" if fired else "never ran")
            cells.append({"fault": name, "scenario": s.name, "outcome": outcome, "first_caught": first_caught(e),
                          "observed": observe(e)})
        row = "".join(MARKS[c["outcome"]] for c in cells if c["fault"] == name)
        out(f"[selftest] {name}: {row}")
    return {"scenarios": [s.name for s in scenarios], "clean": clean, "faults": names, "cells": cells}


def matrix_table(m: dict) -> str:
    by = {(c["fault"], c["scenario"]): MARKS[c["outcome"]] for c in m["cells"]}
    cols = m["scenarios"]
    lines = ["| fault | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for f in m["faults"]:
        lines.append(f"| {f} | " + " | ".join(by.get((f, s), "-") for s in cols) + " |")
    return "\n".join(lines + ["", LEGEND])


def table(rows) -> str:
    lines = ["| fault | scenario | expected | observed | first caught (step / phase) | caught | by `quick` |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        obs = r["observed"].replace("|", "/")[:140]
        lines.append(f"| {r['fault']} | {r['scenario']} | {r['expected']} | {obs} | {r['first_caught']} | "
                     f"{'yes' if r['caught'] else 'NO'} | {'yes' if r['caught'] and r['in_quick'] else 'no'} |")
    return "\n".join(lines)


def _write(out_dir: str, stem: str, data, md: str) -> None:
    import json
    import os

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(md + "\n")


def selftest_command(args) -> int:
    t0 = time.perf_counter()
    if args.set and not args.matrix:
        from parity.harness.errors import UsageError
        raise UsageError("--set applies to --matrix (the selftest itself runs each fault on its quick scenario)")
    if args.matrix:
        from parity.harness.scenario import load_set

        m = fault_matrix(load_set(args.set or QUICK_SET), args.faults or None)
        md = matrix_table(m)
        print(md)
        _write(args.out, "matrix", m, md)
        suspect = [c for c in m["cells"] if c["outcome"] == "caught, never ran"]
        print(f"[selftest] matrix of {len(m['faults'])} faults x {len(m['scenarios'])} scenarios in "
              f"{time.perf_counter() - t0:.0f} s: {args.out}/matrix.md"
              + (f"; {len(suspect)} runs failed although their fault never ran" if suspect else ""))
        return 1 if suspect else 0
    rows = run_selftest(args.faults or None)
    md = table(rows)
    print(md)
    n = sum(r["caught"] for r in rows)
    print(f"[selftest] {n}/{len(rows)} faults caught in {time.perf_counter() - t0:.0f} s")
    _write(args.out, "selftest", rows, md)
    return 0 if n == len(rows) else 1
