"""Whether a runtime op is running for real or only for shapes.

Every collective op of the runtime is also run under ``FakeTensorMode`` (the pass runner's
verification, the planner's dry runs) and on meta tensors; there it must return correctly shaped,
strided and typed results without communicating.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def is_fake(t: Any) -> bool:
    """True for values that only carry shapes: fake or meta tensors, or anything while a
    ``FakeTensorMode`` is active (shape propagation runs graphs with real attributes under it)."""
    if isinstance(t, FakeTensor) or (isinstance(t, torch.Tensor) and t.device.type == "meta"):
        return True
    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
