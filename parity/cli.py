"""The `parity` command line.

Exit codes: 0 all checks pass; 1 a parity or golden mismatch; 2 bad usage, config or input;
3 a runtime failure (a rank died, a timeout); 141 the reader of the output went away
(`parity list | head`), as a shell reports a process that SIGPIPE ended.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from parity.distributed.pins import pin_before_torch

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_RUNTIME = 0, 1, 2, 3
EXIT_BROKEN_PIPE = 128 + 13
DEFAULT_SCENARIO = "default"
_TORCHRUN_EXIT_WAIT_S = 3600.0  # under torchrun: how long a worker waits for the others' exit codes


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors exit 2 with usage, never a traceback
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="parity", description="Bitwise-parity verification harness for distributed "
                "FP8 training: Muon FP8 param gather ON vs OFF, in lockstep, bit for bit.")
    sub = p.add_subparsers(dest="cmd", parser_class=_Parser)

    r = sub.add_parser("run", help="run scenarios ON and OFF in lockstep and compare every step")
    r.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                   help="scenario names or .toml files (default: the 'default' scenario)")
    r.add_argument("--set", dest="scenario_set", metavar="NAME",
                   help="also run every scenario of scenarios/NAME.toml (e.g. quick: catches every "
                        "catalogued fault in a few minutes on 2 cores; stress; microbatch)")
    r.add_argument("--recipe", choices=("blockwise", "mxfp8"))
    r.add_argument("--ep", type=_positive_int, help="expert-parallel size (implies --moe)")
    r.add_argument("--dp", type=_positive_int, help="data-parallel size (= world size)")
    r.add_argument("--world", type=_positive_int,
                   help="number of ranks (alone, it also lowers the scenario's EP to one that divides it)")
    r.add_argument("--overlap", action="store_true", default=None,
                   help="overlap grad reduce and param gather (deferred gather)")
    r.add_argument("--no-overlap", dest="overlap", action="store_false")
    model = r.add_mutually_exclusive_group()
    model.add_argument("--moe", action="store_true", default=None, help="MoE layers")
    model.add_argument("--dense", dest="moe", action="store_false",
                       help="a dense model, no MoE layers (and so EP 1)")
    r.add_argument("--layout", choices=("compact", "padded"))
    r.add_argument("--pair", choices=("fp8_param_gather", "overlap_param_gather", "force_sync"))
    r.add_argument("--steps", type=_positive_int)
    r.add_argument("--microbatches", type=_positive_int, help="microbatches per step (gradient accumulation)")
    r.add_argument("--lr", type=_positive_float)
    r.add_argument("--seed", type=int)
    r.add_argument("--bucket-size", type=_positive_int)
    r.add_argument("--device", choices=("cpu", "cuda"))
    r.add_argument("--out", default="out", help="output directory (default: ./out)")
    r.add_argument("--snapshot", choices=("none", "divergent", "all"), default="divergent")
    r.add_argument("--golden", choices=("check", "require", "off"), default=None,
                   help="check: compare every step with the scenario's golden for this platform where one "
                   "exists (a missing one is reported, not failed); require: a missing golden fails (for "
                   "CI); off: no golden check (default: check; off for --resume-from, whose run starts "
                   "mid-way)")
    r.add_argument("--goldens", default=None, help="golden root (default: $PARITY_GOLDENS or the repo's goldens/)")
    r.add_argument("--allow-other-platform", action="store_true",
                   help="where this platform has no golden, compare with another platform's in the "
                   "approximate tier (loss within 5%%) and print the drift")
    r.add_argument("--junit", metavar="FILE")
    r.add_argument("--fail-fast", action="store_true")
    r.add_argument("--inject", action="append", default=[], metavar="FAULT",
                   help="ulp:STEP:PHASE:PARAM | crash:RANK:STEP[:PHASE] | hang:RANK:STEP[:PHASE] | a catalogue fault")
    r.add_argument("--timeout", type=_positive_float, default=60.0, help="collective timeout in seconds")
    r.add_argument("--allow-nondeterministic", action="store_true",
                   help="run even if the determinism environment contradicts the contract")
    r.add_argument("--quiet", action="store_true")
    r.add_argument("--profile", choices=("cpu", "wall", "ops"),
                   help="profile every rank into OUT/profile/<scenario>/: cpu or wall = cProfile "
                   "(rank<r>.prof, read with `python -m pstats FILE`) on the rank's own CPU time or "
                   "on wall time (waits included); ops = the torch ops each parity function "
                   "dispatched (rank<r>.ops.json, read with `python tools/op_counts.py OUT`)")
    r.add_argument("--resume-at", type=_positive_int, metavar="K",
                   help="checkpoint after K steps, resume in new ranks, compare the rest with the uninterrupted run")
    r.add_argument("--resume-world", type=_positive_int, metavar="W", help="with --resume-at: resume at world W")
    r.add_argument("--resume-from", metavar="DIR", help="run the rest of the scenario from this checkpoint")
    r.add_argument("--reshard", action="store_true",
                   help="with --resume-from: allow a checkpoint saved at another world / ep")

    sub.add_parser("list", help="list the scenarios")

    g = sub.add_parser("golden", help="golden records: check, regen, show",
                       description="check: run each scenario this machine can run (default: all; the "
                       "others are listed with the reason) and compare it with its golden; regen: run and "
                       "record goldens for this platform; show: describe the stored goldens.")
    g.add_argument("action", choices=("check", "regen", "show"))
    g.add_argument("scenarios", nargs="*", metavar="SCENARIO")
    g.add_argument("--goldens", default=None, help="golden root (default: $PARITY_GOLDENS or the repo's goldens/)")
    g.add_argument("--steps", type=_positive_int,
                   help="check: run only the first N steps (a golden prefix; a larger N runs the whole scenario)")
    g.add_argument("--allow-other-platform", action="store_true",
                   help="check: where this platform has no golden, compare with another platform's in the "
                   "approximate tier (loss within 5%%) and print the drift")
    g.add_argument("--accept", action="store_true", help="regen: accept the new records (exit 0)")
    g.add_argument("--only-failing", action="store_true", help="regen: keep goldens that still pass")
    g.add_argument("--out", default="out", help="check: where the runs' records go (default: ./out)")
    g.add_argument("--device", choices=("cpu", "cuda"), help="only the scenarios of this device")

    d = sub.add_parser("diff", help="compare two snapshot files or directories")
    d.add_argument("a")
    d.add_argument("b")

    t = sub.add_parser("triage", help="localize and measure divergence from a run directory")
    t.add_argument("run")
    t.add_argument("--against", default=None, metavar="RUN|golden",
                   help="another run directory, or 'golden': the golden of each scenario")
    t.add_argument("--goldens", default=None, help="golden root (default: $PARITY_GOLDENS or the repo's goldens/)")
    t.add_argument("--allow-other-platform", action="store_true",
                   help="--against golden: use another platform's golden where this one has none")
    t.add_argument("--out", default=None)

    s = sub.add_parser("selftest", help="inject every catalogued fault and show each is caught")
    s.add_argument("faults", nargs="*")
    s.add_argument("--out", default="out/selftest")
    s.add_argument("--matrix", action="store_true",
                   help="inject each fault into every scenario of --set instead: which scenarios catch it, which "
                        "run it unseen, which never reach it (matrix.md / matrix.json in --out)")
    s.add_argument("--set", default=None, metavar="NAME", help="--matrix: the scenario set (default: quick)")
    p.subcommands = {"run": r, "golden": g, "diff": d, "triage": t, "selftest": s}
    return p


def _one_line(text: str, limit: int = 2000) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _sigterm_as_interrupt(signum, frame):
    # A CI runner cancels with SIGTERM: unwind like Ctrl-C, so ranks are stopped and reaped and
    # partial golden writes are cleaned up (ranks also die with us by PR_SET_PDEATHSIG).
    raise KeyboardInterrupt


def main(argv=None) -> int:
    import signal

    from parity.harness.errors import ParityError, UsageError
    from parity.harness.torchrun_env import refuse_restarts, under_torchrun

    # Before torch loads: the CPU pins and one BLAS thread for this process too, so that a torchrun
    # supervisor can fork its rank itself (parity.harness.launch).
    pin_before_torch()
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.cmd == "golden" and not any(e.startswith("-") for e in extra):
        args.scenarios += extra  # names after options: `golden regen --accept NAME...`
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        previous_sigterm, restore = signal.signal(signal.SIGTERM, _sigterm_as_interrupt), True
    except ValueError:  # not the main thread (main() called from a test or an embedding program)
        previous_sigterm, restore = None, False
    job, stdout = None, sys.stdout
    try:
        if args.cmd in ("run", "golden") and under_torchrun():
            refuse_restarts()  # before torch loads: every worker would import it only to refuse
        if args.cmd in _COMMANDS_STARTING_WITH_TORCH:
            import_torch_uncollected()
        job = _torchrun_start(args, argv)
        if job is not None and job.rank != 0:
            sys.stdout = open(os.devnull, "w")  # progress lines come from global rank 0 only
        code = COMMANDS[args.cmd](args, argv)
    except ParityError as e:
        if isinstance(e, UsageError) and args.cmd in getattr(parser, "subcommands", {}):
            parser.subcommands[args.cmd].print_usage(sys.stderr)
        print(f"parity: {_one_line(e)}", file=sys.stderr)
        code = e.exit_code
    except KeyboardInterrupt:
        print("parity: interrupted", file=sys.stderr)
        return EXIT_RUNTIME
    except Exception as e:  # never a traceback for the user; PARITY_DEBUG=1 shows it
        from parity.distributed.env_contract import DeterminismError

        if isinstance(e, BrokenPipeError) and _stdout_reader_gone():
            _stdout_to_devnull()  # nobody reads stdout any more: nothing to say, nowhere to say it
            return EXIT_BROKEN_PIPE
        if isinstance(e, DeterminismError):
            print(f"parity: {_one_line(e)}", file=sys.stderr)
            code = EXIT_USAGE
        else:
            if os.environ.get("PARITY_DEBUG"):
                raise
            print(f"parity: internal error: {type(e).__name__}: {_one_line(e, 500)} "
                  f"(rerun with PARITY_DEBUG=1 for the traceback)", file=sys.stderr)
            code = EXIT_RUNTIME
    finally:
        if sys.stdout is not stdout:
            sys.stdout.close()
            sys.stdout = stdout
        if restore:
            signal.signal(signal.SIGTERM, previous_sigterm if previous_sigterm is not None else signal.SIG_DFL)
    return code if job is None else _torchrun_finish(job, code)


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone (poll reports an error on it), as
    opposed to a broken pipe elsewhere in the command (a rank's), which is a failure to report."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here, or stdout has no descriptor
        return False


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at /dev/null, so that the flush at exit has somewhere to go."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)


_COMMANDS_STARTING_WITH_TORCH = ("golden", "diff", "triage", "selftest")
"""Commands whose first step loads torch. `run` checks its input first, without torch (bad input
is answered in a fraction of a second), and then imports it the same way; `list` never loads it."""


def import_torch_uncollected() -> None:
    """Import torch with the garbage collector off, then move what the process holds out of its
    reach (``gc.freeze``). The import makes a few hundred thousand objects that live as long as
    the process and form no garbage; with the collector on, it walked them again and again during
    the import, and every later full collection (while the golden manifests are parsed, say)
    walked them all. Measured: the import 1.11 -> 0.97 s, reading the 73 golden manifests 0.24 ->
    0.15 s (docs/measurements.md, sixteenth session). Only in a process that has not loaded torch
    yet: a caller that has (a test calling main()) keeps its collector as it is."""
    if "torch" in sys.modules:
        return
    import gc

    gc.disable()
    try:
        import torch  # noqa: F401
    finally:
        gc.enable()
    gc.freeze()


def _torchrun_start(args, argv):
    """Under torchrun, for the commands that launch ranks: this worker's job, after checking that
    every worker runs the same command (they must make the same launches in the same order) and
    that every node has the same determinism environment and torch (else bits differ between nodes
    for reasons no check here would name). None outside torchrun. (A torchrun that would restart
    the job was refused before torch loaded.)"""
    from parity.harness.torchrun_env import under_torchrun

    if args.cmd not in ("run", "golden") or not under_torchrun():
        return None
    import_torch_uncollected()
    import torch

    from parity.distributed.env_contract import DETERMINISM_ENV
    from parity.harness.errors import ConfigError, UsageError
    from parity.harness.launch import torchrun_job

    job = torchrun_job()
    env = {k: os.environ.get(k) for k in sorted(DETERMINISM_ENV)}
    views = job.allgather("start", {"argv": list(argv), "env": env, "torch": torch.__version__})
    for rank, other in enumerate(views):
        if other["argv"] != views[0]["argv"]:
            raise UsageError(f"torchrun workers run different commands: rank 0 `parity {' '.join(views[0]['argv'])}`, "
                             f"rank {rank} `parity {' '.join(other['argv'])}`")
        if other["torch"] != views[0]["torch"]:
            raise ConfigError(f"torchrun workers run different torch versions: rank 0 {views[0]['torch']}, "
                              f"rank {rank} {other['torch']}")
        differ = [k for k in env if other["env"][k] != views[0]["env"][k]]
        if differ:
            k = differ[0]
            raise ConfigError(f"the determinism environment differs between nodes: {k}={views[0]['env'][k]!r} on "
                              f"rank 0, {other['env'][k]!r} on rank {rank} (None: unset); export the same values "
                              f"on every node")
    return job


def _torchrun_finish(job, code: int) -> int:
    """The job's exit code, the same on every worker: rank 0's verdict (it alone saw every rank's
    results and the goldens), unless some worker ended with a usage or runtime error of its own.
    Once every worker knows it (rank 0 wrote the report before), the process exits with it here;
    returns only when the agreement itself fails (a runtime failure)."""
    import signal

    # From here the process only agrees on its exit code (bounded by the timeout) and exits; a
    # SIGTERM from torchrun's agent (another worker of its node returned first and exited) must
    # not turn this worker's exit code into a signal.
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    try:
        codes = job.allgather("exit", code, timeout_s=_TORCHRUN_EXIT_WAIT_S)
    except Exception as e:
        print(f"parity: {_one_line(e)}", file=sys.stderr)
        return EXIT_RUNTIME
    final = max(codes) if any(c in (EXIT_USAGE, EXIT_RUNTIME) for c in codes) else codes[0]
    # Every worker knows the verdict and rank 0 wrote the report: leave now, all together, without
    # the interpreter's teardown (it can take a second under load, and the agent that serves the
    # rendezvous store ends with its own workers: another node's agent still watching workers in
    # teardown then loses the store before it reports their exit codes).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(final)


def _load_file(path: str):
    """load_file, with anything a malformed file makes it raise turned into a ConfigError."""
    from parity.harness.errors import ConfigError, ParityError
    from parity.harness.scenario import load_file

    try:
        return load_file(path)
    except ParityError:
        raise
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ConfigError(f"{path}: invalid scenario file: {type(e).__name__}: {_one_line(e, 300)}") from None


def _resolve_run(args):
    """The scenarios `parity run` runs: the named ones, and those of --set NAME."""
    from parity.harness.scenario import load_set

    if not args.scenario_set:
        return _resolve(args.scenarios)
    named = _resolve(args.scenarios) if args.scenarios else []
    return named + load_set(args.scenario_set)


def _resolve(names: list[str]):
    from parity.harness.errors import UsageError
    from parity.harness.scenario import load_all

    if not names:
        names = [DEFAULT_SCENARIO]
    known = None
    out = []
    for n in names:
        if n.endswith(".toml") or os.path.sep in n:
            out += _load_file(n)
            continue
        known = known if known is not None else {s.name: s for s in load_all()}
        if n not in known:
            close = [k for k in known if n in k][:8]
            raise UsageError(f"unknown scenario {n!r}" + (f"; did you mean: {', '.join(close)}" if close else
                                                          "; `parity list` shows them"))
        out.append(known[n])
    return out


def _apply_overrides(s, args, notes: list[str] | None = None):
    """The scenario with the command line's overrides (renamed ``name[key=value+...]``).

    Settings the flags imply are derived and said in ``notes``: ``--world`` alone lowers the EP to
    the largest divisor of the world that divides the scenario's EP; ``--dense`` sets EP 1."""
    import math

    from parity.harness.errors import UsageError
    from parity.harness.scenario import make_scenario

    notes = [] if notes is None else notes
    raw = s.to_dict()
    changed = {}
    for flag, key in (("recipe", "recipe"), ("layout", "layout"), ("pair", "pair"), ("steps", "steps"),
                      ("microbatches", "microbatches"),
                      ("lr", "lr"), ("seed", "seed"), ("bucket_size", "bucket_size"),
                      ("device", "device"), ("overlap", "overlap"), ("moe", "moe"), ("ep", "ep"),
                      ("resume_at", "resume_at"), ("resume_world", "resume_world")):
        v = getattr(args, flag, None)
        if v is not None:
            changed[key] = v
    if args.dp is not None and args.world is not None and args.dp != args.world:
        raise UsageError("--dp and --world must agree (TP = PP = CP = 1: the world is data parallel)")
    world = args.world if args.world is not None else args.dp
    if world is not None:
        changed["world"] = world
    if changed.get("moe") is False:
        if changed.get("ep", 1) > 1:
            raise UsageError(f"--dense contradicts --ep {changed['ep']} (expert parallelism needs MoE layers)")
        if raw["ep"] != 1:
            changed["ep"] = 1
            notes.append(f"{s.name}: --dense: ep {raw['ep']} -> 1 (a dense model has no experts)")
    if changed.get("ep", 1) > 1:
        changed["moe"] = True
        if world is None:
            changed["world"] = max(changed["ep"], raw["world"]) if raw["world"] % changed["ep"] == 0 \
                else changed["ep"]
    elif world is not None and "ep" not in changed and world % raw["ep"] != 0:
        changed["ep"] = math.gcd(raw["ep"], world)
        notes.append(f"{s.name}: --world {world}: ep {raw['ep']} does not divide it; using ep {changed['ep']}")
    if not changed:
        return s
    pin = s.schedule_pin()
    if "steps" in changed and pin:  # the first steps of the same run (Scenario.prefix)
        raw.update(pin)
        notes.append(f"{s.name}: --steps {changed['steps']}: the {s.lr_decay_style} LR schedule keeps its "
                     f"{s.decay_steps}-step length")
    raw.update(changed)
    suffix = "+".join(f"{k}={v}" for k, v in changed.items())
    raw["name"] = f"{s.name}[{suffix}]"
    return make_scenario(raw, source="command line")


