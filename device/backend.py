"""Registering ``neuron`` with PyTorch through the PrivateUse1 extension point.

Entry point: :func:`register` (idempotent). It runs on ``import torch`` through the
``torch.backends`` entry point (PyTorch's autoload convention), or on
``import adaptive_eager``. It:

1. renames PrivateUse1 to ``neuron`` and installs ``torch.neuron`` (``device/api.py``),
   so ``torch.device('neuron')``, ``t.neuron()``,
   ``module.to('neuron')`` and ``torch.accelerator`` work;
2. loads the C++ hooks (``device/csrc/``, built as ``_C``): the device allocator, storage
   resizing, pinned host memory, generators, and the device guard of the device indices
   (``device/memory/indices.py``);
3. sends every aten op on a neuron tensor, and every factory naming the device, to the
   dispatcher (``ops/dispatch.py: run``): one boxed fallback at the PrivateUse1 key for the
   ops with no kernel for the device, and a PrivateUse1 kernel for each op whose
   composite would otherwise run (structured ops would arrive as ``empty`` plus ``.out``,
   ``full`` as ``empty`` plus ``fill_``), so that each op reaches it whole, as written;
4. registers mixed precision for ``torch.autocast('neuron')`` (``device/ops/autocast.py``);
5. routes ``torch.accelerator.synchronize`` to ``torch.neuron.synchronize`` (PyTorch's
   Python device guard cannot synchronize);
6. makes ``torch.compile(model)`` of neuron graphs use the ``neuron`` backend
   (``device/dynamo.py``);
7. registers the ``neuron`` communication backend with torch.distributed, the device's
   default (gloo on the host bytes, ``device/ops/collectives.py``).
"""
from __future__ import annotations

import atexit
import functools
import re
import warnings

import torch


def _claim_privateuse1() -> None:
    """Rename PrivateUse1 to ``neuron`` before any module of the device is imported: they
    name the device (``torch.device("neuron")``) at import."""
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", "neuron"):
        raise RuntimeError(
            f"PrivateUse1 is already registered as {name!r}; one process can hold only one "
            "out-of-tree PrivateUse1 device, so 'neuron' cannot be registered.")
    if name == "privateuseone":
        torch.utils.rename_privateuse1_backend("neuron")


_claim_privateuse1()

# The device's modules name the device at import (torch.device("neuron")).
from . import _C as _native  # noqa: E402
from . import api, dynamo  # noqa: E402
from .core.config import CONFIG  # noqa: E402
from .core.errors import quantized_refusal, user_facing, users_error  # noqa: E402
from .core.reasons import Flush  # noqa: E402
from .hardware.execution_queue import HOST_LOCK, QUEUE  # noqa: E402
from .hardware.sink import drain, synchronize  # noqa: E402
from .hardware.trace import start_from_environment  # noqa: E402
from .memory.indices import MULTI  # noqa: E402
from .memory.storage import DeviceStorage  # noqa: E402
from .ops import attention, cow, rnn, sparse  # noqa: E402
from .ops.autocast import register_autocast  # noqa: E402
from .ops.collectives import register_backend  # noqa: E402
from .ops.device_guard import on_its_device  # noqa: E402
from .ops.dispatch import install_native_recorder, run  # noqa: E402
from .ops.op_table import cpu_kernel_over_composite, op_entry, overload_named, registration_name  # noqa: E402
from .ops.rng import GENERATOR  # noqa: E402
from .ops.shapes import SHAPE_CACHE  # noqa: E402

_STATE = {"registered": False, "libraries": []}


def _refuse_bad_configuration() -> None:
    """The device's first use with a bad ``NEURON_*`` value raises it (device/core/config.py).
    Every neuron tensor is born in a kernel registered here."""
    problem = CONFIG.problem()
    if problem is not None:
        raise users_error(ValueError(problem))


def _make_handler():
    """The body of every kernel registered here: the op of an ``OpEntry`` on the
    dispatcher, under the host lock. Its errors raise at the call, inside ``backward()``
    too, as on the CPU: the device guard is C++ (``device/csrc/hooks.cpp``), so an error
    leaving a device op on the autograd engine's thread reaches ``backward()``'s caller.
    Built once, with its names bound: it runs for every op."""

    acquire, release = HOST_LOCK.acquire, HOST_LOCK.release
    checked = not CONFIG.errors
    # several device indices: each op runs under its device's guard
    run_entry = on_its_device(run) if MULTI else run
    # a kernel hitting the shape cache, recorded in one C call (device/csrc/record.cpp),
    # else NotImplemented; with one device index (the guard is Python's)
    native_record = _native.record if not MULTI and install_native_recorder() else None

    def handle(entry, args, kwargs):
        if not checked:
            _refuse_bad_configuration()
        acquire()
        try:
            if native_record is not None:
                result = native_record(entry, args, kwargs)
                if result is not NotImplemented:
                    return result
            return run_entry(entry, args, kwargs)
        finally:
            release()

    # The same in C, without these Python frames, for the kernels registered through
    # _C.fast_kernel (hot_path.cpp), when nothing above is Python's to check
    if checked and native_record is not None:
        _native.set_fast_path(acquire, release, _entry_of, run)
    else:
        _native.set_fast_path(None, None, None, None)
    return handle


