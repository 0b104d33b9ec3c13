"""Scenarios: TOML files -> validated, frozen Scenario objects.

A file holds one scenario (top-level keys), a list (``[[scenario]]``), and/or a ``[matrix]`` whose
list-valued keys expand into the cross product (``name`` is a format template over the keys).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from parity.ddp.config import LAYOUTS, DDPConfig
from parity.harness.errors import ConfigError
from parity.harness.faults import SHARED_FAULTS
from parity.model.config import InitEdges, ModelConfig
from parity.optim.config import OptimConfig, StackConfig
from parity.vocab import Recipe

PAIRS = {
    "fp8_param_gather": "FP8 param gather ON vs OFF",
    "overlap_param_gather": "deferred (overlapped) param gather vs eager all-gather, grads reduced under overlap on both",
    "force_sync": "force_sync finalizing a pending gather vs the forward pre-hook",
}
RECIPES = tuple(Recipe)
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Scenario:
    """One lockstep pair: two stacks that must give identical bits every step."""

    name: str
    """Unique name (used for goldens and reports)."""
    recipe: str = "blockwise"
    """FP8 recipe: 'blockwise' (1x128 / 128x128, Hopper) or 'mxfp8' (1x32 E8M0, Blackwell)."""
    world: int = 2
    """Number of ranks (= data-parallel size; TP = PP = CP = 1)."""
    ep: int = 1
    """Expert-parallel size; must divide world. ep > 1 needs moe."""
    moe: bool = False
    """Use MoE layers."""
    overlap: bool = False
    """overlap_grad_reduce and overlap_param_gather."""
    layout: str = "compact"
    """LayerWise buffer layout: 'compact' (decoupled) or 'padded' (shard-aligned)."""
    pair: str = "fp8_param_gather"
    """The knob whose two settings must agree bitwise (see PAIRS)."""
    fp8_param_gather: bool = True
    """FP8 param gather setting of both sides when the pair is another knob."""
    steps: int = 30
    """Training steps."""
    microbatches: int = 1
    """Microbatches per step (gradient accumulation); each draws its own batch."""
    lr: float = 1e-3
    """Learning rate (large on purpose: amplifies differences); the peak of a schedule."""
    lr_decay_style: str = "constant"
    """LR schedule after the warmup: 'constant' or 'cosine' (down to lr_min)."""
    lr_warmup_steps: int = 0
    """Linear warmup steps (step 0 then runs at lr 0, as upstream's scheduler)."""
    lr_decay_steps: int | None = None
    """Steps (warmup included) of the cosine decay; None: the scenario's steps."""
    lr_min: float = 0.0
    """Floor of the cosine decay."""
    clip_grad: float = 0.0
    """Clip grads to this global norm (0: off). Grad norm and zeros are compared either way."""
    num_distributed_optimizer_instances: int = 1
    """DistOpt instances; the LayerWise split allows only 1 (rejected otherwise, as upstream)."""
    seed: int = 1234
    """Seed of init and data."""
    bucket_size: int | None = 4096
    """DDP bucket size in elements under overlap (None: one bucket per buffer); without overlap
    every buffer is one bucket, as upstream's DDP makes it."""
    device: str = "cpu"
    """'cpu' (gloo) or 'cuda' (NCCL, one rank per GPU)."""
    model: dict = field(default_factory=dict)
    """Overrides of ModelConfig fields."""
    optim: dict = field(default_factory=dict)
    """Overrides of the optimizers' settings (OPTIM_KEYS: weight decay, the Muon and Adam
    hyper-parameters); lr, its schedule and the clip are the keys above."""
    stress: tuple = ()
    """Numeric-edge init edits (InitEdges names: zero_blocks, pow2_edge, tiny_values,
    dead_expert); the same edits on both sides."""
    resume_at: int | None = None
    """Checkpoint after this many steps, resume in new rank processes, and require every phase of
    the remaining steps to equal the uninterrupted run bit for bit (parity/harness/resume.py)."""
    resume_world: int | None = None
    """With resume_at: resume at this world (DP) size instead (a resharded load; its bits are not
    compared with the uninterrupted run, the loaded state is compared with the saved one)."""
    golden_tensor_steps: list = field(default_factory=list)
    """Steps whose full tensors (rank 0) the golden stores besides every step's digests, as Python
    indices (-1: the last step); [] (the default) for digests only, so goldens/ stays small; the
    `default` scenario keeps its first and last step. Not part of the golden's identity."""
    source: str = ""
    """File the scenario came from (for messages)."""

    @property
    def dp(self) -> int:
        return self.world

    def model_config(self) -> ModelConfig:
        return ModelConfig(**{"moe": self.moe, **self.model, "edges": InitEdges.from_names(self.stress)})

    def stack_configs(self, faults=frozenset()) -> tuple[StackConfig, StackConfig]:
        """(A, B) = the knob ON and OFF. Faults apply to A (the stack under test) only, but for the
        shared ones (:data:`parity.harness.faults.SHARED_FAULTS`), which apply to both."""
        shared = set(faults) & SHARED_FAULTS
        model = self.model_config()
        optim = self.optim_config()

        def make(fp8: bool, grad_overlap: bool, gather_overlap: bool, force_sync: bool, f) -> StackConfig:
            ddp = DDPConfig(bucket_size=self.bucket_size, overlap_grad_reduce=grad_overlap,
                            overlap_param_gather=gather_overlap, layout=self.layout)
            return StackConfig(model=model, recipe=self.recipe, fp8_param_gather=fp8, ddp=ddp,
                               optim=optim, seed=self.seed, microbatches=self.microbatches,
                               force_sync_each_step=force_sync, faults=frozenset(f))

        if self.pair == "fp8_param_gather":
            o = self.overlap
            return (make(True, o, o, False, faults), make(False, o, o, False, shared))
        if self.pair == "overlap_param_gather":
            # both reduce grads under overlap (one bucket layout: toggling overlap_grad_reduce
            # changes the buckets, and with them the reductions' bits); only the gather differs
            return (make(self.fp8_param_gather, True, True, False, faults),
                    make(self.fp8_param_gather, True, False, False, shared))
        return (make(self.fp8_param_gather, True, True, True, faults),
                make(self.fp8_param_gather, True, True, False, shared))

    def optim_config(self) -> OptimConfig:
        extra = {k: tuple(v) if k == "adam_betas" else v for k, v in self.optim.items()}
        return OptimConfig(lr=self.lr, clip_grad=self.clip_grad, lr_decay_style=self.lr_decay_style,
                           lr_warmup_steps=self.lr_warmup_steps, lr_min=self.lr_min,
                           lr_decay_steps=self.decay_steps,
                           num_distributed_optimizer_instances=self.num_distributed_optimizer_instances,
                           **extra)

    @property
    def decay_steps(self) -> int:
        """The LR schedule's length: ``lr_decay_steps``, else the scenario's steps."""
        return self.steps if self.lr_decay_steps is None else self.lr_decay_steps

    def schedule_pin(self) -> dict:
        """The settings that keep this run's LR schedule when its step count changes (a shorter
        schedule would train differently from the first step on)."""
        return {"lr_decay_steps": self.decay_steps} if self.lr_decay_style != "constant" else {}

    def prefix(self, steps: int, name: str | None = None) -> Scenario:
        """The first ``steps`` steps of this same run."""
        raw = {**self.to_dict(), "name": name or f"{self.name}[steps={steps}]", "steps": steps,
               **self.schedule_pin()}
        return make_scenario(raw, source=self.source)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        if not d["stress"]:
            d.pop("stress")  # a scenario without stress edits keeps its fingerprint (and golden)
        else:
            d["stress"] = list(d["stress"])
        for k in ("resume_at", "resume_world"):  # unset: the scenario is what it was without them
            if d[k] is None:
                d.pop(k)
        if not d["optim"]:
            d.pop("optim")
        return d


TYPES = {"name": str, "recipe": str, "world": int, "ep": int, "moe": bool, "overlap": bool,
         "layout": str, "pair": str, "fp8_param_gather": bool, "steps": int, "microbatches": int,
         "lr": float, "seed": int, "bucket_size": (int, type(None)), "device": str, "model": dict,
         "lr_decay_style": str, "lr_warmup_steps": int, "lr_decay_steps": (int, type(None)),
         "lr_min": float, "clip_grad": float, "num_distributed_optimizer_instances": int,
         "stress": (list, tuple),
         "resume_at": (int, type(None)), "resume_world": (int, type(None)),
         "golden_tensor_steps": list, "optim": dict}

OPTIM_KEYS = {"weight_decay": float, "muon_momentum": float, "muon_nesterov": bool, "muon_ns_steps": int,
              "muon_coefficients": str, "muon_scale_mode": str, "muon_extra_scale_factor": float,
              "muon_split_qkv": bool, "adam_betas": list, "adam_eps": float}
"""The keys of a scenario's ``optim`` table and their types (OptimConfig fields of the same names)."""


def _err(src, key, msg):
    where = f"{src}: " if src else ""
    return ConfigError(f"{where}key '{key}': {msg}")


def _typed(src, key: str, v, want, numbers: bool = False):
    """``v`` checked against ``want`` (a type or a tuple of types), an int widened where a float is
    wanted (a bool is never a number); with ``numbers``, a list must hold numbers only."""
    is_number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    if want is float and is_number(v):
        v = float(v)
    ok = isinstance(v, want) and not (want in (int, float) and isinstance(v, bool))
    if numbers:
        ok = ok and all(is_number(x) for x in v)
    if not ok:
        names = want.__name__ if isinstance(want, type) else " or ".join(t.__name__ for t in want)
        raise _err(src, key, f"expected {'a list of numbers' if numbers else names}, got {type(v).__name__} {v!r}")
    return v


def make_scenario(raw: dict, source: str = "") -> Scenario:
    """Validate one raw mapping into a Scenario; every error names the file, key and what is allowed."""
    raw = dict(raw)
    if raw.get("bucket_size") in ("none", "None"):
        raw["bucket_size"] = None
    for k, v in raw.items():
        if k not in TYPES:
            raise _err(source, k, f"unknown key; allowed keys: {', '.join(sorted(TYPES))}")
        raw[k] = _typed(source, k, v, TYPES[k])
    if "name" not in raw:
        raise _err(source, "name", "missing (every scenario needs a name)")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+=\-\[\]]*", raw["name"]) or ".." in raw["name"]:
        raise _err(source, "name", f"{raw['name']!r}: use letters, digits and _ . + = - [ ] only "
                   f"(it names golden and snapshot directories)")
    if "stress" in raw:
        raw["stress"] = tuple(raw["stress"])
        bad = [v for v in raw["stress"] if v not in InitEdges.names()]
        if bad:
            raise _err(source, "stress", f"{', '.join(map(repr, bad))} not allowed; allowed: "
                       f"{', '.join(InitEdges.names())}")
        if len(set(raw["stress"])) != len(raw["stress"]):
            raise _err(source, "stress", f"duplicate option in {list(raw['stress'])}")
    s = Scenario(**raw, source=source)
    src = source

    def choice(key, allowed):
        if getattr(s, key) not in allowed:
            raise _err(src, key, f"{getattr(s, key)!r} is not allowed; allowed: {', '.join(allowed)}")

    choice("recipe", RECIPES)
    choice("layout", LAYOUTS)
    choice("pair", tuple(PAIRS))
    choice("device", DEVICES)
    for key in ("world", "ep", "steps", "microbatches"):
        if getattr(s, key) < 1:
            raise _err(src, key, f"must be >= 1, got {getattr(s, key)}")
    if s.world % s.ep:
        raise _err(src, "ep", f"ep={s.ep} must divide world={s.world}")
    if s.resume_at is not None and not 1 <= s.resume_at < s.steps:
        raise _err(src, "resume_at", f"must be in 1..{s.steps - 1} (steps = {s.steps}), got {s.resume_at}")
    if s.resume_world is not None:
        if s.resume_at is None:
            raise _err(src, "resume_world", "needs resume_at (the step to checkpoint and resume at)")
        if s.resume_world < 1 or s.resume_world % s.ep:
            raise _err(src, "resume_world", f"must be a positive multiple of ep={s.ep}, got {s.resume_world}")
        if s.pair in ("overlap_param_gather", "force_sync") and s.resume_world < 2:
            raise _err(src, "resume_world", f"pair '{s.pair}' needs world >= 2")
    if s.ep > 1 and not s.moe:
        raise _err(src, "ep", f"ep={s.ep} > 1 needs moe = true")
    if not s.lr > 0:
        raise _err(src, "lr", f"must be > 0, got {s.lr}")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in s.golden_tensor_steps):
        raise _err(src, "golden_tensor_steps", f"must be a list of step indices, got {s.golden_tensor_steps!r}")
    if s.bucket_size is not None and s.bucket_size < 1:
        raise _err(src, "bucket_size", "must be a positive integer or 'none'")
    fp8_on = s.pair == "fp8_param_gather" or s.fp8_param_gather
    if s.layout == "padded" and fp8_on:
        raise _err(src, "layout", "fp8 param gather is supported only on the compact layout; on "
                   "'padded' set pair to 'overlap_param_gather' and fp8_param_gather = false")
    if s.pair in ("overlap_param_gather", "force_sync") and s.world < 2:
        raise _err(src, "pair", f"pair '{s.pair}' needs world >= 2 (no gather at world 1)")
    if s.pair == "force_sync" and s.layout != "compact":
        raise _err(src, "pair", "pair 'force_sync' needs the compact layout")
    allowed_model = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "edges"]
    for k in s.model:
        if k not in allowed_model:
            raise _err(src, f"model.{k}", f"unknown model key; allowed: {', '.join(allowed_model)}")
    try:
        model = s.model_config()
    except (TypeError, ValueError) as e:
        raise _err(src, "model", str(e).replace("model: ", "")) from None
    if s.moe and model.num_experts % s.ep:
        raise _err(src, "ep", f"ep={s.ep} must divide model.num_experts={model.num_experts}")
    for k, v in s.optim.items():
        if k not in OPTIM_KEYS:
            raise _err(src, f"optim.{k}", f"unknown optim key; allowed: {', '.join(OPTIM_KEYS)}")
        s.optim[k] = _typed(src, f"optim.{k}", v, OPTIM_KEYS[k], numbers=OPTIM_KEYS[k] is list)
    try:
        s.optim_config()
    except ValueError as e:
        key = re.match(r"optim\.(\w+)", str(e))
        k = key.group(1) if key else "lr"
        raise _err(src, f"optim.{k}" if k in OPTIM_KEYS else k, str(e)) from None
    if model.fp8_head and s.pair == "fp8_param_gather":
        _check_head_bucket(s, model, src)
    if s.recipe == "mxfp8":
        bad = sorted({d for d in model.matrix_dims() if d % 32})
        if bad:
            raise _err(src, "recipe", f"mxfp8 needs every matrix dimension divisible by 32; "
                       f"model has {bad}")
    try:
        s.stack_configs()
    except ValueError as e:
        raise _err(src, "pair", str(e)) from None
    return s