def cmd_run(args, argv) -> int:
    from parity.harness.errors import RuntimeFailure, UsageError
    from parity.harness.faults import parse_injection
    from parity.harness.forkserver import start_early_for
    from parity.harness.torchrun_env import is_report_writer

    # The input first, without torch: bad input is answered in a fraction of a second.
    injections = tuple(parse_injection(s) for s in args.inject)
    notes: list[str] = []
    scenarios = [_apply_overrides(s, args, notes) for s in _resolve_run(args)]
    if not args.quiet:
        for note in notes:
            print(f"[parity] note: {note}", flush=True)
    _check_injections(injections, scenarios)
    if args.resume_from and (len(scenarios) != 1 or scenarios[0].resume_at is not None):
        raise UsageError("--resume-from runs one scenario, without --resume-at / resume_at")
    if args.resume_from and args.golden not in (None, "off"):
        raise UsageError(f"--golden {args.golden} needs every step: it cannot check a run resumed from a checkpoint")
    if args.golden is None:
        args.golden = "off" if args.resume_from else "check"
    if args.reshard and not args.resume_from:
        raise UsageError("--reshard applies to --resume-from (resume_world reshards a resume_at scenario)")
    _check_determinism_env(args.allow_nondeterministic)
    out = _prepare_out(args.out)  # every rank: each writes its own snapshots there
    writer = is_report_writer()  # under torchrun global rank 0 alone writes report, summary, JUnit
    if args.junit and writer:
        _check_writable_file(args.junit, "--junit")
    # the input is valid: a server imports beside us
    start_early_for(scenarios, resume_from=bool(args.resume_from))
    import_torch_uncollected()
    from parity.harness import report as rep
    from parity.harness.driver import run_scenario
    from parity.harness.platform import platform_fingerprint
    from parity.harness.runner import RunOptions

    # Fingerprint every device now: a CUDA scenario without CUDA is refused before any rank starts.
    platforms = {dev: platform_fingerprint(dev, "nccl" if dev == "cuda" else "gloo")
                 for dev in dict.fromkeys(s.device for s in scenarios)}
    found = {}
    if args.golden != "off":  # an unusable golden stops us here, before anything runs
        from parity.harness.goldens_cli import prepare
        found = prepare(scenarios, args.goldens, allow_other_platform=args.allow_other_platform)
    _note_golden_only(injections, scenarios, found)
    opts = RunOptions(injections=injections, snapshot=args.snapshot, out_dir=out,
                      fail_fast=args.fail_fast, golden_digests=args.golden != "off",
                      progress=not args.quiet, profile=args.profile)
    entries, not_fired = [], {}  # scenario -> injected faults whose deviation never ran there
    for s in scenarios:
        if not args.quiet:
            print(f"[parity] {s.name}: {s.pair} pair, {s.recipe}, world {s.world}, ep {s.ep}, "
                  f"{'moe' if s.moe else 'dense'}, overlap {_overlap_words(s)}, "
                  f"{s.layout} layout, {s.steps} step{'s' if s.steps != 1 else ''} on {s.device}", flush=True)
        if args.resume_from:
            from parity.harness.resume import run_from_checkpoint

            entry, results = run_from_checkpoint(s, opts, args.resume_from, args.reshard, timeout_s=args.timeout,
                                                 allow_nondeterministic=args.allow_nondeterministic)
        else:
            entry, results = run_scenario(s, opts, timeout_s=args.timeout,
                                          allow_nondeterministic=args.allow_nondeterministic)
        if s.name in found and entry["status"] != "error":
            from parity.harness.goldens_cli import check
            # every supervisor judges (all exit alike); rank 0 alone writes the run's record
            check(entry, s, results, found[s.name], require=args.golden == "require",
                  out_dir=out if writer else None)
        entries.append(entry)
        _print_entry(entry, args.quiet)
        not_fired[entry["name"]] = _not_fired(injections, entry)
        for name in not_fired[entry["name"]]:
            print(f"  note: --inject {name}: its deviation never ran in this scenario, so nothing of it was "
                  f"tested here", flush=True)
        if args.fail_fast and entry["status"] != "pass":
            break
    meta = {"version": _version(), "argv": ["parity"] + list(argv),
            "platform": platforms[scenarios[0].device]}
    try:
        if writer:
            rep.write_reports(out, entries, meta, args.junit)
    except OSError as e:
        raise RuntimeFailure(f"cannot write the report to {out!r}: {e.strerror or e}") from None
    status = rep.overall_status(entries)
    ran = [e for e in entries if e["status"] != "error"]
    vacuous = [name for name in dict.fromkeys(str(i) for i in injections if i.kind != "ulp")
               if ran and all(name in not_fired[e["name"]] for e in ran)]
    if vacuous and status != "error":  # a pass would read as "the checks missed it"
        from parity.harness.errors import ConfigError
        raise ConfigError(f"--inject {', '.join(vacuous)}: its deviation never ran in "
                          f"{', '.join(e['name'] for e in ran)}, so nothing of it was tested; pick a scenario "
                          f"that reaches it (parity selftest lists one per fault)")
    print(f"[parity] {status}: {sum(e['status'] == 'pass' and e.get('golden') != 'fail' for e in entries)}"
          f"/{len(entries)} scenarios "
          f"passed; report: {os.path.join(out, 'report.json')}")
    return {"pass": EXIT_OK, "fail": EXIT_MISMATCH, "error": EXIT_RUNTIME}[status]


