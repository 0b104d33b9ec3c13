"""The model: a small GPT/MoE with FP8 linears.

The names below load their modules on first use, so that ``parity.model.config`` (the model's
settings) can be imported without torch: scenario files are checked before torch is imported."""

import importlib

_WHERE = {
    "ModelConfig": "parity.model.config",
    "FP8Linear": "parity.model.fp8_linear",
    "QuantizedParameter": "parity.model.fp8_linear",
    "is_quantized_param": "parity.model.fp8_linear",
    "GPT": "parity.model.gpt",
    "is_expert_param": "parity.model.gpt",
    "is_layer_wise_managed": "parity.model.gpt",
    "is_weight_decayed": "parity.model.gpt",
}

__all__ = list(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'parity.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