def _check_head_bucket(s: Scenario, model: ModelConfig, src) -> None:
    """ON keeps the FP8 output projection in a uint8 DistOpt buffer of its own; OFF keeps it in the
    bf16 sibling buffer. The two sides reduce-scatter and shard the same values only if the head
    (and any sibling matrix laid out before it) closes a DistOpt bucket by itself in OFF too."""
    sizes = [model.vocab_size * model.hidden] + ([model.hidden * model.hidden] if model.adam_matrix else [])
    if max(s.world, s.resume_world or 0) == 1:
        return  # one shard: nothing to split
    if not s.overlap:
        raise _err(src, "overlap", "model.fp8_head at world > 1 needs overlap = true: without "
                   "overlap_grad_reduce each buffer is one bucket (as upstream), so ON's uint8 buffer "
                   "moves the shard boundaries of OFF's bf16 sibling buffer, and with them each rank's "
                   "partial sums of the grad norm (docs/spec/megatron.md s2.16)")
    if s.bucket_size is None or s.bucket_size > min(sizes):
        raise _err(src, "bucket_size", f"model.fp8_head needs bucket_size <= {min(sizes)} so the output "
                   f"projection has a DistOpt bucket of its own ON and OFF; otherwise ON's uint8 buffer "
                   f"splits the sibling reduce-scatter into other shards than OFF's bf16 buffer")