def _note_golden_only(injections, scenarios, found) -> None:
    """A fault that only the golden check sees tests nothing where no golden of this platform is
    checked: say so before the run."""
    from parity.harness.faults import GOLDEN_ONLY_FAULTS

    for inj in (i for i in injections if i.kind == "fault"):
        if inj.name in GOLDEN_ONLY_FAULTS:
            for s in scenarios:
                if not (isinstance(found.get(s.name), tuple) and found[s.name][1] == "exact"):
                    print(f"[parity] note: --inject {inj}: only a golden of this platform can see it, and "
                          f"{s.name} is checked against none (--golden off, none found, or another "
                          f"platform's, which compares the loss alone)", flush=True)


def _overlap_words(s) -> str:
    """The overlap the pair's two sides run with (the overlap pair compares it on with off; the
    force-sync pair runs it on, on both sides)."""
    if s.pair == "overlap_param_gather":
        return "on vs off"
    return "on" if s.overlap or s.pair == "force_sync" else "off"


def _not_fired(injections, entry) -> list[str]:
    """The injected catalogued faults whose deviation never ran in this scenario's run, as the
    ranks' stacks recorded it (parity.vocab.FaultSet), and every crash or hang of a run that ended
    (one that fired ends it in an error: a run that finished never reached its step and phase);
    an errored run tells nothing."""
    if entry["status"] == "error":
        return []
    return [str(i) for i in injections
            if i.kind in ("crash", "hang") or (i.kind == "fault" and str(i) not in entry.get("faults_fired", ()))]


