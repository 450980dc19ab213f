"""The GPU's rules, enforced on CPU tensors: NCCL takes device tensors only, CUDA does not mix
devices in one operation, and a host synchronisation is counted wherever it happens.

On a machine without a GPU every tensor is a CPU tensor, so a tensor that would be left on the
host on a GPU machine (and crash NCCL or a CUDA kernel there) passes every CPU test. The rule tells
the two kinds apart by **provenance**:

* **host**: made by a factory (``torch.tensor``, ``zeros``, ``arange``, ``from_numpy``, ...)
  without ``device=`` in the project's own code (or PyTorch's data loading); by ``.cpu()`` or
  ``.to("cpu")`` (the string: DeepSpeed's CPU accelerator calls its device ``"cpu"``, so
  upstream code's ``"cpu"`` is the device); with ``device=x.device`` of a host ``x`` (a host
  tensor's ``.device`` reads ``HOST_DEVICE`` outside PyTorch's own code); in a ``DataLoader``
  batch; by ``torch.load`` (unless mapped to a device); in an object received by an object
  collective; and everything computed from host tensors only.
* **device**: everything else: parameters, activations, whatever upstream libraries allocate (they
  pass ``device=torch.cuda.current_device()``), anything made with ``device=`` or moved with
  ``.to(device)``, and the tests' own tensors (they stand for a model's).

A ``torch.Generator()`` made without ``device=`` in project code is a host generator.

With the rule installed (``install``):

* a collective (every ``torch.distributed`` function, rebound wherever an upstream module holds
  it by name) given a host tensor on a group that was not created with ``backend="gloo"`` raises
  NCCL's error, ``No backend type associated with device type cpu``;
* an operation that mixes a host tensor of one or more dimensions with a device tensor raises
  CUDA's, ``Expected all tensors to be on the same device, but found at least two devices, cuda:0
  and cpu!`` (a 0-dimensional host tensor is a CPU scalar, which CUDA accepts); a host generator
  drawing for a device tensor raises CUDA's generator error;
* every device-to-host synchronisation is counted (``SyncCounter``): ``.item()``, ``.tolist()``,
  ``bool()``/``int()``/``float()``, ``.cpu()``, ``.numpy()``, formatting, outputs whose shape
  depends on values (boolean-mask indexing, ``nonzero``, ``unique``, ...), blocking copies
  between host and device (``.to(device)`` without ``non_blocking=True``, ``torch.tensor(data,
  device=...)``), a host scalar read by a device operation, object collectives, barriers and
  explicit ``synchronize`` calls. Each event records where it happened.

Every message adds where the offending host tensor was made. The rule is test support: the
library never imports it. ``torch.compile``d functions run as plain Python under it (Dynamo
cannot trace its mode). The Python code autograd runs in the backward pass (custom Functions'
``backward``, tensor hooks) runs under the rule too (``autograd``). Its limits: operations only
PyTorch's C++ calls (the built-in backward formulas), hooks on autograd nodes and tensors of the
legacy constructors (``torch.Tensor([...])``) are not seen.
"""

from __future__ import annotations

import atexit
import threading

import torch

from tests.helpers.device_rules import autograd, boundaries
from tests.helpers.device_rules.counting import (
    COUNTER,
    SyncCounter,
    assert_steady_syncs,
    read_report,
    write_report,
)
from tests.helpers.device_rules.operations import DeviceRules
from tests.helpers.device_rules.provenance import (
    GENERATOR_ERROR,
    HOST_DEVICE,
    MIX_ERROR,
    NCCL_ERROR,
    REPO,
    DeviceRuleError,
    is_host,
    mark_device,
    mark_host,
)

__all__ = [
    "GENERATOR_ERROR",
    "HOST_DEVICE",
    "MIX_ERROR",
    "NCCL_ERROR",
    "REPO",
    "DeviceRuleError",
    "SyncCounter",
    "assert_steady_syncs",
    "counter",
    "install",
    "install_for_run",
    "installed",
    "is_host",
    "mark_device",
    "mark_host",
    "read_report",
]


def counter() -> SyncCounter:
    """The process's counter (events of the installed rule)."""
    return COUNTER


_installed: DeviceRules | None = None
_lock = threading.Lock()


def install(report: str | None = None) -> SyncCounter:
    """Enforce the rule in this process from now on (idempotent); returns the counter.
    ``report``: a directory where each rank writes ``rank{r}.json`` (its events by label) at
    exit."""
    global _installed
    with _lock:
        if _installed is None:
            # torch.compile'd functions run as plain Python: Dynamo cannot trace the rule's
            # mode, and this way their operations are checked like any other
            torch._dynamo.config.disable = True
            boundaries.install()
            _installed = DeviceRules()
            _installed.__enter__()
            autograd.install(_installed)  # the Python code autograd runs, too
        if report is not None:
            atexit.register(write_report, report)
    return COUNTER


def installed() -> bool:
    return _installed is not None


def count_iterations() -> None:
    """Label the counter's events with the training iteration they belong to (the trainer
    begins each iteration in its schedule first)."""
    from megatron_tempnet.trainer.schedule import TrainSchedule

    original = TrainSchedule.begin

    def begin(self, iteration, consumed_samples):
        COUNTER.mark(iteration)
        return original(self, iteration, consumed_samples)

    TrainSchedule.begin = begin


def install_for_run(report: str) -> None:
    """An entry point's process: the rule, iterations labelled, the report written at exit."""
    install(report)
    count_iterations()
