"""The model: a small GPT/MoE with FP8 linears."""

from parity.model.config import ModelConfig
from parity.model.fp8_linear import FP8Linear, QuantizedParameter, is_quantized_param
from parity.model.gpt import GPT, is_expert_param, is_layer_wise_managed

__all__ = ["ModelConfig", "FP8Linear", "QuantizedParameter", "is_quantized_param", "GPT",
           "is_expert_param", "is_layer_wise_managed"]