def _print_entry(e, quiet):
    fd = e.get("first_divergence")
    line = f"[parity] {e['name']}: {e['status'].upper()} ({e['compared']} comparisons, {e.get('elapsed_s')} s"
    if e.get("golden", "off") != "off":
        line += f", golden {e['golden']}"
    line += ")"
    print(line, flush=True)
    if fd:
        from parity.harness.report import fmt_divergence
        if fd.get("against") == "uninterrupted":
            how = f"side {fd.get('side')} after the resume != the uninterrupted run: {fmt_divergence(fd)}"
        else:
            how = fmt_divergence(fd)
            how += ", loaded != saved" if fd.get("against") == "saved" else ""
        print(f"  first divergence: step {fd['step']} / {fd['phase']} / {fd['tensor']} / rank {fd['rank']} ({how})")
    if e.get("resume"):
        from parity.harness.resume import describe
        print(f"  {describe(e['resume'])}")
    if e.get("missing_phases"):
        print(f"  phases never compared: {', '.join(e['missing_phases'])}")
    for msg in e.get("golden_messages", [])[: 20 if e.get("golden") == "fail" else 3]:
        print(f"  golden: {msg}")
    for c in e.get("failed_checks", [])[:5]:
        print(f"  check {c['check']} failed: {c['message']}")
    if e["status"] == "error":
        print(f"  error: {e.get('error')}")


