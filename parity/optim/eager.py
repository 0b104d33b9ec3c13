"""torch.optim.Optimizer for a stack that never compiles: constructing one does not import
torch._dynamo.

torch.optim.Optimizer wraps ``add_param_group`` (which its constructor calls) in
``torch._disable_dynamo``, whose first call imports torch._dynamo: about 1 s of CPU, as much as
importing torch itself, in every process that builds an optimizer (docs/measurements.md, sixth
session). The wrapper only keeps torch.compile from tracing the method; parity never compiles, so
:class:`EagerOptimizer` calls the method inside the wrapper (``__wrapped__``, set by
``functools.wraps``), or the wrapper itself where a torch release does not expose it.
"""

from __future__ import annotations

import torch

__all__ = ["EagerOptimizer"]

_ADD_PARAM_GROUP = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)


class EagerOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose ``add_param_group`` does not import torch._dynamo."""

    def add_param_group(self, param_group: dict) -> None:
        if _ADD_PARAM_GROUP is None:
            return super().add_param_group(param_group)
        return _ADD_PARAM_GROUP(self, param_group)
