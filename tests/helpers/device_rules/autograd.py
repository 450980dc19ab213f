"""The rule inside the backward pass: the Python code that autograd runs.

PyTorch's autograd engine runs a backward pass without the caller's ``TorchFunctionMode``s: a
custom ``Function``'s ``backward`` and the hooks on tensors (DeepSpeed's gradient hooks, ZeRO's
reductions) would escape the rule, and a host synchronisation there (``unique``, ``nonzero``,
``item()``) would never be counted. The rule re-enters around each of them:

* every custom ``Function``'s backward, through the one method the engine calls for it
  (``BackwardCFunction.apply``, and ``apply_boxed``);
* every hook registered with ``Tensor.register_hook`` or ``register_post_accumulate_grad_hook``
  while the rule is installed (``wrap_hook``, called by the operation rule).

Hooks registered on autograd nodes directly (``grad_fn.register_hook``) stay outside.
"""

from __future__ import annotations

import contextlib
import functools

from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

_ENTRY_POINTS = ("apply", "apply_boxed")


@contextlib.contextmanager
def active(mode: TorchFunctionMode):
    """``mode`` on this thread's stack for the block (entered only when it is not already)."""
    if any(m is mode for m in _get_current_function_mode_stack()):
        yield
        return
    with mode:
        yield


def install(mode: TorchFunctionMode) -> None:
    """Run every custom Function's backward under ``mode`` (for the life of the process)."""
    for name in _ENTRY_POINTS:
        original = getattr(BackwardCFunction, name, None)
        if original is None or getattr(original, "_device_rule", False):
            continue

        @functools.wraps(original)
        def under_rule(self, *args, _original=original):
            with active(mode):
                return _original(self, *args)

        under_rule._device_rule = True
        setattr(BackwardCFunction, name, under_rule)


def wrap_hook(mode: TorchFunctionMode, hook):
    """``hook``, run under ``mode`` whenever autograd calls it."""

    @functools.wraps(hook)
    def under_rule(*args, **kwargs):
        with active(mode):
            return hook(*args, **kwargs)

    return under_rule
