"""The optimizer path at world 1, in this process: clipping and the grad stats, FP8 params in a
uint8 DistOpt buffer, bucket groups next to it, the forced-sync error, per-step report fields."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from parity.distributed.groups import build_groups
from parity.harness.errors import ConfigError
from parity.harness.faults import Injection
from parity.harness.report import merge_ranks
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import make_scenario
from parity.model import is_quantized_param
from parity.optim.clip import counted_grads, grad_stats, held_grads
from parity.optim.stack import Stack
from parity.vocab import FIRED, Fault

OPTIM = dict(clip_grad=1.0, lr_decay_style="cosine", lr_warmup_steps=2, lr_min=1e-4)


class Ctx:
    device = "cpu"


def run(steps=4, injections=(), **kw):
    s = make_scenario({"name": "t", "world": 1, "steps": steps, **kw})
    return s, rank_main(Ctx(), s, RunOptions(injections=tuple(injections), progress=False,
                                             golden_digests=False, snapshot="none"))


def stack(faults=(), fp8=True, **kw):
    s = make_scenario({"name": "t", "world": 1, **kw})
    cfg = dataclasses.replace(s.stack_configs()[0 if fp8 else 1], faults=frozenset(faults))
    return Stack(cfg, build_groups(1), torch.device("cpu"))


# -- the scenario's optim table reaches the optimizers -----------------------------------------------
OPTIM_TABLE = dict(muon_nesterov=True, muon_extra_scale_factor=0.2, muon_momentum=0.8, muon_ns_steps=3,
                   muon_coefficients="simple", muon_scale_mode="unit_rms_norm", muon_split_qkv=False,
                   weight_decay=0.05, adam_betas=[0.8, 0.99], adam_eps=1e-6)


def test_the_optim_table_is_what_the_optimizers_step_with(single_rank):
    """Read from the optimizers' own param groups, both sides: a knob lost on its way would leave
    the defaults there (and both sides would still agree)."""
    cfg_on, cfg_off = make_scenario({"name": "t", "world": 1, "optim": OPTIM_TABLE}).stack_configs()
    for cfg in (cfg_on, cfg_off):
        st = Stack(cfg, build_groups(1), torch.device("cpu"))
        for g in st.layerwise.muon.param_groups:
            assert (g["nesterov"], g["extra_scale_factor"], g["momentum"], g["steps"], g["coefficient_type"],
                    g["scale_mode"], g["split_qkv"], g["weight_decay"]) == \
                (True, 0.2, 0.8, 3, "simple", "unit_rms_norm", False, 0.05)
        groups = st.distopt.optimizer.param_groups
        assert all((tuple(g["betas"]), g["eps"]) == ((0.8, 0.99), 1e-6) for g in groups)
        assert [g["weight_decay"] for g in groups] == [0.05, 0.0]  # the norms are never decayed (s2.17)


def test_a_run_with_the_optim_table_keeps_on_equal_to_off_and_trains_otherwise(single_rank):
    s, res = run(steps=3, moe=True, optim=OPTIM_TABLE)
    bad = [c for c in res["checks"] if not c["ok"]]
    assert not res["divergences"] and not bad, (res["messages"], bad)
    _, plain = run(steps=3, moe=True)
    loss = lambda r: [st["loss_bits"] for st in sorted(r["steps"], key=lambda st: st["step"])]
    assert loss(res)[0] == loss(plain)[0] and loss(res)[1:] != loss(plain)[1:]  # the update differs


def test_adam_leaves_the_norms_undecayed(single_rank):
    """docs/spec/megatron.md s2.17: with a zero grad Adam's update is zero, so a step moves a
    master by its weight decay alone: the norms' (1-D) masters keep their bits, the embedding's
    shrink."""
    st = stack()
    do = st.distopt
    for pc in do.pieces:
        pc.grad.zero_()
    before = {pc.name: pc.master.clone() for pc in do.pieces}
    st.set_lr(0)
    do.step()
    moved = {pc.name: not torch.equal(pc.master.view(torch.int32), before[pc.name].view(torch.int32))
             for pc in do.pieces}
    norms = [n for n, pc in zip(moved, do.pieces) if pc.param.dim() == 1]
    assert norms and not any(moved[n] for n in norms), moved
    assert any(moved[n] for n in moved if n.startswith("embed.weight")), moved


# -- ON == OFF with clipping, the cosine schedule and FP8 DistOpt params ---------------------------
@pytest.mark.parametrize("kw", [dict(recipe="blockwise", moe=True),
                                dict(recipe="mxfp8", model={"fp8_head": True}),
                                dict(recipe="blockwise", moe=True, model={"fp8_head": True}, overlap=True)],
                         ids=["blockwise-moe", "mxfp8-fp8-head", "blockwise-moe-fp8-head-overlap"])
def test_on_equals_off_with_clip_cosine(single_rank, kw):
    s, res = run(steps=5, **OPTIM, **kw)
    bad = [c for c in res["checks"] if not c["ok"]]
    assert not res["divergences"] and not bad, (res["messages"], bad)
    entry = merge_ranks(s, [res], 0.0)
    stats = entry["optimizer"]
    assert [r["step"] for r in stats] == list(range(5))
    assert stats[0]["lr"] == 0.0 and stats[2]["lr"] == 1e-3 > stats[4]["lr"]  # warmup, then cosine
    for r in stats:  # per step in report.json, the two sides equal, and the clip engaged
        assert r["grad_norm"] == r["grad_norm_b"] > 1.0
        assert r["num_zeros"] == r["num_zeros_b"] > 0
        assert r["clip_coef"] == r["clip_coef_b"] < 1.0
    # ...and compared bit for bit in the optimizer phase every step
    assert res["compared_by_phase"]["optimizer"] > 0


def test_grad_stats_are_optimizer_phase_tensors(single_rank):
    st = stack(**OPTIM)
    seen = {}
    st.step(0, lambda step, ph, t, complete=True: seen.setdefault(ph, {}).update(t))
    opt = seen["optimizer"]
    assert opt["grad_norm"].dtype == torch.float32 and opt["num_zeros"].dtype == torch.int64
    assert opt["clip_coef"].dtype == torch.float64
    assert "clip_coef" not in stack().optimizer_state()  # clipping off: nothing to compare


# -- clipping ------------------------------------------------------------------------------------
def _fake(owned, other, pieces):
    # two DP ranks' worth of LayerWise lists and a DistOpt buffer sharded over them
    lw = SimpleNamespace(owned=owned, dense_lists=[owned, other], expert_lists=[[]], dp=2, expt_dp=1,
                         lw_buffers=[SimpleNamespace(params=owned + other)])
    do = SimpleNamespace(pieces=pieces, buffers=[SimpleNamespace(params=[pc.param for pc in pieces], dp=2)])
    return lw, do


def _param(values):
    p = torch.nn.Parameter(torch.zeros(len(values)))
    p.main_grad = torch.tensor(values, dtype=torch.float32)
    return p


def test_counting_owned_layerwise_grads_and_own_shards_only():
    a, b, q = _param([3.0, 0.0]), _param([1.0, 1.0]), _param([5.0, 5.0, 0.0, 2.0])
    piece = SimpleNamespace(param=q, grad=q.main_grad[2:4])  # this rank's reduced shard
    lw, do = _fake([a], [b], [piece])
    order = {a: 0, b: 1, q: 2}
    got = counted_grads(lw, do, order)
    assert [g.data_ptr() for _, _, g in got] == [a.main_grad.data_ptr(), piece.grad.data_ptr()]
    twice = counted_grads(lw, do, order, {Fault.GRAD_NORM_DOUBLE_COUNTS_REPLICATED})
    assert [g.data_ptr() for _, _, g in twice] == [a.main_grad.data_ptr(), b.main_grad.data_ptr(),
                                                   piece.grad.data_ptr()]
    whole = counted_grads(lw, do, order, {Fault.GRAD_NORM_COUNTS_UNREDUCED_SHARD})
    assert whole[-1][2] is q.main_grad


@pytest.mark.parametrize("clip", [0.0, 1.0, 100.0])
def test_norm_clip_and_zeros(single_rank, clip):
    a, b, q = _param([3.0, 0.0]), _param([1.0, 1.0]), _param([5.0, 5.0, 0.0, 4.0])
    piece = SimpleNamespace(param=q, grad=q.main_grad[2:4])
    lw, do = _fake([a], [b], [piece])
    before = {id(t): t.clone() for t in (a.main_grad, b.main_grad, q.main_grad)}
    w = dist.group.WORLD
    st = grad_stats(counted_grads(lw, do, {a: 0, b: 1, q: 2}), held_grads(lw, do), dp_group=w,
                    expt_dp_group=w, ep_group=w, clip_grad=clip, device="cpu")
    assert float(st.norm) == 5.0  # sqrt(3^2 + 0^2 + 0^2 + 4^2): b is not counted, q[0:2] is not
    if clip == 0.0:
        assert st.clip_coef is None
        assert torch.equal(a.main_grad.view(torch.int32), before[id(a.main_grad)].view(torch.int32))
    else:
        coef = clip / (5.0 + 1e-6)
        assert float(st.clip_coef) == coef
        scaled = coef < 1.0
        for g in (a.main_grad, b.main_grad):  # every LayerWise replica this rank holds
            want = before[id(g)] * coef if scaled else before[id(g)]
            assert torch.equal(g.view(torch.int32), want.view(torch.int32))
        want_q = before[id(q.main_grad)].clone()
        if scaled:
            want_q[2:4] *= coef
        assert torch.equal(q.main_grad.view(torch.int32), want_q.view(torch.int32))  # only the shard this rank reduced
    assert int(st.num_zeros) == 2  # a[1] and q[2]


# -- FP8 params in the DistOpt sibling -------------------------------------------------------------
def test_fp8_head_lives_in_a_uint8_distopt_buffer(single_rank):
    on, off = stack(model={"fp8_head": True}), stack(model={"fp8_head": True}, fp8=False)
    head = on.model.head.weight
    assert is_quantized_param(head) and not is_quantized_param(off.model.head.weight)
    (buf,) = [b for b in on.ddp.all_buffers() if b.key.param_dtype == torch.uint8]
    assert buf.config.use_distributed_optimizer and not buf.key.is_layer_wise and buf.params == [head]
    s, e, _ = buf.layout.index[head]
    assert head.qt.rowwise_data.data_ptr() == buf.param_data[s:e].data_ptr()  # storage remapped
    assert head.get_high_precision_init_val() is None  # consumed by the shard master
    assert not any(b.key.param_dtype == torch.uint8 for b in off.ddp.all_buffers())
    # The DistOpt shard pieces (and so masters and states) have the same names ON and OFF.
    assert [pc.name for pc in on.distopt.pieces if pc.param is head] == ["head.weight[0:16384]"]
    assert sorted(k for k in on.distopt.state_tensors()) == sorted(off.distopt.state_tensors())


def test_uint8_bucket_groups_keep_layerwise_buckets_apart(single_rank):
    st = stack(model={"fp8_head": True})
    fp8 = [g for g in st.ddp.bucket_groups if any(b.buffer.key.param_dtype == torch.uint8 for b in g.buckets)]
    (g,) = fp8
    assert g.use_distributed_optimizer and all(b.buffer.config.use_distributed_optimizer for b in g.buckets)
    assert len(g.buckets) > 1  # the other DistOpt buckets ride in the FP8 bucket's group
    assert all(len(x.buckets) == 1 for x in st.ddp.bucket_groups if x.is_layer_wise)
    with pytest.raises(AssertionError, match="differing effective use_distributed_optimizer"):
        stack(faults={Fault.UINT8_DISTOPT_BUFFER_NEXT_TO_LAYERWISE}, model={"fp8_head": True})


def test_the_buffer_and_grouping_faults_record_their_deviation_only_where_the_groups_change(single_rank):
    """They act when the stack is built: each is recorded as taken only where its rule gives
    other groups than the correct one, so a run where it changes nothing cannot count as run."""
    uint8, merge = Fault.UINT8_DISTOPT_BUFFER_NEXT_TO_LAYERWISE, Fault.MERGE_ALLREDUCE_AND_REDUCE_SCATTER_BUCKETS
    FIRED.clear()
    st = stack(faults={uint8})  # no FP8 DistOpt param: the two rules agree
    assert uint8 not in FIRED and all(len(g.buckets) == 1 for g in st.ddp.bucket_groups)
    with pytest.raises(AssertionError):
        stack(faults={uint8}, model={"fp8_head": True})
    assert uint8 in FIRED
    FIRED.clear()
    off = make_scenario({"name": "t", "world": 1}).stack_configs()[1]  # the padded layout is bf16-only
    padded = dataclasses.replace(off, ddp=dataclasses.replace(off.ddp, layout="padded"), faults=frozenset({merge}))
    st = Stack(padded, build_groups(1), torch.device("cpu"))
    assert merge not in FIRED and len(st.ddp.bucket_groups) > 1  # one collective type: nothing to merge
    st = stack(faults={merge})
    assert merge in FIRED and len(st.ddp.bucket_groups) == len(st.ddp.chains)
    FIRED.clear()
    # The split of FP8 LayerWise grads changes the buffers only where FP8 and bf16 matrices share
    # a LayerWise class (the MoE router next to FP8 linears); a dense model's are all FP8.
    split = Fault.SPLIT_GRAD_BUFFERS
    st = stack(faults={split})
    assert split not in FIRED and not any(b.key.param_dtype == torch.uint8 for b in st.ddp.all_buffers())
    st = stack(faults={split}, moe=True)
    assert split in FIRED and any(b.key.param_dtype == torch.uint8 for b in st.ddp.all_buffers())
    FIRED.clear()
    # At DP 1 the pre-hooks gather nothing, with owner lists or without.
    lw = Fault.LAYERWISE_OVERLAP_FLAG_OFF
    stack(faults={lw}, overlap=True)
    assert lw not in FIRED


def test_fp8_head_not_requantized_is_caught_at_param_sync(single_rank):
    _, res = run(steps=2, model={"fp8_head": True},
                 injections=[Injection("fault", name=Fault.DISTOPT_FP8_NOT_REQUANTIZED)])
    first = min(res["divergences"], key=lambda d: d["step"])
    assert first["step"] == 0 and first["phase"] == "param_sync" and "head.weight.fp8" in first["path"]


def test_fp8_head_master_from_dequant_is_caught_at_init(single_rank):
    _, res = run(steps=1, model={"fp8_head": True},
                 injections=[Injection("fault", name=Fault.MASTER_FROM_FP8_DEQUANT)])
    assert any(d["phase"] == "init" and "head.weight[" in d["path"] for d in res["divergences"])


def test_fp8_head_needs_its_own_bucket():
    """At DP > 1 the FP8 head must close a DistOpt bucket of its own on both sides (s2.16): under
    overlap, a bucket size at most its numel; without overlap every buffer is one bucket (s2.5),
    so that is refused. At world 1 there is one shard and nothing to split."""
    with pytest.raises(ConfigError, match="bucket_size"):
        make_scenario({"name": "t", "model": {"fp8_head": True}, "overlap": True, "bucket_size": None})
    with pytest.raises(ConfigError, match="bucket_size"):
        make_scenario({"name": "t", "model": {"fp8_head": True}, "overlap": True, "bucket_size": 20000})
    with pytest.raises(ConfigError, match="key 'overlap': model.fp8_head at world > 1 needs overlap"):
        make_scenario({"name": "t", "model": {"fp8_head": True}})
    make_scenario({"name": "t", "model": {"fp8_head": True}, "overlap": True})
    make_scenario({"name": "t", "model": {"fp8_head": True}, "world": 1})


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,key", [
    (dict(num_distributed_optimizer_instances=2), "num_distributed_optimizer_instances"),
    (dict(clip_grad=-0.5), "clip_grad"),
    (dict(lr_decay_style="cosine", lr_warmup_steps=40), "lr_decay_steps"),
    (dict(lr_decay_style="step"), "lr_decay_style"),
])
def test_scenario_rejects_bad_optimizer_keys(raw, key):
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        make_scenario({"name": "t", **raw})


def test_forced_sync_without_overlap_is_an_error(single_rank):
    st = stack()
    assert not st.ddp.config.overlap_param_gather
    with pytest.raises(AssertionError, match="overlap_param_gather"):
        st.ddp.start_param_sync(force_sync=True)
    overlapped = stack(overlap=True)
    overlapped.ddp.start_param_sync(force_sync=True)  # allowed with overlap
    # the hooks are off for the first iteration: disabling them again is a caller's bug, as upstream
    with pytest.raises(AssertionError, match="not enabled"):
        overlapped.ddp.disable_forward_pre_hook(param_sync=True)
    overlapped.ddp.enable_forward_pre_hook()
    with pytest.raises(AssertionError, match="already enabled"):
        overlapped.ddp.enable_forward_pre_hook()
