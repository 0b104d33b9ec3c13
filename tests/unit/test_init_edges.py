"""The stress init edits (parity/model/edges.py): the blocks really are zero, on the pow2 edge or
tiny, as the quantizer itself sees them; ON and OFF start from the same bits; the dead expert is
never routed; the scenario key validates."""

import glob
import json
import math
import os

import pytest
import torch

from parity.fp8 import quantize
from parity.fp8.quantize import blockwise_scale_from_amax, mxfp8_e8m0_from_amax
from parity.harness import golden
from parity.harness.errors import ConfigError
from parity.harness.scenario import load_all, make_scenario
from parity.model import GPT, ModelConfig, is_quantized_param
from parity.model.config import InitEdges
from parity.model.edges import (
    EDGE_POSITIONS,
    TILE,
    TINY_AMAX,
    TINY_KINDS,
    _bf16_step,
    block_states,
    edge_value,
    pow2_boundary,
)
from parity.model.fp8_linear import quantize_weight

ALL = InitEdges(zero_blocks=True, pow2_edge=True, tiny_values=True, dead_expert=True)
RECIPES = ("blockwise", "mxfp8")


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.uint8: torch.uint8}
    return t.contiguous().view(ints[t.dtype])


def models(recipe, edges=ALL, **kw):
    cfg = ModelConfig(moe=True, moe_ffn_hidden=256, edges=edges, **kw)
    on = GPT(cfg, recipe=recipe, fp8_param=True, seed=7)
    off = GPT(cfg, recipe=recipe, fp8_param=False, seed=7)
    return cfg, on, off


def fp8_weights(model):
    return {n: p for n, p in model.named_parameters() if is_quantized_param(p)}


def scale_code(amax: float, recipe: str) -> int:
    a = torch.tensor([amax], dtype=torch.float32)
    if recipe == "blockwise":
        _, scale_inv = blockwise_scale_from_amax(a, "e4m3", torch.bfloat16)
        return int(scale_inv.view(torch.int32))
    return int(mxfp8_e8m0_from_amax(a, "e4m3"))


@pytest.fixture(scope="module", params=RECIPES)
def built(request):
    return (request.param, *models(request.param))


# ---------------------------------------------------------------------------------- the edge itself

@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("amax", [0.0123, 0.08, 0.109375, 1.0, 3.3e-3])
def test_one_ulp_across_the_boundary_flips_the_scale(recipe, amax):
    """'below' and 'at' share the larger scale; one bf16 ULP more ('above') flips it, by one
    power of two, in the recipe's own scale rule."""
    below, at, above = (edge_value(amax, p) for p in EDGE_POSITIONS)
    assert _bf16_step(below, 1) == at and _bf16_step(at, 1) == above
    assert pow2_boundary(amax) == at <= amax < 2 * at
    assert scale_code(below, recipe) == scale_code(at, recipe)
    assert scale_code(above, recipe) != scale_code(at, recipe)
    if recipe == "blockwise":  # scale_inv doubles: one exponent step
        assert scale_code(above, recipe) - scale_code(at, recipe) == 1 << 23
    else:
        assert scale_code(above, recipe) - scale_code(at, recipe) == 1


def test_the_boundary_is_exact_at_every_power_of_two():
    """448 * 2^k is its own boundary and one ULP less belongs to the boundary below, from the tiny
    kinds' range (the 2^127 scale cap) up to bf16's largest values, and for any float, not only bf16."""
    for k in range(-140, 120):
        b = math.ldexp(448.0, k)
        assert pow2_boundary(b) == b, k
        assert pow2_boundary(math.nextafter(b, 0.0)) == b / 2, k
        assert pow2_boundary(math.nextafter(2 * b, 0.0)) == b, k
        assert pow2_boundary(_bf16_step(b, 1)) == b and pow2_boundary(_bf16_step(b, -1)) == b / 2, k


def test_unknown_edges_are_refused():
    with pytest.raises(ValueError, match="allowed: zero_blocks, pow2_edge, tiny_values, dead_expert"):
        InitEdges.from_names(["zero_blocks", "pow2"])
    with pytest.raises(ValueError, match="dead_expert' needs moe"):
        ModelConfig(edges=InitEdges(dead_expert=True))
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig(moe=True, num_experts=2, moe_topk=2, edges=InitEdges(dead_expert=True))


# ---------------------------------------------------------------------------------- ON == OFF bits

