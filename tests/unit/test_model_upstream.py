"""The model where it follows upstream's defaults: MoE routing (docs/spec/megatron.md s2.18: top k
of the bf16 logits, a softmax over those k rounded to bf16, the prob applied inside the expert
before fc2, the outputs summed per token in bf16) and tied embeddings (s8.1)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from parity.model.moe import MoE, SwiGLU


def bits(t):
    return t.contiguous().view(torch.int16)


class Recorder(nn.Module):
    """An expert that returns its rows times their probs and remembers what it was given."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, p):
        self.seen.append((x.clone(), p.clone()))
        return x * p


def _moe(num_experts=4, k=2, dead=()):
    router = torch.zeros(num_experts, 8)  # the logits are set by hand below
    experts = {e: Recorder() for e in range(num_experts)}
    return MoE(router, experts, num_experts, k, 1, 0, None, dead_experts=dead), experts


def test_route_takes_the_top_k_logits_then_a_softmax_over_those_k():
    moe, _ = _moe()
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.25, 4.0]], dtype=torch.bfloat16)
    probs, chosen = moe.route(logits)
    assert chosen.tolist() == [[1, 2], [3, 0]]
    assert probs.dtype == torch.bfloat16
    for row, (a, b) in enumerate([(3.0, 2.0), (4.0, 0.5)]):
        ea, eb = math.exp(a), math.exp(b)
        want = torch.tensor([ea / (ea + eb), eb / (ea + eb)], dtype=torch.float64).to(torch.bfloat16)
        assert torch.equal(bits(probs[row]), bits(want))
    # Not the pre-softmax mode: a softmax over all four experts gives smaller, unnormalised probs.
    pre = torch.softmax(logits.float(), -1).topk(2).values.to(torch.bfloat16)
    assert not torch.equal(bits(probs), bits(pre))


def test_a_dead_expert_is_skipped_and_the_probs_are_the_chosen_logits_softmax():
    moe, _ = _moe(dead=(1,))
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]], dtype=torch.bfloat16)
    probs, chosen = moe.route(logits)
    assert chosen.tolist() == [[2, 0]]
    assert torch.equal(bits(probs), bits(torch.softmax(torch.tensor([[2.0, 1.0]]), -1).to(torch.bfloat16)))


def test_each_expert_gets_its_rows_probs_and_the_outputs_sum_per_token_in_bf16():
    moe, experts = _moe()
    torch.manual_seed(0)
    h = torch.randn(6, 8).to(torch.bfloat16)
    moe.router.weight.data = (torch.randn(4, 8) * 0.5).to(torch.bfloat16)
    out = moe(h)
    probs, chosen = moe.route(moe.router(h))
    want = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for e in sorted(chosen[t].tolist()):  # the permuted rows' order: by expert
            p = probs[t, chosen[t].tolist().index(e)]
            want[t] = want[t] + h[t] * p  # each add rounded to bf16
    assert out.dtype == torch.bfloat16
    assert torch.equal(bits(out), bits(want))
    for e, rec in experts.items():
        (x, p), = rec.seen
        mine = (chosen == int(e)).nonzero()  # (token, slot) pairs, in token order
        assert torch.equal(bits(x), bits(h[mine[:, 0]]))
        assert torch.equal(bits(p[:, 0]), bits(probs[mine[:, 0], mine[:, 1]]))


def test_swiglu_scales_its_activation_by_the_prob_before_fc2():
    """fc2's input is silu(gate) * up * prob rounded once to bf16: fc2 sees the scaled rows."""
    fc2_inputs = []
    fc1, fc2 = nn.Identity(), nn.Identity()
    fc2.register_forward_pre_hook(lambda m, a: fc2_inputs.append(a[0].clone()))
    mlp = SwiGLU(fc1, fc2)
    torch.manual_seed(1)
    x = torch.randn(5, 16).to(torch.bfloat16)
    p = torch.rand(5, 1).to(torch.bfloat16)
    mlp(x, p)
    gate, up = x.float().chunk(2, -1)
    want = (F.silu(gate) * up * p.float()).to(torch.bfloat16)
    assert torch.equal(bits(fc2_inputs[0]), bits(want))
    unscaled = (F.silu(gate) * up).to(torch.bfloat16)
    assert not torch.equal(bits(fc2_inputs[0]), bits(unscaled))


# ------------------------------------------------------------------------------ tied embeddings

def test_a_tied_output_layer_reads_the_embedding_and_its_grad_sums_both_uses():
    """ModelConfig.tie_embeddings: no head param; the logits are the untied model's when its head
    holds the embedding, and the one grad is the sum of the untied model's two, bit for bit."""
    from parity.model.config import ModelConfig
    from parity.model.gpt import GPT

    tied = GPT(ModelConfig(tie_embeddings=True), recipe="blockwise", fp8_param=False, seed=5)
    untied = GPT(ModelConfig(), recipe="blockwise", fp8_param=False, seed=5)
    assert tied.head is None and not any(n.startswith("head.") for n, _ in tied.named_parameters())
    untied.head.weight.data.copy_(untied.embed.weight.data)
    for m in (tied, untied):  # the FP8 linears add their wgrad into main_grad, as under the DDP
        for p in m.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    (lt, out_t), (lu, out_u) = tied(tokens, tokens), untied(tokens, tokens)
    assert torch.equal(bits(out_t), bits(out_u))
    lt.backward()
    lu.backward()
    both = untied.embed.weight.grad + untied.head.weight.grad
    assert torch.equal(bits(tied.embed.weight.grad), bits(both))
    assert not torch.equal(bits(tied.embed.weight.grad), bits(untied.embed.weight.grad))
