"""The model: a small GPT/MoE with FP8 linears.

The names below load their modules on first use, so that ``parity.model.config`` (the model's
settings) can be imported without torch: scenario files are checked before torch is imported."""

from parity._lazy import lazy_getattr

_WHERE = {
    "ModelConfig": "parity.model.config",
    "FP8Linear": "parity.model.fp8_linear",
    "QuantizedParameter": "parity.model.fp8_linear",
    "is_quantized_param": "parity.model.fp8_linear",
    "GPT": "parity.model.gpt",
    "is_expert_param": "parity.model.gpt",
    "is_layer_wise_managed": "parity.model.gpt",
}

__all__ = list(_WHERE)

__getattr__ = lazy_getattr(__name__, _WHERE)
