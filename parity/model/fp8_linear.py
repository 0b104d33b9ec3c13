"""FP8 linear layer and the FP8 parameter type.

A weight is either a plain bf16 ``nn.Parameter`` (fp8 param gather OFF: quantized on the fly in
every forward, as TE does for a bf16 weight) or a :class:`QuantizedParameter` (ON: the persisted
``Q(bf16(master))`` is the only copy of the weight). Both feed the same GEMMs, so ON and OFF can be
bit-identical exactly when ON's persisted bytes equal OFF's on-the-fly quantization.

Microbatches follow TE's ``is_first_microbatch`` rule (docs/spec/te.md s9). With the flag set
(the training loop sets it every microbatch: True on the first, False after), OFF keeps its FP8
weight in a cache that is requantized on the first microbatch only and reused on the others; ON
uses its persisted FP8 weight as is. With the flag None, OFF quantizes on every forward.

Gradients: the wgrad GEMM writes straight into ``weight.main_grad`` (TE's gradient accumulation
fusion), for ON and OFF alike: it overwrites ``main_grad`` on the first microbatch and accumulates
into it otherwise (and when the flag is None); then it calls ``weight.grad_ready_hook`` installed by
the DDP wrapper. A storage-less FP8 parameter has nowhere else to put a gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from parity.fp8 import QuantizedTensor, fp8_gemm, quantize
from parity.vocab import Fault

# Per recipe: (block for activations and grads, block for weights). TE's Float8BlockScaling uses
# 1x128 tiles for x and dy and 128x128 for weights; MXFP8 uses 1x32 everywhere.
RECIPE_BLOCKS = {"blockwise": ("1x128", "128x128"), "mxfp8": ("1x32", "1x32")}


def quantize_weight(w: torch.Tensor, recipe: str) -> QuantizedTensor:
    """The weight quantizer shared by ON (persist) and OFF (on the fly): both usages."""
    return quantize(w, recipe, block=RECIPE_BLOCKS[recipe][1], rowwise=True, columnwise=True)


class QuantizedParameter(nn.Parameter):
    """An FP8 parameter: a storage-less (meta) Parameter of the logical shape and dtype.

    ``.qt`` holds the persisted :class:`QuantizedTensor`; ``.hp_init`` the high-precision init value
    (on CPU) until the optimizer seeds the fp32 master from it, like TE's
    ``quantized_model_init(preserve_high_precision_init_val=True)``.
    """

    def __new__(cls, qt: QuantizedTensor, hp_init: torch.Tensor | None = None):
        data = torch.empty(qt.shape, dtype=qt.dtype, device="meta")
        p = torch.Tensor._make_subclass(cls, data, True)
        p.qt = qt
        p.hp_init = None if hp_init is None else hp_init.detach().to("cpu", copy=True)
        return p

    def __repr__(self):
        return f"QuantizedParameter({self.qt.recipe}/{self.qt.block}, shape={tuple(self.shape)})"

    def __deepcopy__(self, memo):
        raise TypeError("QuantizedParameter cannot be deep-copied; build a new model instead")

    def get_high_precision_init_val(self) -> torch.Tensor | None:
        return self.hp_init

    def clear_high_precision_init_val(self) -> None:
        self.hp_init = None


def is_quantized_param(p) -> bool:
    """True for persisted FP8 params. A type check: every tensor has ``dequantize``."""
    return isinstance(p, QuantizedParameter)


def accumulate_main_grad(param: torch.Tensor, grad: torch.Tensor, overwrite: bool = False) -> None:
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        raise RuntimeError("parameter has no main_grad: wrap the model in the DDP wrapper first")
    if overwrite:
        main_grad.copy_(grad)
    else:
        main_grad.add_(grad)
    hook = getattr(param, "grad_ready_hook", None)
    if hook is not None:
        hook(param)


def _pad_rows(t: torch.Tensor, recipe: str) -> torch.Tensor:
    """MXFP8 quantizes 32-row blocks: pad the token dim with zero rows (as MoE token padding does
    for FP8). Zeros never raise a block's amax, so the valid rows' bytes and the GEMM sums over
    valid rows are unchanged."""
    if recipe != "mxfp8" or t.shape[0] % 32 == 0:
        return t
    return torch.cat([t, t.new_zeros(32 - t.shape[0] % 32, t.shape[1])])


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer, qw):
        recipe = layer.recipe
        act_block = RECIPE_BLOCKS[recipe][0]
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        ctx.layer, ctx.x_shape, ctx.qw = layer, x.shape, qw
        ctx.overwrite_wgrad = layer.is_first_microbatch is True
        if layer.is_first_microbatch is False and Fault.WGRAD_OVERWRITES_EVERY_MICROBATCH in layer.faults:
            ctx.overwrite_wgrad = True  # the accumulated microbatches are lost
        if x2.shape[0] == 0:  # an expert that got no tokens still reports a (zero) gradient
            ctx.qx = None
            return x.new_empty(*x.shape[:-1], layer.out_features)
        qx = quantize(_pad_rows(x2, recipe), recipe, block=act_block, rowwise=True, columnwise=True)
        ctx.qx = qx
        y = fp8_gemm(qx.gemm_operand("rowwise"), qw.gemm_operand("rowwise"), out_dtype=x.dtype)
        return y[:rows].reshape(*x.shape[:-1], layer.out_features)

    @staticmethod
    def backward(ctx, dy):
        layer, qw, qx = ctx.layer, ctx.qw, ctx.qx
        w = layer.weight
        if qx is None:
            if Fault.EMPTY_EXPERT_SKIPS_WGRAD in layer.faults:
                return dy.new_zeros(ctx.x_shape), None, None  # nothing to add, and no grad-ready signal
            accumulate_main_grad(w, torch.zeros(w.shape, dtype=torch.float32, device=dy.device),
                                 ctx.overwrite_wgrad)
            return dy.new_zeros(ctx.x_shape), None, None
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        rows = dy2.shape[0]
        qdy = quantize(_pad_rows(dy2, layer.recipe), layer.recipe, block=RECIPE_BLOCKS[layer.recipe][0],
                       rowwise=True, columnwise=True)
        dx = fp8_gemm(qdy.gemm_operand("rowwise"), qw.gemm_operand("columnwise"), out_dtype=dy.dtype)
        dw = fp8_gemm(qdy.gemm_operand("columnwise"), qx.gemm_operand("columnwise"),
                      out_dtype=torch.float32)
        accumulate_main_grad(w, dw, ctx.overwrite_wgrad)
        return dx[:rows].reshape(ctx.x_shape), None, None


class FP8Linear(nn.Module):
    """y = x W^T with FP8 GEMMs in forward and backward (no bias)."""

    def __init__(self, in_features: int, out_features: int, recipe: str, init: torch.Tensor,
                 fp8_param: bool):
        super().__init__()
        if recipe not in RECIPE_BLOCKS:
            raise ValueError(f"unknown recipe {recipe!r}; allowed: {sorted(RECIPE_BLOCKS)}")
        self.in_features, self.out_features, self.recipe = in_features, out_features, recipe
        hp = init.to(torch.bfloat16)
        if fp8_param:
            self.weight = QuantizedParameter(quantize_weight(hp, recipe), hp_init=hp)
        else:
            self.weight = nn.Parameter(hp)
        self.is_first_microbatch: bool | None = None
        """Set by the training loop before each microbatch's forward (TE's argument)."""
        self.weight_observer = None
        """Called as ``weight_observer(module, qw)`` with the FP8 weight each forward is about
        to use (the harness's capture point)."""
        self.faults = frozenset()
        self._fp8_cache: QuantizedTensor | None = None

    def fp8_weight(self) -> QuantizedTensor:
        """The quantized weight of the current weight values (OFF: quantized now, on the fly)."""
        if is_quantized_param(self.weight):
            return self.weight.qt
        return quantize_weight(self.weight.detach(), self.recipe)

    def forward_weight(self) -> QuantizedTensor:
        """The FP8 weight this forward uses, by TE's is_first_microbatch rule."""
        if is_quantized_param(self.weight) or self.is_first_microbatch is None:
            return self.fp8_weight()
        refresh = self.is_first_microbatch or self._fp8_cache is None
        if refresh and self._fp8_cache is not None and Fault.FP8_CACHE_NOT_REFRESHED in self.faults:
            refresh = False  # the cache survives the param update
        if refresh:
            self._fp8_cache = self.fp8_weight()
        return self._fp8_cache

    def forward(self, x):
        qw = self.forward_weight()
        if self.weight_observer is not None:
            self.weight_observer(self, qw)
        return _FP8LinearFn.apply(x, self, qw)
