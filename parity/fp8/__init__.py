"""parity.fp8: bit-exact PyTorch re-implementation of TransformerEngine's blockwise and MXFP8
quantizers (spec: docs/spec/te.md), the storage container and a block-scaled GEMM.

Public API::

    quantize(x, recipe, *, block=None, fp8_dtype="e4m3", pow2_scales=True, eps=0.0,
             rowwise=True, columnwise=True) -> QuantizedTensor
    QuantizedTensor  (.dequantize, .requantize_, .post_all_gather_processing, .raw_parts,
                      .nbytes, .gemm_operand)
    is_quantized_tensor(x) -> bool
    Operand, fp8_gemm(a, b, *, out_dtype, backend="auto", accumulate_into=None)
    cast_to_fp8, FP8_MAX, FP8_TORCH_DTYPE, e8m0_from_fp32, e8m0_to_fp32, e8m0_quant_scale
"""

from .formats import (
    E4M3,
    E5M2,
    FP8_MAX,
    FP8_TORCH_DTYPE,
    canonical_fp8_dtype,
    cast_to_fp8,
    e8m0_from_fp32,
    e8m0_quant_scale,
    e8m0_to_fp32,
    fp8_to_fp32,
    input_dtype_max,
)
from .gemm import Operand, fp8_gemm, scaled_mm_supported
from .quantize import blockwise_scale_from_amax, mxfp8_e8m0_from_amax, quantize
from .tensor import QuantizedTensor, is_quantized_tensor

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_MAX",
    "FP8_TORCH_DTYPE",
    "Operand",
    "QuantizedTensor",
    "blockwise_scale_from_amax",
    "canonical_fp8_dtype",
    "cast_to_fp8",
    "e8m0_from_fp32",
    "e8m0_quant_scale",
    "e8m0_to_fp32",
    "fp8_gemm",
    "fp8_to_fp32",
    "input_dtype_max",
    "is_quantized_tensor",
    "mxfp8_e8m0_from_amax",
    "quantize",
    "scaled_mm_supported",
]