def _entry_of(op):
    """``op``'s OpEntry, made once (kept by id(): an OpOverload hashes in Python)."""
    entry = _ENTRY_BY_ID.get(id(op))
    if entry is None:
        entry = _ENTRY_BY_ID[id(op)] = op_entry(op)
    return entry


def _boxed_fallback(op, *args, **kwargs):
    return _handle(_entry_of(op), args, kwargs)


_ENTRY_BY_ID: dict = {}


def _dense_kernel(op):
    """The kernel of ``op`` at PrivateUse1: the handler, with ``op``'s entry looked up
    at its first call."""
    entry = None

    def kernel(*args, **kwargs):
        nonlocal entry
        if entry is None:
            entry = _entry_of(op)
        return _handle(entry, args, kwargs)

    return kernel


def _whole_ops():
    """The aten overloads whose composite kernel would run for the device (and decompose
    them) unless the device has a kernel of its own: ``CompositeExplicitAutograd`` and
    its non-functional variant. ``CompositeImplicitAutograd`` ops decompose above the
    device, as on every backend; ops with backend kernels only reach the fallback. Views
    keep their composites, which make the view in C++ as on any device (FakeTensor calls
    them on tensors of its own, which no Python kernel may wrap)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or has(name, "CompositeImplicitAutograd") or has(name, "PrivateUse1"):
            continue
        if has(name, "CompositeExplicitAutograd") or has(name, "CompositeExplicitAutogradNonFunctional"):
            op = overload_named(name)
            if op.is_view or torch.Tag.inplace_view in op.tags:
                continue
            yield op


def _cpu_kernel_ops():
    """The aten overloads that are composites for PrivateUse1 but kernels on the CPU
    (``op_table.cpu_kernel_over_composite``: ``silu_backward``, ``mish_backward``,
    ``native_channel_shuffle``). A PrivateUse1 kernel makes the dispatcher run the device's
    kernel (the CPU's, on the device bytes) and, at AutogradPrivateUse1, the op's autograd
    formula instead of the composite, as for the CPU; otherwise the composite would
    decompose them into ops that round at each step."""
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and cpu_kernel_over_composite(name):
            yield overload_named(name)


def _refuse_sparse(op, *args, **kwargs):

    raise users_error(NotImplementedError(
        f"compressed sparse tensors (CSR, CSC, BSR, BSC) are not supported on the neuron device ({op._schema.name}); "
        "convert with .to_dense() or .to_sparse() (COO) first"
    ))


def _refuse_quantized(op, *args, **kwargs):
    """Quantized tensors on the device: ``QuantizedPrivateUse1`` has no kernel in PyTorch
    (the quantized kernels are the CPU's and CUDA's), so the device refuses them at the
    call by name, where the dispatcher's own message lists backends."""
    raise users_error(quantized_refusal(op._schema.name))


def _register_kernels() -> None:
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_native.fast_kernel(_boxed_fallback, None), dispatch_key="PrivateUse1")
    fallback.fallback(user_facing(_refuse_quantized), dispatch_key="QuantizedPrivateUse1")

    constructors = torch.library.Library("aten", "IMPL")
    sparse.register(fallback, constructors)  # COO: the CPU's sparse kernels on host copies (device/ops/sparse.py)
    fallback.fallback(user_facing(_refuse_sparse), dispatch_key="SparseCsrPrivateUse1")
    for name in torch._C._dispatch_get_all_op_names():  # compressed sparse tensors of device parts
        base = name[len("aten::"):].split(".")[0]
        if name.startswith("aten::") and re.match(r"_?sparse_(csr|csc|bsr|bsc|compressed)_tensor", base):
            op = overload_named(name)
            for key in ("PrivateUse1", "SparseCsrPrivateUse1"):
                constructors.impl(registration_name(op), user_facing(functools.partial(_refuse_sparse, op)), key)
    _STATE["libraries"].append(constructors)
    whole = torch.library.Library("aten", "IMPL")
    for op in (*_whole_ops(), *_cpu_kernel_ops()):
        if op is not torch.ops.aten._lazy_clone.default:
            whole.impl(registration_name(op), _native.fast_kernel(_dense_kernel(op), op), "PrivateUse1")
    # copy-on-write lazy clones, as the CPU makes them (device/ops/cow.py)
    whole.impl("_lazy_clone", user_facing(cow.lazy_clone), "PrivateUse1")
    # c10d's collectives have PrivateUse1 kernels that hand the tensors to the process
    # group's backend, which cannot read device memory: the device runs them on the host
    # bytes (device/ops/collectives.py) instead.
    collectives = torch.library.Library("c10d", "IMPL")
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for name in torch._C._dispatch_get_all_op_names():
            if name.startswith("c10d::") and has(name, "PrivateUse1"):
                op = overload_named(name)
                collectives.impl(name[len("c10d::"):], _native.fast_kernel(_dense_kernel(op), op), "PrivateUse1")
    # `param.data = device_tensor` (module.to keeps each Parameter's identity so, and
    # tied weights stay tied): CPU and neuron tensors are both dense, as CPU and CUDA
    # are; PyTorch leaves the answer for PrivateUse1 to the backend.
    whole.impl("_has_compatible_shallow_copy_type", _dense_both, "PrivateUse1")

    attention.register(whole)  # scaled_dot_product_attention: the CPU's choice of kernel
    rnn.register(whole)  # LSTM, GRU and RNN layers and cells: the CPU's branch of RNN.cpp
    _STATE["libraries"] += [fallback, whole, collectives]