def test_on_and_off_start_from_the_same_bits(built):
    recipe, _, on, off = built
    off_params = dict(off.named_parameters())
    on_fp8 = fp8_weights(on)
    assert on_fp8
    for name, p in on.named_parameters():
        q = off_params[name]
        if name in on_fp8:
            # the preserved init (seeds ON's master) is OFF's bf16 weight, bit for bit ...
            assert torch.equal(bits(p.get_high_precision_init_val()), bits(q.detach())), name
            # ... and ON's persisted FP8 bytes and scales are OFF's on-the-fly quantization
            want = quantize_weight(q.detach(), recipe).raw_parts()
            for part, t in p.qt.raw_parts().items():
                assert torch.equal(bits(t), bits(want[part])), (name, part)
        else:
            assert torch.equal(bits(p.detach()), bits(q.detach())), name


def test_edits_are_a_function_of_the_seed_only():
    a = dict(models("mxfp8")[2].named_parameters())
    b = dict(models("mxfp8")[2].named_parameters())
    assert all(torch.equal(bits(a[n].detach()), bits(b[n].detach())) for n in a)
    plain = dict(models("mxfp8", edges=InitEdges())[2].named_parameters())
    changed = [n for n in a if not torch.equal(bits(a[n].detach()), bits(plain[n].detach()))]
    assert changed and all(n.endswith(("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight"))
                           for n in changed)


def test_no_edges_leave_the_init_untouched():
    """Without stress options the init is the plain one (existing goldens stay valid)."""
    plain = GPT(ModelConfig(moe=True), recipe="blockwise", fp8_param=False, seed=3)
    from parity.model.gpt import init_value
    w = plain.layers[0].attn.qkv.weight
    assert torch.equal(bits(w.detach()),
                       bits(init_value(3, "layers.0.attn.qkv.weight", tuple(w.shape), 0.02).to(torch.bfloat16)))
    assert plain.layers[1].mlp.selection_bias is None


# ---------------------------------------------------------------------------------- the edges, as quantized

def states(model, recipe):
    return {n: block_states(quantize_weight(p.detach(), recipe)) for n, p in model.named_parameters()
            if n.endswith(("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight"))}


def test_zero_blocks_are_whole_blocks_in_both_orientations(built):
    recipe, cfg, _, off = built
    st = states(off, recipe)
    # blockwise 128x128: fc1 [512, 128] tiles (0, 2) = gate and up rows of the dead units;
    # fc2 [128, 256] tile 0 = their columns; attn.proj [128, 128] its only tile
    if recipe == "blockwise":
        assert st["layers.0.mlp.fc1.weight"]["zero"].tolist() == [True, False, True, False]
        assert st["layers.0.mlp.fc2.weight"]["zero"].tolist() == [True, False]
        assert st["layers.1.mlp.experts.0.fc2.weight"]["zero"].tolist() == [True, False]
        assert st["layers.0.attn.proj.weight"]["zero"].all()
    # mxfp8: rowwise 1x32 and columnwise 32x1 blocks of the same stripe are zero
    w = dict(off.named_parameters())["layers.0.mlp.fc1.weight"].detach()
    assert int(torch.count_nonzero(w[:128])) == 0 and int(torch.count_nonzero(w[256:384])) == 0
    assert int(torch.count_nonzero(w[128:256])) > 0
    if recipe == "mxfp8":
        z = st["layers.0.mlp.fc1.weight"]["zero"]
        rows, cols = z[: 512 * 4].view(512, 4), z[512 * 4:].view(16, 128)
        assert rows[:128].all() and rows[256:384].all() and not rows[128:256].any()
        assert cols[:4].all() and cols[8:12].all() and not cols[4:8].any()
    dead = f"layers.1.mlp.experts.{cfg.num_experts - 1}.fc1.weight"
    assert st[dead]["zero"].all()


def _edge_amax(a: float) -> bool:
    b = pow2_boundary(a)
    return a in (b, _bf16_step(b, 1)) or pow2_boundary(_bf16_step(a, 1)) == _bf16_step(a, 1)


