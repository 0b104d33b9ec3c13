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