def _prepare_out(path: str, what: str = "output directory") -> str:
    from parity.harness.errors import UsageError

    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".parity-write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("x")
            f.flush()
            os.fsync(f.fileno())
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{what} {path!r} is not writable: {e.strerror or e}") from None
    return path


def _check_writable_file(path: str, what: str) -> None:
    """A file the run will write at the end (e.g. --junit): its directory must exist and take files."""
    from parity.harness.errors import UsageError

    if os.path.isdir(path):
        raise UsageError(f"{what} {path!r} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{what} {path!r}: directory {parent!r} does not exist")
    _prepare_out(parent, f"{what} directory")


def _check_determinism_env(allow: bool) -> None:
    """Refuse a determinism environment that contradicts the contract before any rank starts
    (the ranks and the launcher check it too, but only after the scenarios are loaded)."""
    from parity.distributed.env_contract import validate_determinism_env
    from parity.harness.errors import ConfigError

    violations = validate_determinism_env(os.environ)
    if not violations:
        return
    if allow:
        print(f"parity: warning: --allow-nondeterministic: running with {'; '.join(violations)}",
              file=sys.stderr)
        return
    raise ConfigError(f"nondeterministic environment: {'; '.join(violations)} (unset these variables or "
                      f"set an accepted value; --allow-nondeterministic runs anyway)")