def _dense_both(tensor, other) -> bool:
    return tensor.layout == torch.strided and other.layout == torch.strided


def _load_hooks() -> None:
    """The C++ hooks: allocator, storage resizing, pinned memory, generators, device guard."""

    def resize(storage, nbytes):
        synchronize(Flush.STORAGE_RESIZE)
        if storage is None:
            return DeviceStorage.of_bytes(nbytes)
        storage.resize_bytes(nbytes)
        return storage

    _native.init(GENERATOR, lambda: synchronize(Flush.RNG_STATE), resize, CONFIG.device_count, CONFIG.initial_device)
    _native.set_cow_copy(cow.copy_shared)


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


# The setters of process-wide settings that the CPU kernels the device runs read as they
# run, on the worker thread, after the host issued them.
_GLOBAL_SETTINGS = (
    "set_default_dtype",  # a factory without a dtype, the type of a Python float
    "set_default_tensor_type",
    "use_deterministic_algorithms",  # empty's NaN fill, the deterministic index_put_ ...
    "set_deterministic_debug_mode",
    "set_num_threads",  # how a CPU kernel splits its work, which may round differently
)


def _drain_before_global_settings_change() -> None:
    """Each setter in ``_GLOBAL_SETTINGS`` first waits for the kernels already issued
    (``sink.drain``), so every kernel runs under the settings it was issued with:
    ``torch.randn(n, device="neuron")`` then ``torch.set_default_dtype(torch.float64)``
    must still give float32. Only a call while neuron work is pending waits. The shape
    cache is emptied too: the CPU checks a new signature runs (``shapes.check_on_cpu``)
    may read the setting (``put_`` refuses deterministic mode), and a cache hit must not
    skip them."""

    def draining(setter):
        @functools.wraps(setter)
        def set_then(*args, **kwargs):
            drain(Flush.GLOBAL_SETTING)
            SHAPE_CACHE.clear()  # the CPU's checks cached with a signature may read them (put_ alerts)
            result = setter(*args, **kwargs)
            QUEUE.follow_threads()  # the worker's kernels: the host's intra-op threads
            return result

        set_then._neuron_drains = True
        return set_then

    for name in _GLOBAL_SETTINGS:
        setter = getattr(torch, name)
        if not getattr(setter, "_neuron_drains", False):
            setattr(torch, name, draining(setter))


def register() -> None:
    """Make ``neuron`` a PyTorch device. Safe to call more than once."""
    if _STATE["registered"]:
        return
    # the package's __init__ renamed PrivateUse1 before importing this module
    if not hasattr(torch, "neuron"):
        torch.utils.generate_methods_for_privateuse1_backend()
        torch._register_device_module("neuron", api)
    _load_hooks()
    global _handle
    _handle = _make_handler()
    _register_kernels()
    register_autocast()
    _patch_accelerator()
    _drain_before_global_settings_change()

    dynamo.install()

    register_backend()

    atexit.register(QUEUE.drain)

    start_from_environment()
    _STATE["registered"] = True
    # (The runtime loads through its own entry point when the environment asks for it,
    # adaptive_eager_autoload: the device never imports it.)
    freeze_import_time_objects()


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
