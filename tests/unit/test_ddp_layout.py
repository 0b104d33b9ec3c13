"""Buffer grouping (merge rule), the three layouts, and ping-pong ownership."""

import torch

from parity.ddp.layout import (
    compact_layout,
    distopt_layout,
    group_params_for_buffers,
    padded_layer_wise_layout,
)
from parity.model import GPT, ModelConfig
from parity.optim.layerwise import ping_pong


def _params(*sizes):
    return [torch.nn.Parameter(torch.zeros(n)) for n in sizes]


def test_compact_layout_reverse_order_no_padding_bucket_closes_at_size():
    ps = _params(10, 20, 30, 40)
    lay = compact_layout(ps, bucket_size=45)
    # Reverse order: the last param sits at offset 0.
    assert lay.index[ps[3]] == (0, 40, 0)
    assert lay.index[ps[2]] == (40, 70, 0)   # bucket 0 closes at 70 >= 45
    assert lay.index[ps[1]] == (70, 90, 1)
    assert lay.index[ps[0]] == (90, 100, 1)
    assert lay.buckets == [(0, 70), (70, 100)]
    assert lay.numel == lay.numel_unpadded == 100 and lay.padding == 0
    assert compact_layout(ps, None).buckets == [(0, 100)]


def test_distopt_layout_aligned_starts_and_padded_bucket_ends():
    ps = _params(10, 100, 7)
    lay = distopt_layout(ps, bucket_size=None, dp=4)
    starts = [lay.index[p][0] for p in ps]
    assert all(s % 64 == 0 for s in starts)
    (b,) = lay.buckets
    assert (b[1] - b[0]) % 128 == 0 and lay.numel % 4 == 0
    assert lay.numel_unpadded == 117 and lay.padding > 0


def test_distopt_layout_closes_a_bucket_that_reaches_bucket_size_exactly():
    """A bucket closes once it holds >= bucket_size elements (docs/spec/megatron.md s2.5), at
    equality too: 64 + 64 fill a 128-element bucket, and the next param opens a new one."""
    ps = _params(10, 64, 64)  # laid out in reverse: 64, 64, then 10
    lay = distopt_layout(ps, bucket_size=128, dp=2)
    assert lay.buckets == [(0, 128), (128, 256)]
    assert lay.index[ps[0]] == (128, 138, 1)


def test_padded_layout_keeps_params_inside_one_shard():
    ps = _params(300, 200, 100, 50)
    dp = 4
    lay = padded_layer_wise_layout(ps, bucket_size=None, dp=dp)
    (b,) = lay.buckets
    shard = (b[1] - b[0]) // dp
    for p in ps:
        s, e, _ = lay.index[p]
        owner = (s - b[0]) // shard
        assert (e - 1 - b[0]) // shard == owner == lay.shard_owner[p]
    assert lay.padding > 0  # every shard is as big as the fullest one


def test_padded_layout_chunks_absorbs_and_places_as_upstream():
    """Worked by hand from docs/spec/megatron.md s2.2 (c), dp 2, bucket_size 100, 1-D params (cost
    = numel), backprop order p4 p3 p2 p1 p0 then p5 p6 (params are given in forward order).

    Chunk 1: after a=64 b=32 c=32 it holds 128 >= max(100, 0.9*2*64) and the estimate is
    [64, 96]; d=16 fits the padding (64 + 16 <= 128), so it is absorbed, not a new bucket; e=48
    would grow it (128 + 48 > 128) and closes it. Packing chunk 1 (cap 144/2*1.3 = 93.6): a -> 0,
    b -> 1 (0 is over the cap), c fits neither, so onto the emptier 1, d -> 0. Shards are 128.
    Chunk 2 [e, f] (cap 62.4): e fits both and goes to shard 1, whose carried cost (64) is below
    shard 0's (80); f then fits only shard 0."""
    f, e, d, c, b, a = _params(48, 48, 16, 32, 32, 64)
    lay = padded_layer_wise_layout([f, e, d, c, b, a], bucket_size=100, dp=2)
    assert lay.buckets == [(0, 256), (256, 384)]
    assert [lay.index[p] for p in (a, d, b, c)] == [(0, 64, 0), (64, 80, 0), (128, 160, 0), (192, 224, 0)]
    assert lay.index[e] == (320, 368, 1) and lay.index[f] == (256, 304, 1)
    assert [lay.shard_owner[p] for p in (a, b, c, d, e, f)] == [0, 1, 1, 0, 1, 0]
    assert lay.numel_unpadded == 240 and lay.numel == 384