def load_file(path) -> list[Scenario]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read scenario file ({e.strerror})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None
    src = str(path)
    raws: list[dict] = []
    matrix = data.pop("matrix", None)
    listed = data.pop("scenario", None)
    if listed is not None:
        if not isinstance(listed, list):
            raise _err(src, "scenario", "must be an array of tables ([[scenario]])")
        raws += listed
    if matrix is not None:
        raws += _expand(matrix, src)
    if data:
        raws.append(data)
    if not raws:
        raise ConfigError(f"{path}: no scenario in file")
    out = [make_scenario(r, src) for r in raws]
    names = [s.name for s in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise _err(src, "name", f"duplicate scenario names: {sorted(dup)}")
    return out


def _expand(matrix: dict, src) -> list[dict]:
    if "name" not in matrix or not isinstance(matrix["name"], str):
        raise _err(src, "matrix.name", "a matrix needs a name template such as '{recipe}-ep{ep}'")
    def is_axis(k, v):  # lists are axes, except keys whose value is itself a list
        if k in ("exclude", "golden_tensor_steps") or not isinstance(v, list):
            return False
        return k != "stress" or bool(v) and all(isinstance(x, list) for x in v)

    axes = {k: v for k, v in matrix.items() if is_axis(k, v)}
    fixed = {k: v for k, v in matrix.items() if not is_axis(k, v) and k not in ("name", "exclude")}
    excludes = matrix.get("exclude", [])
    out = []
    for combo in itertools.product(*axes.values()):
        raw = {**fixed, **dict(zip(axes, combo))}
        kind = raw.pop("kind", None)
        if kind is not None:
            if kind not in ("dense", "moe"):
                raise _err(src, "matrix.kind", f"{kind!r} is not allowed; allowed: dense, moe")
            raw["moe"] = kind == "moe"
        if any(all((kind if k == "kind" else raw.get(k)) == v for k, v in ex.items()) for ex in excludes):
            continue
        try:
            raw["name"] = matrix["name"].format(kind=kind, **{k: _fmt(v) for k, v in raw.items()})
        except KeyError as e:
            raise _err(src, "matrix.name", f"template names unknown key {e}") from None
        out.append(raw)
    return out


def _fmt(v):
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, list):
        return "+".join(map(str, v)) or "none"
    return v


def scenario_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "scenarios"


def load_set(name: str, directory=None) -> list[Scenario]:
    """A scenario set: every scenario of ``scenarios/<name>.toml`` (e.g. ``quick``, ``stress``)."""
    d = Path(directory) if directory else scenario_dir()
    path = d / f"{name}.toml"
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not path.is_file():
        known = sorted(f.stem for f in d.glob("*.toml"))
        raise ConfigError(f"--set {name}: no such scenario set; known sets: {', '.join(known)}")
    return load_file(path)


def load_all(directory=None) -> list[Scenario]:
    d = Path(directory) if directory else scenario_dir()
    out = []
    for f in sorted(d.glob("*.toml")):
        out += load_file(f)
    return out
