"""Registering ``neuron`` with PyTorch through the PrivateUse1 extension point.

Entry point: :func:`register` (idempotent). It runs on ``import torch`` through the
``torch.backends`` entry point (PyTorch's autoload convention), or on
``import adaptive_eager``. It:

1. renames PrivateUse1 to ``neuron`` and installs ``torch.neuron`` (``device/api.py``),
   device hooks and a device guard, so ``torch.device('neuron')``, ``t.neuron()``,
   ``module.to('neuron')`` and ``torch.accelerator`` work;
2. registers a boxed fallback at the PrivateUse1 key: it receives what has no neuron
   tensor argument yet names the device (factories: ``torch.zeros(..., device='neuron')``)
   and sends it to the dispatcher, like every op on a ``NeuronTensor``;
3. registers mixed precision for ``torch.autocast('neuron')`` (``device/autocast.py``);
4. routes ``torch.accelerator.synchronize`` to ``torch.neuron.synchronize`` (PyTorch's
   Python device guard cannot synchronize). Streams are ``torch.neuron.Stream``;
   ``torch.accelerator.current_stream()`` reports the guard's default stream.
"""
from __future__ import annotations

import atexit
import functools

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from . import api
from .autocast import register_autocast

_STATE = {"registered": False, "libraries": []}


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _refuse_bad_configuration() -> None:
    """The device's first use with a bad ``NEURON_*`` value raises it (device/config.py).
    Every neuron tensor is born here: a factory or a copy onto the device."""
    from .config import CONFIG

    problem = CONFIG.problem()
    if problem is not None:
        raise ValueError(problem)


def _boxed_fallback(op, *args, **kwargs):
    from .dispatch import dispatch
    from .queue import HOST_LOCK

    _refuse_bad_configuration()
    with HOST_LOCK:
        return dispatch(op, args, kwargs)


# Ops that C++ code calls on neuron tensors with the Python dispatch key excluded
# (``torch.tensor(data, device='neuron')`` copies under such a guard). They reach the
# PrivateUse1 key, where a boxed Python *fallback* cannot take tensor arguments (PyTorch
# asserts), so each gets an explicit PrivateUse1 kernel that calls the dispatcher.
_EXPLICIT_OPS = ("copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "detach", "alias", "view", "lift_fresh")


def _explicit_kernel(op):
    def kernel(*args, **kwargs):
        from .dispatch import dispatch
        from .queue import HOST_LOCK

        _refuse_bad_configuration()
        with HOST_LOCK:
            return dispatch(op, args, kwargs)

    return kernel


def _route_to_neuron(name: str, neuron_function) -> None:
    """Make ``torch.accelerator.<name>`` call ``neuron_function`` when the accelerator is
    neuron: PyTorch's Python device guard has no hook for it (its C++ methods are fixed
    no-ops)."""
    original = getattr(torch.accelerator, name)
    if getattr(original, "_neuron_routed", False):
        return

    @functools.wraps(original)
    def routed(*args, **kwargs):
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None and accelerator.type == "neuron":
            return neuron_function(*args, **kwargs)
        return original(*args, **kwargs)

    routed._neuron_routed = True
    setattr(torch.accelerator, name, routed)


def _patch_accelerator() -> None:
    # Only synchronize: routing torch.accelerator's stream functions through Python code
    # sends torch.compile into infinite recursion (its frame hook queries the current
    # stream, and would then try to compile the routing function itself).
    _route_to_neuron("synchronize", api.synchronize)


def register() -> None:
    """Make ``neuron`` a PyTorch device. Safe to call more than once."""
    if _STATE["registered"]:
        return
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", "neuron"):
        raise RuntimeError(
            f"PrivateUse1 is already registered as {name!r}; one process can hold only one "
            "out-of-tree PrivateUse1 device, so 'neuron' cannot be registered."
        )
    if name == "privateuseone":
        _setup_privateuseone_for_python_backend(
            "neuron", backend_module=api, hook=_Hooks(), device_guard=_DeviceGuard()
        )
    library = torch.library.Library("_", "IMPL")
    library.fallback(_boxed_fallback, dispatch_key="PrivateUse1")
    _STATE["libraries"].append(library)
    explicit = torch.library.Library("aten", "IMPL")
    for name in _EXPLICIT_OPS:
        explicit.impl(name, _explicit_kernel(getattr(torch.ops.aten, name).default), "PrivateUse1")
    _STATE["libraries"].append(explicit)
    register_autocast()
    _patch_accelerator()
    from .tensor import NeuronTensor  # (imports the dispatcher)

    _enable_multi_tensor_paths(NeuronTensor)
    from .queue import QUEUE

    atexit.register(QUEUE.drain)
    from .trace import start_from_environment

    start_from_environment()
    freeze_import_time_objects()
    _STATE["registered"] = True


def _enable_multi_tensor_paths(tensor_type) -> None:
    """Let torch.optim and clip_grad_norm_ take their multi-tensor (foreach) paths on
    ``neuron``, as they do on CUDA and on any C++ PrivateUse1 backend.

    PyTorch chooses foreach by default for a device in
    ``_get_foreach_kernels_supported_devices()`` (which lists PrivateUse1) when every
    parameter's type is in ``_foreach_supported_types``. A device written in Python has
    its tensors in a subclass, so without this the type check alone sends every optimizer
    step down the per-parameter loop. PyTorch registers DTensor in the same two lists."""
    from torch.optim import optimizer as _optimizer
    from torch.utils import _foreach_utils

    for supported in (_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if tensor_type not in supported:
            supported.append(tensor_type)


def freeze_import_time_objects() -> None:
    """Move the objects alive now (torch's modules, ~170k of them) out of the cyclic
    garbage collector's reach. Called at registration, and again once the adaptive
    runtime has imported its planner (networkx).

    Every recorded op allocates a few small GC-tracked objects that live until the device
    worker runs the kernel. When the queue is deep they survive into the oldest GC
    generation, and each full collection then walks every object torch created at import:
    tens of milliseconds, tripling the host's per-op cost (bench/overhead.py). Frozen
    objects are still freed by reference counting; only cycles among them would not be
    collected, and at import time there are none to speak of.
    """
    import gc

    gc.freeze()