def test_padded_layout_bounds_are_inclusive():
    """Both of s2.2 (c)'s bounds at equality, where `<` and `<=` part ways.

    The chunk's soft minimum is "at least": with bucket_size 128, dp 2 and backprop order a, b, c
    (64 each), a chunk holding a and b has exactly 128 >= max(128, 0.9*2*64), and c would grow
    it (estimate [64, 64]: 64 + 64 > 64), so c starts a second bucket.

    The packing cap is "stays within": x (16x28, cost 28*16^2 = 7168) goes first, onto shard 0;
    y (512, cost 512) fits only shard 1; z (320) ends exactly at the cap (1280/2*1.3 = 832) on
    shard 1, whose cost is the lower, so it goes there and not onto shard 0, where it also fits.

    Absorbing into padding is "stays within" too: with bucket_size 1, dp 2 and backprop order
    p (512), q (128), r (320), s (64), the chunk holds 960 >= 0.9*2*512 when s comes, with the
    estimate [512, 448]; 448 + 64 is exactly the fullest shard's 512, so s is absorbed."""
    s, r, q, p = _params(64, 320, 128, 512)
    lay = padded_layer_wise_layout([s, r, q, p], bucket_size=1, dp=2)
    assert len(lay.buckets) == 1 and {lay.index[t][2] for t in (p, q, r, s)} == {0}
    c, b, a = _params(64, 64, 64)
    lay = padded_layer_wise_layout([c, b, a], bucket_size=128, dp=2)
    assert lay.buckets == [(0, 128), (128, 256)]
    assert [lay.index[p][2] for p in (a, b, c)] == [0, 0, 1]
    z, y = _params(320, 512)
    x = torch.nn.Parameter(torch.zeros(16, 28))
    lay = padded_layer_wise_layout([z, y, x], bucket_size=None, dp=2)
    assert [lay.shard_owner[p] for p in (x, y, z)] == [0, 1, 1]
    assert [lay.index[p] for p in (x, y, z)] == [(0, 448, 0), (832, 1344, 0), (1344, 1664, 0)]


def test_padded_layout_spreads_the_models_matrices_over_every_rank():
    """The blind spot the old packing left: with matrices larger than the bucket size every matrix
    was a bucket of its own owned by rank 0, so no other owner's padded path ever ran."""
    model = GPT(ModelConfig(moe=True), recipe="blockwise", fp8_param=False, seed=0)
    for key, params in group_params_for_buffers(model.named_parameters()).items():
        if key.is_layer_wise and len(params) > 1:
            dp = 2 if key.is_expert else 4
            lay = padded_layer_wise_layout(params, bucket_size=4096, dp=dp)
            assert set(lay.shard_owner.values()) == set(range(dp)), key
            assert len(lay.buckets) < len(params), key


def test_merge_rule_gives_on_the_same_buffers_as_off():
    cfg = ModelConfig(moe=True)
    on = GPT(cfg, recipe="blockwise", fp8_param=True, seed=0)
    off = GPT(cfg, recipe="blockwise", fp8_param=False, seed=0)
    g_on = group_params_for_buffers(on.named_parameters(), merge_layerwise_fp8_grads=True)
    g_off = group_params_for_buffers(off.named_parameters(), merge_layerwise_fp8_grads=True)
    shape = lambda g: {k: [tuple(p.shape) for p in v] for k, v in g.items()}
    assert shape(g_on) == shape(g_off)
    assert all(k.param_dtype != torch.uint8 for k in g_on)
    split = group_params_for_buffers(on.named_parameters(), merge_layerwise_fp8_grads=False)
    # Without the merge rule the FP8 matrices leave the router's bf16 Muon buffer: two buffers
    # (two all-reduces) where OFF has one.
    dense_lw = [k for k in split if k.is_layer_wise and not k.is_expert and k.param_dtype != torch.float32]
    assert sorted(str(k.param_dtype) for k in dense_lw) == ["torch.bfloat16", "torch.uint8"]


def test_ping_pong_sequence_matches_megatron_example():
    owners = ping_pong(10, 4)
    by_rank = {r: [i for i, o in enumerate(owners) if o == r] for r in range(4)}
    assert by_rank == {0: [0, 7, 8], 1: [1, 6, 9], 2: [2, 5], 3: [3, 4]}


def test_shard_pieces_must_tile_each_param_exactly_once():
    from parity.harness.runner import _untiled

    numel = {"a": 10, "b": 4}
    assert _untiled([("a", 0, 6), ("a", 6, 10), ("b", 0, 4)], numel) == []
    assert _untiled([("a", 0, 5), ("a", 6, 10), ("b", 0, 4)], numel) == [("a", "elements 5:6 missed")]
    assert _untiled([("a", 0, 6), ("a", 5, 10), ("b", 0, 4)], numel) == [("a", "elements 5:6 twice")]
    assert _untiled([("a", 0, 10), ("b", 0, 3)], numel) == [("b", "elements 3:4 missed")]
    assert _untiled([("a", 0, 10)], numel) == [("b", "elements 0:4 missed")]  # no piece at all
