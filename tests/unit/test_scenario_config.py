"""A scenario's keys, checked where they are read (parity.harness.scenario.make_scenario): every
refusal names the key and what is allowed; what a valid scenario becomes (its stack configs, its
golden identity). The command-line and file-level cases are in tests/integration/test_reliability.py."""

import pytest

from parity.harness.errors import ConfigError
from parity.harness.scenario import load_set, make_scenario

BASE = {"name": "s", "world": 2}

REFUSED = {
    "layout": ({"layout": "diagonal"}, "key 'layout': 'diagonal' is not allowed; allowed: compact, padded"),
    "pair": ({"pair": "both"}, "key 'pair': 'both' is not allowed; allowed: fp8_param_gather, "),
    "device": ({"device": "tpu"}, "key 'device': 'tpu' is not allowed; allowed: cpu, cuda"),
    "steps": ({"steps": 0}, "key 'steps': must be >= 1, got 0"),
    "microbatches": ({"microbatches": 0}, "key 'microbatches': must be >= 1, got 0"),
    "resume-at-last-step": ({"steps": 4, "resume_at": 4}, "key 'resume_at': must be in 1..3 (steps = 4), got 4"),
    "resume-at-zero": ({"steps": 4, "resume_at": 0}, "key 'resume_at': must be in 1..3"),
    "resume-world-alone": ({"resume_world": 4}, "key 'resume_world': needs resume_at"),
    "resume-world-not-a-multiple-of-ep": ({"steps": 4, "resume_at": 2, "moe": True, "ep": 2, "resume_world": 3},
                                          "key 'resume_world': must be a positive multiple of ep=2, got 3"),
    "resume-world-1-of-a-gather-pair": ({"steps": 4, "resume_at": 2, "pair": "overlap_param_gather",
                                         "fp8_param_gather": False, "resume_world": 1},
                                        "key 'resume_world': pair 'overlap_param_gather' needs world >= 2"),
    "bucket-size-zero": ({"bucket_size": 0}, "key 'bucket_size': must be a positive integer or 'none'"),
    "force-sync-padded": ({"pair": "force_sync", "layout": "padded", "fp8_param_gather": False},
                          "key 'pair': pair 'force_sync' needs the compact layout"),
    # (a key after it in the file, so that the key named is the failing one, not the last one read)
    "clip-negative": ({"clip_grad": -1.0, "steps": 3}, "key 'clip_grad': optim.clip_grad must be >= 0"),
    "momentum-one": ({"optim": {"muon_momentum": 1.0}}, "key 'optim.muon_momentum': optim.muon_momentum must be in [0, 1)"),
    "fp8-head-without-overlap": ({"model": {"fp8_head": True}}, "key 'overlap': model.fp8_head at world > 1 needs "
                                 "overlap = true"),
    "fp8-head-bucket-too-large": ({"model": {"fp8_head": True}, "overlap": True, "bucket_size": None},
                                  "key 'bucket_size': model.fp8_head needs bucket_size <= "),
    # the model's own rules (parity.model.config.ModelConfig)
    "model-size-zero": ({"model": {"hidden": 0}}, "key 'model': hidden must be a positive integer, got 0"),
    "model-size-float": ({"model": {"num_layers": 1.5}}, "key 'model': num_layers must be a positive integer, got 1.5"),
    "model-heads": ({"model": {"hidden": 160, "num_heads": 3}},
                    "key 'model': hidden (160) must be divisible by num_heads (3)"),
    "model-topk": ({"moe": True, "model": {"num_experts": 2, "moe_topk": 3}},
                   "key 'model': moe_topk (3) must be <= num_experts (2)"),
    "model-init-std": ({"model": {"init_std": 0.0}}, "key 'model': init_std must be > 0"),
    "model-tied-fp8-head": ({"model": {"tie_embeddings": True, "fp8_head": True}},
                            "key 'model': tie_embeddings and fp8_head exclude each other"),
    "dead-expert-dense": ({"stress": ["dead_expert"]}, "key 'model': stress option 'dead_expert' needs moe = true"),
    "dead-expert-all-routed": ({"moe": True, "stress": ["dead_expert"], "model": {"num_experts": 2, "moe_topk": 2}},
                               "key 'model': stress option 'dead_expert' needs num_experts (2) > moe_topk (2)"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_bad_key_is_refused_by_name(case):
    keys, message = REFUSED[case]
    with pytest.raises(ConfigError) as e:
        make_scenario({**BASE, **keys}, source="f.toml")
    assert str(e.value).startswith(f"f.toml: {message}"), str(e.value)


def test_the_smallest_valid_values_are_taken():
    s = make_scenario({"name": "one", "world": 1, "steps": 1, "microbatches": 1, "lr": 1e-30, "bucket_size": 1})
    assert (s.world, s.steps, s.microbatches, s.bucket_size) == (1, 1, 1, 1)
    s = make_scenario({**BASE, "steps": 4, "resume_at": 3, "resume_world": 2})  # the last step that leaves one
    assert s.resume_at == 3
    s = make_scenario({**BASE, "steps": 4, "resume_at": 2, "resume_world": 2, "pair": "overlap_param_gather",
                       "fp8_param_gather": False})  # a gather pair resumed at the smallest world it has
    assert s.resume_world == 2
    # one shard: the FP8 head's bucket cannot split anything, so neither overlap nor buckets are asked for
    assert make_scenario({"name": "h", "world": 1, "model": {"fp8_head": True}}).model["fp8_head"] is True
    m = make_scenario(dict(BASE)).model_config()
    assert not m.adam_matrix  # (else the Adam matrix's size bounds the bucket too)
    edge = m.vocab_size * m.hidden  # the head's size: a bucket of exactly the head is its own
    s = make_scenario({**BASE, "overlap": True, "bucket_size": edge, "model": {"fp8_head": True}})
    assert s.bucket_size == edge
    with pytest.raises(ConfigError, match="key 'bucket_size'"):
        make_scenario({**BASE, "overlap": True, "bucket_size": edge + 1, "model": {"fp8_head": True}})
    # the FP8 head's bucket rule is about ON's uint8 buffer: a pair without FP8 gather has none
    s = make_scenario({**BASE, "pair": "overlap_param_gather", "fp8_param_gather": False, "model": {"fp8_head": True}})
    assert s.pair == "overlap_param_gather"


def test_the_model_at_its_bounds_and_the_dims_the_recipe_checks():
    from parity.model.config import InitEdges, ModelConfig

    # the smallest sizes, top-k of every expert, a dead expert with one live one beside top-1
    ModelConfig(hidden=1, num_heads=1, num_layers=1, moe=True, num_experts=2, moe_topk=2, init_std=1e-30)
    ModelConfig(moe=True, num_experts=2, moe_topk=1, edges=InitEdges(dead_expert=True))
    with pytest.raises(ValueError, match="edges must be an InitEdges"):
        ModelConfig(edges=("zero_blocks",))
    # MoE layers: every second one, or the only one
    assert [ModelConfig(moe=True, num_layers=4).is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert ModelConfig(moe=True, num_layers=1).is_moe_layer(0)
    assert not any(ModelConfig(num_layers=4).is_moe_layer(i) for i in range(4))
    # every FP8 matrix dimension: the experts' and the head's only where they are FP8 matrices
    m = dict(hidden=96, ffn_hidden=160, moe_ffn_hidden=48, vocab_size=200)
    assert ModelConfig(**m).matrix_dims() == [96, 288, 320, 160]
    assert ModelConfig(**m, moe=True).matrix_dims() == [96, 288, 320, 160, 96, 48]
    assert ModelConfig(**m, fp8_head=True).matrix_dims() == [96, 288, 320, 160, 200]


def test_the_callers_mapping_is_left_as_it_was():
    raw = {**BASE, "bucket_size": "none", "stress": ["zero_blocks"]}
    s = make_scenario(raw)
    assert s.bucket_size is None and s.stress == ("zero_blocks",)
    assert raw == {**BASE, "bucket_size": "none", "stress": ["zero_blocks"]}


def test_unset_keys_leave_the_golden_identity_as_it_was():
    """A key added to Scenario later (stress edits, resume, optimizer options) must not move the
    identity of a scenario that does not set it, or every shipped golden would stop matching."""
    plain = make_scenario(dict(BASE))
    d = plain.to_dict()
    assert not {"stress", "resume_at", "resume_world", "optim", "source"} & set(d), sorted(d)
    assert plain.fingerprint() == make_scenario({**BASE, "stress": [], "optim": {}}).fingerprint()
    full = make_scenario({**BASE, "steps": 4, "stress": ["zero_blocks"], "resume_at": 2, "resume_world": 2,
                          "optim": {"muon_momentum": 0.9}}).to_dict()
    assert (full["stress"], full["resume_at"], full["resume_world"], full["optim"]) == (
        ["zero_blocks"], 2, 2, {"muon_momentum": 0.9})
    assert make_scenario(full).to_dict() == full  # a round trip through the file form


def test_each_pair_turns_one_knob():
    """ON/OFF differ in the knob the pair names and in nothing else of what is built."""
    def knobs(**keys):
        on, off = make_scenario({**BASE, **keys}).stack_configs()
        return [(c.fp8_param_gather, c.ddp.overlap_grad_reduce, c.ddp.overlap_param_gather, c.force_sync_each_step)
                for c in (on, off)]

    assert knobs(overlap=True) == [(True, True, True, False), (False, True, True, False)]
    assert knobs() == [(True, False, False, False), (False, False, False, False)]
    # both reduce grads under overlap (one bucket layout); only the gather differs
    assert knobs(pair="overlap_param_gather") == [(True, True, True, False), (True, True, False, False)]
    assert knobs(pair="force_sync") == [(True, True, True, True), (True, True, True, False)]


def test_an_unknown_set_lists_the_known_ones(tmp_path):
    (tmp_path / "mine.toml").write_text('name = "m"\nworld = 1\n')
    assert [s.name for s in load_set("mine", tmp_path)] == ["m"]
    for name in ("nope", "../mine", "mine.toml"):
        with pytest.raises(ConfigError, match=r"^--set .*: no such scenario set; known sets: mine$"):
            load_set(name, tmp_path)