def test_every_other_block_sits_on_a_pow2_edge(built):
    """Every block that is neither zero nor tiny has its amax one ULP around a boundary, for the
    recipe's own blocks (mxfp8: every 1x32 AND every 32x1 block)."""
    recipe, _, _, off = built
    seen = 0
    for name, p in off.named_parameters():
        if not name.endswith(("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight")):
            continue
        w = p.detach().float().abs()
        M, K = w.shape
        if recipe == "blockwise":
            amaxes = w.view(M // 128, 128, K // 128, 128).amax(dim=(1, 3)).reshape(-1)
        else:
            amaxes = torch.cat([w.view(M, K // 32, 32).amax(2).reshape(-1),
                                w.view(M // 32, 32, K).amax(1).reshape(-1)])
        for a in amaxes.tolist():
            if a == 0.0 or a <= TINY_AMAX["cap"]:
                continue
            assert _edge_amax(a), (name, a)
            seen += 1
    assert seen > (20 if recipe == "blockwise" else 5000)


def test_tiny_blocks_reach_the_clamp_and_hold_subnormals(built):
    recipe, cfg, _, off = built
    st = states(off, recipe)
    for i in range(cfg.num_layers):
        assert st[f"layers.{i}.attn.qkv.weight"]["clamp"].any()
    assert st[f"layers.1.mlp.experts.{cfg.num_experts - 1}.fc2.weight"]["clamp"].any()
    subnormal = 0
    for w in (off.layers[0].attn.qkv.weight, off.layers[1].attn.qkv.weight,
              off.layers[1].mlp.experts[str(cfg.num_experts - 1)].fc2.weight):
        a = w.detach().float().abs()
        subnormal += int(((a > 0) & (a < torch.finfo(torch.bfloat16).tiny)).sum())
    assert subnormal > 100
    # each layer's tiny tile has exactly its kind's amax (the element that carries it is set, not
    # left to the rescale's roundings)
    t = TILE[recipe]
    for i in range(cfg.num_layers):
        w = off.layers[i].attn.qkv.weight.detach().float()
        rows, cols = w.shape
        tile = w[(rows - 1) // t * t:, (cols - 1) // t * t:]
        assert float(tile.abs().max()) == TINY_AMAX[TINY_KINDS[i % len(TINY_KINDS)]], i
    if recipe == "blockwise":  # scale at the 2^127 cap: scale_inv 2^-127, an fp32 subnormal
        qt = quantize_weight(off.layers[0].attn.qkv.weight.detach(), recipe)
        assert float(qt.rowwise_scale_inv[2, 0]) == 2.0 ** -127


def test_dead_expert_is_never_routed(built):
    recipe, cfg, _, off = built
    dead = cfg.num_experts - 1
    seen = []
    moe = off.layers[1].mlp
    for e, m in moe.experts.items():
        m.register_forward_pre_hook(lambda mod, args, e=int(e): seen.append((e, args[0].shape[0])))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g)
    off(tokens, tokens)
    rows = dict(seen)
    assert rows[dead] == 0
    assert sum(rows.values()) == 4 * cfg.seq_len * cfg.moe_topk


def test_selection_bias_keeps_the_router_probabilities_as_weights():
    from torch import nn

    from parity.model.moe import MoE

    class Scaled(nn.Module):  # an expert that returns its rows scaled by their routing probs
        def forward(self, x, p):
            return x * p

    torch.manual_seed(0)
    r = torch.randn(4, 16) * 0.3
    experts = {e: Scaled() for e in range(4)}
    plain = MoE(r, experts, 4, 2, 1, 0, None)
    masked = MoE(r, experts, 4, 2, 1, 0, None, dead_experts=(3,))
    h = torch.randn(64, 16).to(torch.bfloat16)
    top2 = plain.router(h).topk(2).indices
    if int((top2 == 3).sum()) == 0:
        pytest.skip("expert 3 never in the top 2 for this draw")
    out_plain, out_masked = plain(h), masked(h)
    keep = ~(top2 == 3).any(-1)  # tokens whose top 2 never held expert 3
    assert torch.equal(bits(out_plain[keep]), bits(out_masked[keep]))
    assert not torch.equal(bits(out_plain[~keep]), bits(out_masked[~keep]))


# ---------------------------------------------------------------------------------- scenario key

def test_scenario_key_validates_with_one_clear_message():
    with pytest.raises(ConfigError, match=r"key 'stress': 'pow2' not allowed; allowed: zero_blocks"):
        make_scenario({"name": "x", "stress": ["pow2"]})
    with pytest.raises(ConfigError, match="key 'stress': expected list or tuple"):
        make_scenario({"name": "x", "stress": "pow2_edge"})
    with pytest.raises(ConfigError, match="dead_expert' needs moe"):
        make_scenario({"name": "x", "stress": ["dead_expert"]})
    with pytest.raises(ConfigError, match="key 'model.edges': unknown model key"):
        make_scenario({"name": "x", "model": {"edges": {}}})
    s = make_scenario({"name": "x", "moe": True, "stress": ["dead_expert", "tiny_values"]})
    assert s.model_config().edges == InitEdges(dead_expert=True, tiny_values=True)
    assert s.to_dict()["stress"] == ["dead_expert", "tiny_values"]
    assert make_scenario(s.to_dict()).fingerprint() == s.fingerprint()
    assert s.fingerprint() != make_scenario({"name": "x", "moe": True}).fingerprint()


def test_scenarios_without_stress_keep_their_golden_fingerprints():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "goldens")
    by_name = {s.name: s for s in load_all()}
    checked = 0
    for m in glob.glob(os.path.join(root, "*", "*", "manifest.json")):
        name = os.path.basename(os.path.dirname(os.path.dirname(m)))
        s = by_name.get(name)
        if s is None or s.stress:
            continue
        manifest = json.load(open(m))
        if manifest.get("format_version") != golden.GOLDEN_FORMAT_VERSION:
            continue  # an old-format golden awaiting regeneration on its platform (world-2 CUDA)
        want = golden.fingerprint(golden.scenario_config(s))  # the golden's identity of the scenario
        assert manifest["fingerprint"] == want, name
        checked += 1
    if checked == 0:
        pytest.skip("no golden manifests to compare with")


def test_the_stress_set_is_shipped_small_and_covers_the_edges():
    stress = [s for s in load_all() if s.source.endswith("stress.toml")]
    assert {s.recipe for s in stress} == {"blockwise", "mxfp8"}
    assert {s.moe for s in stress} == {False, True}
    assert all(2 <= s.world <= 4 and 4 <= s.steps <= 8 and s.lr >= 1e-2 for s in stress)
    assert all({"zero_blocks", "pow2_edge", "tiny_values"} <= set(s.stress) for s in stress)
    assert all("dead_expert" in s.stress for s in stress if s.moe)
    assert any(s.overlap for s in stress) and any(s.moe and s.world == s.ep for s in stress)


def test_quantize_sees_zero_and_tiny_blocks_as_the_spec_says():
    """block_states reads the rules of docs/spec/te.md s1.2 / s2.2 back from real quantizations."""
    x = torch.randn(256, 256) * 0.02
    x[:128, :128] = 0
    x[128:, 128:] *= 2.0 ** -123 / float(x[128:, 128:].abs().max())
    x = x.to(torch.bfloat16)
    st = block_states(quantize(x, "blockwise", block="128x128"))
    assert st["zero"].tolist() == [True, False, False, False]
    assert st["clamp"].tolist() == [False, False, False, True]
    st = block_states(quantize(x, "mxfp8"))
    n = 256 * 8
    assert st["zero"][:n].view(256, 8)[:128, :4].all() and st["zero"][n:].view(8, 256)[:4, :128].all()
    assert st["clamp"][:n].view(256, 8)[128:, 4:].all() and not st["clamp"][:n].view(256, 8)[:128].any()


def test_flip_counter_tells_pow2_flips_from_blocks_leaving_zero():
    from parity.model.edges import FlipCounter

    x = torch.randn(256, 256) * 0.02
    x[:128, :128] = 0
    b = pow2_boundary(float(x[128:, :128].abs().max()))
    x[128:, :128] *= b / float(x[128:, :128].abs().max())  # amax exactly on the boundary
    x = x.to(torch.bfloat16)
    x[128:, 128:] = (x[128:, 128:].float() * (2.0 ** -123 / float(x[128:, 128:].abs().max()))).bfloat16()  # clamps
    qt = quantize_weight(x, "blockwise")
    c = FlipCounter()
    first = c.observe([("w", qt)])
    assert (first["flips"], first["unzeroed"], first["zero"], first["clamp"], first["blocks"]) == (0, 0, 1, 1, 4)
    y = x.clone()
    y[:128, :128] = 0.01                            # leaves the zero rule
    y[128, 0] = _bf16_step(b, 1)                   # the tile's amax one ULP above the boundary
    y[:128, 128:] *= 1.0 + 2.0 ** -8               # too little to cross a boundary
    qt.requantize_(y)
    second = c.observe([("w", qt)])
    assert (second["flips"], second["unzeroed"], second["zero"]) == (1, 1, 0)
    assert second["flipped"] == {"w": 1}


def test_stress_in_a_matrix_is_a_value_or_an_axis(tmp_path):
    from parity.harness.scenario import load_file

    f = tmp_path / "m.toml"
    f.write_text('[matrix]\nname = "s-{recipe}-{stress}"\nrecipe = ["blockwise", "mxfp8"]\n'
                 'stress = ["pow2_edge", "zero_blocks"]\n')
    got = {s.name: s.stress for s in load_file(f)}
    assert got == {"s-blockwise-pow2_edge+zero_blocks": ("pow2_edge", "zero_blocks"),
                   "s-mxfp8-pow2_edge+zero_blocks": ("pow2_edge", "zero_blocks")}
    f.write_text('[matrix]\nname = "s-{stress}"\nstress = [[], ["tiny_values"]]\n')
    assert {s.name: s.stress for s in load_file(f)} == {"s-none": (), "s-tiny_values": ("tiny_values",)}