def _check_injections(injections, scenarios) -> None:
    """An injection that can never fire would make a fault test pass vacuously."""
    from parity.harness.errors import UsageError

    for inj in injections:
        for s in scenarios:
            if inj.kind in ("crash", "hang") and not 0 <= inj.rank < s.world:
                raise UsageError(f"--inject {inj}: scenario {s.name} has no rank {inj.rank} "
                                 f"(world {s.world}: ranks 0..{s.world - 1})")
            if inj.kind in ("crash", "hang", "ulp") and not 0 <= inj.step < s.steps:
                raise UsageError(f"--inject {inj}: scenario {s.name} has no step {inj.step} "
                                 f"({s.steps} steps: 0..{s.steps - 1})")


def _version() -> str:
    from parity import __version__
    return __version__


def cmd_list(args, argv) -> int:
    from parity.harness.scenario import load_all

    for s in load_all():
        print(f"{s.name:48s} {s.pair:22s} {s.recipe:9s} world={s.world} ep={s.ep} "
              f"{'moe' if s.moe else 'dense'} overlap={'on' if s.overlap else 'off'} {s.layout}")
    return EXIT_OK


def cmd_golden(args, argv) -> int:
    from parity.harness.goldens_cli import default_root, golden_command

    if args.action in ("check", "regen"):
        _check_determinism_env(False)
    if args.action == "regen":
        if args.steps:
            from parity.harness.errors import UsageError
            raise UsageError("--steps is for check: goldens are recorded over the scenario's full length")
        _prepare_out(str(args.goldens or default_root()), "goldens directory")
    return golden_command(args, _resolve)


def cmd_diff(args, argv) -> int:
    from parity.harness.diff import diff_command
    return diff_command(args.a, args.b)


def cmd_triage(args, argv) -> int:
    from parity.harness.triage import triage_command
    return triage_command(args)


def cmd_selftest(args, argv) -> int:
    from parity.harness.forkserver import start_early
    from parity.harness.selftest import selftest_command

    start_early(checkpoints=True)  # the catalogue's checkpoint faults save and load
    return selftest_command(args)


COMMANDS = {"run": cmd_run, "list": cmd_list, "golden": cmd_golden, "diff": cmd_diff,
            "triage": cmd_triage, "selftest": cmd_selftest}

if __name__ == "__main__":
    sys.exit(main())
