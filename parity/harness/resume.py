"""Checkpoint-resume parity: checkpoint both sides of a pair after step K, resume in new rank
processes, and check that the rest of the run is what it would have been.

A scenario with ``resume_at = K`` runs in two launches:

1. The uninterrupted run: all steps, ON == OFF every phase as usual, with a checkpoint of both
   sides written after K steps (saving only reads the stacks). From step K on, every rank records
   the sha256 of every tensor of every phase of both sides, and of its RNG state at step K.
2. The resumed run: new rank processes build both stacks, load the checkpoint and run steps K..end,
   ON == OFF every phase, recording the same digests.

Every (step, phase, side, tensor, rank) digest of the resumed run must equal the uninterrupted
run's. A difference is reported like any divergence, tagged ``against: uninterrupted``.

With ``resume_world = W2`` the checkpoint is loaded at another DP size (a reshard): the first
launch runs K steps at ``world`` and saves; the second loads at W2, saves again at once, and every
tensor of that second checkpoint must equal the first one bit for bit. DCP assembles each tensor
whole from its chunks (the gathered view), so masters and Muon state are checked after they
moved with their matrices. Then it continues with ON == OFF. Its bits are not compared with the
uninterrupted run, because the reduction order changes with the DP size.

``parity run S --resume-from DIR [--reshard]`` loads a given checkpoint and runs the rest of S.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from parity.distributed.determinism import empty
from parity.harness import report as rep
from parity.harness.compare import bit_view
from parity.harness.errors import ParityError
from parity.harness.snapshot import tensor_sha256
from parity.optim import checkpoint as ckpt
from parity.vocab import Check, Side

RESHARD_NOTE = ("bits after a reshard are not compared with the uninterrupted run: the reduction "
                "order changes with the DP size")
# Checkpoint entries that may differ between a checkpoint and its resharded reload.
_LAYOUT_DEPENDENT = (".owner", "rng/")


class CheckpointInputError(ParityError):
    """A checkpoint given as input is missing, incomplete, corrupt or of another run."""

    exit_code = 2


def checkpoint_config(scenario) -> dict:
    """What a checkpoint must share with the run that loads it (world and ep may differ only with
    --reshard; steps and device may differ)."""
    d = scenario.to_dict()
    for k in ("name", "steps", "world", "ep", "device", "resume_at", "resume_world",
              "golden_tensor_steps"):
        d.pop(k, None)
    return d


# -- in the ranks (the runner calls these) ---------------------------------------------------
def save_pair(path: str, scenario, stacks: dict, step: int, device) -> dict:
    """Collective: checkpoint both sides (``stacks``: side -> Stack) after ``step`` steps."""
    state = {}
    for side, stack in stacks.items():
        state.update(ckpt.stack_state(stack, prefix=f"{side}/"))
    rank = dist.get_rank()
    state.update({f"rng/rank{rank}/{k}": v for k, v in ckpt.rng_state(device).items()})
    manifest = {"scenario": scenario.name, "config": checkpoint_config(scenario), "world": scenario.world,
                "ep": scenario.ep, "step": step, "sides": [str(s) for s in stacks]}
    return ckpt.save(path, state, manifest)


def load_pair(path: str, scenario, stacks: dict, device, reshard: bool) -> tuple[int, dict]:
    """Collective: load both sides from the checkpoint at ``path``; returns (next step, what the
    load did). The parent has verified the checkpoint (check_checkpoint) before the launch."""
    manifest = ckpt.read_manifest(path, verify_files=False)
    saved = ckpt.saved_entries(path)
    same_layout = manifest["world"] == scenario.world and manifest["ep"] == scenario.ep
    targets, finishers = {}, {}
    for side, stack in stacks.items():
        t, finishers[side] = ckpt.load_targets(stack, saved, prefix=f"{side}/")
        targets.update(t)
    rank = dist.get_rank()
    rng_keys = {k: f"rng/rank{rank}/{k}" for k in ckpt.rng_state(device)}
    rng = {}
    if same_layout:  # a rank of a resharded run is not the process that saved under its number
        for k, key in rng_keys.items():
            if key in saved:
                rng[k] = targets[key] = empty(tuple(saved[key].size), dtype=saved[key].properties.dtype,
                                              device="cpu")
    seconds = ckpt.load(path, targets)
    info = {"step": manifest["step"], "saved_world": manifest["world"], "load_s": seconds, "owners_moved": {}}
    for side, finish in finishers.items():
        done = finish()
        if done["owners_moved"] and same_layout and not reshard:
            raise ckpt.CheckpointError(f"side {side}: LayerWise ownership of {done['owners_moved'][:3]} differs "
                                       f"from the checkpoint's at the same DP size")
        info["owners_moved"][str(side)] = len(done["owners_moved"])
    if len(rng) == len(rng_keys):
        ckpt.set_rng_state(rng, device)
    info["rng_restored"] = len(rng) == len(rng_keys)
    return manifest["step"], info


def saved_state_differences(path: str, stacks: dict) -> dict:
    """side -> (tensors compared, differences): this rank's optimizer state of each stack, read
    from the stack itself (LayerWise masters and Muon state, DistOpt pieces and Adam state), against
    the gathered view of the checkpoint just written at ``path`` (each tensor whole, as DCP
    assembles it from every rank's chunks; read once for both sides), bit for bit. A DistOpt piece
    is read at its own offset in its bucket's saved tensor, so a checkpoint whose chunks sit in the
    wrong place fails here even where a load at the same DP size would read them back the same
    wrong way (docs/spec/megatron.md s5 item 47). A state tensor the checkpoint lacks is not judged
    here: the resumed run's comparison shows what a missing one loses."""
    saved = ckpt.saved_entries(path)
    places = {}
    for side, stack in stacks.items():
        mine = [(f"{side}/layerwise/{k}", 0, v) for k, v in stack.layerwise.state_tensors().items()]
        for head, at, pc in ckpt.distopt_piece_places(stack, f"{side}/"):
            st = stack.distopt.optimizer.state.get(pc.master, {}) if stack.distopt.optimizer else {}
            mine += [(f"{head}{k}", at, v) for k, v in {"master": pc.master, **st}.items()
                     if torch.is_tensor(v) and v.dim() > 0]
        places[side] = [(key, at, v) for key, at, v in mine if key in saved]
    full = ckpt.read_full(path, {key for side in places.values() for key, _, _ in side})

    def differs(key, at, v):
        got = full[key].reshape(-1)[at:at + v.numel()]
        v = v.detach().reshape(-1).cpu()
        return got.dtype != v.dtype or got.numel() != v.numel() or not torch.equal(bit_view(got), bit_view(v))

    return {side: (len(ps), [f"{key}[{at}:{at + v.numel()}]" for key, at, v in ps if differs(key, at, v)])
            for side, ps in places.items()}


def resume_pair(opts, scenario, stacks: dict, device) -> tuple[int, dict]:
    """The runner's resume: load ``stacks`` from ``opts.load_from``; with ``opts.verify_to``,
    checkpoint them again right away (the resharded-load check compares the two)."""
    step, info = load_pair(opts.load_from, scenario, stacks, device, opts.reshard)
    if opts.verify_to:
        info["verify"] = save_pair(opts.verify_to, scenario, stacks, step, device)
    return step, info


def record_digests(digests: dict, step: int, phase: str, test: dict, ref: dict) -> None:
    """sha256 of every tensor of one phase, both sides (compared across launches)."""
    by_side = digests.setdefault(step, {}).setdefault(phase, {})
    for side, tensors in ((Side.TEST, test), (Side.REF, ref)):
        by_side[str(side)] = {k: tensor_sha256(v.detach()) for k, v in tensors.items()}


def record_rng(digests: dict, step: int, device) -> None:
    """sha256 of this process's RNG state at the start of ``step``."""
    digests.setdefault(step, {})["rng"] = {
        "process": {k: tensor_sha256(v) for k, v in ckpt.rng_state(device).items()}}


# -- in the parent ---------------------------------------------------------------------------
def check_checkpoint(path: str, scenario, reshard: bool) -> dict:
    """Refuse, with one line, a checkpoint ``scenario`` cannot resume from."""
    try:
        manifest = ckpt.read_manifest(path)
        ckpt.saved_entries(path)
    except ckpt.CheckpointError as e:
        raise CheckpointInputError(str(e)) from None
    want, have = checkpoint_config(scenario), manifest.get("config", {})
    if have != want:
        diff = [f"{k}: {have.get(k)!r} vs {want.get(k)!r}" for k in sorted(set(want) | set(have))
                if have.get(k) != want.get(k)]
        raise CheckpointInputError(f"checkpoint {path!r} was written by scenario {manifest.get('scenario')!r} "
                                   f"with another config ({'; '.join(diff[:4])}); refusing to load it into "
                                   f"{scenario.name!r}")
    if (manifest.get("world"), manifest.get("ep")) != (scenario.world, scenario.ep) and not reshard:
        raise CheckpointInputError(f"checkpoint {path!r} was saved at world {manifest.get('world')} (ep "
                                   f"{manifest.get('ep')}); this run has world {scenario.world} (ep "
                                   f"{scenario.ep}): pass --reshard to load it at another DP size")
    if not isinstance(manifest.get("step"), int) or not 0 < manifest["step"] < scenario.steps:
        raise CheckpointInputError(f"checkpoint {path!r} is at step {manifest.get('step')}; scenario "
                                   f"{scenario.name!r} runs {scenario.steps} steps: nothing to resume")
    return manifest


def compare_digests(uninterrupted: list, resumed: list, from_step: int) -> tuple[int, list]:
    """(digests compared, divergences) of the resumed run against the uninterrupted one."""
    def table(results):
        out = {}
        for r in results:
            for step, phases in r.get("digests", {}).items():
                if step < from_step:
                    continue
                for phase, sides in phases.items():
                    for side, tensors in sides.items():
                        for name, sha in tensors.items():
                            out[(step, phase, side, name, r["rank"])] = sha
        return out

    a, b = table(uninterrupted), table(resumed)
    divs = []
    for key in sorted(set(a) | set(b), key=lambda k: (k[0], rep.PHASE_ORDER.get(k[1], 99), k[4], k[2], k[3])):
        if a.get(key) == b.get(key):
            continue
        step, phase, side, name, rank = key
        path = f"step {step}/{phase}/{name}/rank {rank}"
        if key not in b or key not in a:
            what = f"only in the {'uninterrupted' if key in a else 'resumed'} run"
        else:
            what = f"sha256 {b[key][:12]} after the resume, {a[key][:12]} uninterrupted"
        divs.append(_uncounted(step, phase, rank, path, "uninterrupted", what,
                               f"{path}: side {side} differs from the uninterrupted run ({what})", side=side))
    return len(set(a) & set(b)), divs


def _uncounted(step, phase, rank, path, against, reason, message, **extra) -> dict:
    """A divergence without element counts (a digest comparison, or a tensor one side lacks): its
    reason says how it differs."""
    return {"step": step, "phase": phase, "rank": rank, "path": path, "n_diff": None, "numel": None,
            "max_ulp": None, "ulp_hist": None, "against": against, "reason": reason, "message": message, **extra}


def compare_checkpoints(saved: str, reloaded: str, step: int) -> tuple[int, list]:
    """(tensors compared, divergences): every tensor of the resharded reload against the checkpoint
    it was loaded from, whole (DCP assembles each tensor from its chunks), bit for bit. Both
    checkpoints are read into this process: a check for reshard runs, not part of a resume."""
    from parity.harness.compare import compare_tensors

    a = ckpt.read_full(saved)
    b = ckpt.read_full(reloaded)
    divs, compared = [], 0
    for key in sorted(set(a) | set(b)):
        if any(tag in key for tag in _LAYOUT_DEPENDENT):
            continue
        path = f"step {step}/load/{key}/rank -1"
        if key not in a or key not in b:
            what = f"only in the {'saved' if key in a else 'reloaded'} checkpoint"
            divs.append(_uncounted(step, "load", -1, path, "saved", what, f"{path}: {what}"))
            continue
        compared += 1
        d = compare_tensors(a[key], b[key], path)
        if not d.equal:
            divs.append({**d.to_dict(), "step": step, "phase": "load", "rank": -1, "path": path,
                         "against": "saved", "message": d.message() + " (loaded at another DP size != saved)"})
    return compared, divs


@contextlib.contextmanager
def _checkpoint_dir(opts, scenario):
    """OUT/checkpoints/<scenario> when the run has an output directory, else a temporary one."""
    if opts.out_dir:
        d = os.path.join(opts.out_dir, "checkpoints", scenario.name)
        os.makedirs(d, exist_ok=True)
        yield d
        return
    with tempfile.TemporaryDirectory(prefix="parity-ckpt-") as d:
        yield d


def _verdict(scenario, divs: list, compared: int, what: str) -> dict:
    """The results of the comparison across launches, as one more result to merge."""
    return {"rank": -1, "divergences": divs, "compared": compared, "compared_by_phase": {"resume": compared},
            "checks": [{"step": scenario.resume_at, "check": f"{Check.NONEMPTY}/resume", "ok": compared > 0, "rank": -1,
                        "message": "" if compared else f"{what}: nothing compared across launches"}],
            "messages": [d["message"] for d in divs[:30]], "steps": [], "snapshots": []}


def _tag_first_divergence(entry: dict, divs: list) -> None:
    """When the first divergence is one across launches, say against what (and on which side)."""
    fd = entry.get("first_divergence")
    where = fd and f"step {fd['step']}/{fd['phase']}/{fd['tensor']}/rank {fd['rank']}"
    match = next((d for d in divs if d["path"] == where), None)
    if match:
        fd["against"] = match["against"]
        if "side" in match:
            fd["side"] = match["side"]


def _error(scenario, entry: dict, where: str, t0: float) -> dict:
    return rep.error_entry(scenario, f"{where}: {entry.get('error')}", time.perf_counter() - t0, entry.get("failure"))


def run_resume(scenario, opts, *, timeout_s: float, allow_nondeterministic: bool):
    """The two launches of a ``resume_at`` scenario and the comparison across them."""
    from parity.harness.driver import run_scenario

    t0 = time.perf_counter()
    k = scenario.resume_at
    world2 = scenario.resume_world or scenario.world
    reshard = world2 != scenario.world
    base = dataclasses.replace(scenario, resume_at=None, resume_world=None)
    kw = dict(timeout_s=timeout_s, allow_nondeterministic=allow_nondeterministic)
    with _checkpoint_dir(opts, scenario) as root:
        path = os.path.join(root, f"step{k}")
        first = dataclasses.replace(base, steps=k) if reshard else base
        e1, r1 = run_scenario(first, dataclasses.replace(opts, save_at=k, save_to=path,
                                                         digests_from=None if reshard else k), **kw)
        if e1["status"] == "error":
            return _error(scenario, e1, f"run before the resume (world {scenario.world})", t0), r1
        try:
            check_checkpoint(path, base, reshard=reshard)
        except CheckpointInputError as e:
            return rep.error_entry(scenario, f"the checkpoint just written is unusable: {e}",
                                   time.perf_counter() - t0), r1
        second = dataclasses.replace(base, world=world2)
        reloaded = path + ".reloaded" if reshard else None
        e2, r2 = run_scenario(second, dataclasses.replace(opts, load_from=path, reshard=reshard,
                                                          verify_to=reloaded, digests_from=k), **kw)
        if e2["status"] == "error":
            return _error(scenario, e2, f"resumed run (world {world2})", t0), r1
        if reshard:
            compared, divs = compare_checkpoints(path, reloaded, k)
            shutil.rmtree(reloaded, ignore_errors=True)
            what = "resharded load"
        else:
            compared, divs = compare_digests(r1, r2, k)
            what = "resume"
        saved = r1[0].get("checkpoint", {})
        ckpt_bytes = saved.get("bytes")
        kept = path if opts.out_dir else None
    entry = rep.merge_ranks(scenario, r1 + r2 + [_verdict(scenario, divs, compared, what)],
                            time.perf_counter() - t0)
    steps1, steps2 = r1[0]["steps"], r2[0]["steps"]
    entry["steps"] = len({s["step"] for s in steps1 + steps2})
    if reshard:
        entry["loss"] = [{"step": s["step"], "bits": s.get("loss_bits"), "repr": s.get("loss")}
                         for s in steps1 + steps2]
    _tag_first_divergence(entry, divs)
    load = r2[0].get("resume", {})
    entry["resume"] = {
        "at": k, "world": scenario.world, "resume_world": world2, "resharded": reshard,
        "checkpoint": kept, "checkpoint_bytes": ckpt_bytes,
        "save_s": round(max(r.get("checkpoint", {}).get("seconds", 0.0) for r in r1), 3),
        "load_s": round(max(r.get("resume", {}).get("load_s", 0.0) for r in r2), 3),
        "compared": compared, "mismatches": len(divs),
        "owners_moved": load.get("owners_moved"), "rng_restored": load.get("rng_restored"),
        "against": "saved checkpoint (gathered view)" if reshard else "uninterrupted run",
    }
    if reshard:
        entry["resume"]["note"] = RESHARD_NOTE
    entry["scenario"] = scenario.to_dict()
    return entry, (r1 + r2 if reshard else r1)


def run_from_checkpoint(scenario, opts, path: str, reshard: bool, *, timeout_s: float,
                        allow_nondeterministic: bool):
    """``parity run S --resume-from PATH``: S's remaining steps from a checkpoint, ON == OFF; at
    another DP size the loaded state is first compared with the saved one."""
    from parity.harness.driver import run_scenario

    t0 = time.perf_counter()
    manifest = check_checkpoint(path, scenario, reshard)
    resharded = (manifest["world"], manifest["ep"]) != (scenario.world, scenario.ep)
    compared, divs = 0, []
    with tempfile.TemporaryDirectory(prefix="parity-reload-") as tmp:
        reloaded = os.path.join(tmp, "reloaded") if resharded else None
        entry, results = run_scenario(scenario, dataclasses.replace(
            opts, load_from=path, reshard=reshard, verify_to=reloaded), timeout_s=timeout_s,
            allow_nondeterministic=allow_nondeterministic)
        if entry["status"] == "error":
            return entry, results
        if resharded:
            compared, divs = compare_checkpoints(path, reloaded, manifest["step"])
            verdict = _verdict(dataclasses.replace(scenario, resume_at=manifest["step"]), divs, compared,
                               "resharded load")
            entry = rep.merge_ranks(scenario, results + [verdict], time.perf_counter() - t0)
            _tag_first_divergence(entry, divs)
    load = results[0].get("resume", {})
    entry["resume"] = {"from": path, "at": manifest["step"], "world": manifest["world"],
                       "resume_world": scenario.world, "resharded": resharded, "compared": compared,
                       "mismatches": len(divs), "checkpoint_bytes": sum(s for s, _ in manifest["files"].values()),
                       "load_s": round(max(r.get("resume", {}).get("load_s", 0.0) for r in results), 3),
                       "owners_moved": load.get("owners_moved"), "rng_restored": load.get("rng_restored"),
                       "against": "saved checkpoint (gathered view)" if resharded else None}
    if resharded:
        entry["resume"]["note"] = RESHARD_NOTE
    return entry, results


def describe(r: dict) -> str:
    """One line about a resume for the console."""
    size = f"{r['checkpoint_bytes'] / 1e6:.1f} MB" if r.get("checkpoint_bytes") else "?"
    timing = (f"checkpoint {size}" + (f", save {r['save_s']} s" if "save_s" in r else "")
              + f", load {r.get('load_s')} s")
    if r.get("resharded"):
        moved = sum((r.get("owners_moved") or {}).values())
        return (f"resharded world {r['world']} -> {r['resume_world']} at step {r['at']}: "
                f"{r['compared'] - r['mismatches']}/{r['compared']} tensors loaded equal the saved ones "
                f"(gathered view), {moved} LayerWise owners moved; {timing}; {RESHARD_NOTE}")
    if r.get("against") is None:
        return f"resumed from {r.get('from')} at step {r['at']}; {timing}"
    return (f"resumed at step {r['at']} in new ranks: {r['compared'] - r['mismatches']}/{r['compared']} "
            f"digests of the remaining steps equal the uninterrupted run; {timing}")
