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

from parity.ddp.ddp import DDPConfig
from parity.harness.errors import ConfigError
from parity.model import ModelConfig
from parity.optim.stack import OptimConfig, StackConfig
from parity.vocab import Recipe

PAIRS = {
    "fp8_param_gather": "FP8 param gather ON vs OFF",
    "overlap_param_gather": "deferred (overlapped) param gather vs eager all-gather",
    "force_sync": "force_sync finalizing a pending gather vs the forward pre-hook",
}
RECIPES = tuple(Recipe)
LAYOUTS = ("compact", "padded")
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
    lr: float = 1e-3
    """Learning rate (large on purpose: amplifies differences)."""
    seed: int = 1234
    """Seed of init and data."""
    bucket_size: int | None = 4096
    """DDP bucket size in elements (None: one bucket per buffer)."""
    device: str = "cpu"
    """'cpu' (gloo) or 'cuda' (NCCL, one rank per GPU)."""
    model: dict = field(default_factory=dict)
    """Overrides of ModelConfig fields."""
    golden_tensor_steps: list = field(default_factory=lambda: [0, -1])
    """Steps whose full tensors (rank 0) the golden stores besides every step's digests, as Python
    indices (-1: the last step); [] for digests only. Not part of the golden's identity."""
    source: str = ""
    """File the scenario came from (for messages)."""

    @property
    def dp(self) -> int:
        return self.world

    def model_config(self) -> ModelConfig:
        return ModelConfig(**{"moe": self.moe, **self.model})

    def stack_configs(self, faults=frozenset()) -> tuple[StackConfig, StackConfig]:
        """(A, B) = the knob ON and OFF. Faults apply to A (the stack under test) only."""
        model = self.model_config()
        optim = OptimConfig(lr=self.lr)

        def make(fp8: bool, overlap: bool, force_sync: bool, f) -> StackConfig:
            ddp = DDPConfig(bucket_size=self.bucket_size, overlap_grad_reduce=overlap,
                            overlap_param_gather=overlap, layout=self.layout)
            return StackConfig(model=model, recipe=self.recipe, fp8_param_gather=fp8, ddp=ddp,
                               optim=optim, seed=self.seed, force_sync_each_step=force_sync,
                               faults=frozenset(f))

        if self.pair == "fp8_param_gather":
            return (make(True, self.overlap, False, faults), make(False, self.overlap, False, ()))
        if self.pair == "overlap_param_gather":
            return (make(self.fp8_param_gather, True, False, faults),
                    make(self.fp8_param_gather, False, False, ()))
        return (make(self.fp8_param_gather, True, True, faults),
                make(self.fp8_param_gather, True, False, ()))

    def fingerprint(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("source")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


FIELDS = {f.name: f for f in dataclasses.fields(Scenario)}
TYPES = {"name": str, "recipe": str, "world": int, "ep": int, "moe": bool, "overlap": bool,
         "layout": str, "pair": str, "fp8_param_gather": bool, "steps": int, "lr": float,
         "seed": int, "bucket_size": (int, type(None)), "device": str, "model": dict,
         "golden_tensor_steps": list}


def _err(src, key, msg):
    where = f"{src}: " if src else ""
    return ConfigError(f"{where}key '{key}': {msg}")


def make_scenario(raw: dict, source: str = "") -> Scenario:
    """Validate one raw mapping into a Scenario; every error names the file, key and what is allowed."""
    raw = dict(raw)
    if raw.get("bucket_size") in ("none", "None"):
        raw["bucket_size"] = None
    for k, v in raw.items():
        if k not in TYPES:
            raise _err(source, k, f"unknown key; allowed keys: {', '.join(sorted(TYPES))}")
        want = TYPES[k]
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = raw[k] = float(v)
        ok = isinstance(v, want) and not (want in (int, float) and isinstance(v, bool))
        if not ok:
            names = want.__name__ if isinstance(want, type) else " or ".join(t.__name__ for t in want)
            raise _err(source, k, f"expected {names}, got {type(v).__name__} {v!r}")
    if "name" not in raw:
        raise _err(source, "name", "missing (every scenario needs a name)")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+=\-\[\]]*", raw["name"]) or ".." in raw["name"]:
        raise _err(source, "name", f"{raw['name']!r}: use letters, digits and _ . + = - [ ] only "
                   f"(it names golden and snapshot directories)")
    s = Scenario(**raw, source=source)
    src = source

    def choice(key, allowed):
        if getattr(s, key) not in allowed:
            raise _err(src, key, f"{getattr(s, key)!r} is not allowed; allowed: {', '.join(allowed)}")

    choice("recipe", RECIPES)
    choice("layout", LAYOUTS)
    choice("pair", tuple(PAIRS))
    choice("device", DEVICES)
    for key in ("world", "ep", "steps"):
        if getattr(s, key) < 1:
            raise _err(src, key, f"must be >= 1, got {getattr(s, key)}")
    if s.world % s.ep:
        raise _err(src, "ep", f"ep={s.ep} must divide world={s.world}")
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
    allowed_model = [f.name for f in dataclasses.fields(ModelConfig)]
    for k in s.model:
        if k not in allowed_model:
            raise _err(src, f"model.{k}", f"unknown model key; allowed: {', '.join(allowed_model)}")
    try:
        model = s.model_config()
    except (TypeError, ValueError) as e:
        raise _err(src, "model", str(e).replace("model: ", "")) from None
    if s.moe and model.num_experts % s.ep:
        raise _err(src, "ep", f"ep={s.ep} must divide model.num_experts={model.num_experts}")
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
    # Lists are axes, except the keys whose value is itself a list.
    axes = {k: v for k, v in matrix.items() if isinstance(v, list) and k not in ("exclude", "golden_tensor_steps")}
    fixed = {k: v for k, v in matrix.items() if k not in axes and k not in ("name", "exclude")}
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
    return v


def scenario_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "scenarios"


def load_all(directory=None) -> list[Scenario]:
    d = Path(directory) if directory else scenario_dir()
    out = []
    for f in sorted(d.glob("*.toml")):
        out += load_file(f)
    return out
