"""``torch.compile(model)`` on neuron tensors picks the ``neuron`` backend, as on TorchNeuron.

Entry point: :func:`install` (at registration; cheap: nothing of Dynamo is imported).

torch.compile's default backend is Inductor, which has no code generator for this
device. So Inductor's entry (``torch._TorchCompileInductorWrapper``) hands a graph whose
inputs are on neuron to the ``neuron`` backend (the runtime's ``adaptive_eager.compiler``,
found through the ``torch_dynamo_backends`` entry point), and CPU graphs to Inductor as
before. A program that names ``backend="inductor"`` explicitly, or gives Inductor's
``mode`` or ``options``, gets the ``neuron`` backend too, with a one-line warning (once)
that Inductor's choice and options do not apply: libraries ask for Inductor by default
(transformers' static-cache ``generate`` compiles with ``backend="inductor",
mode="reduce-overhead"``), and a user must not have to change them. ``torch.compile`` is
wrapped only to tell an explicit choice from the default.
"""
from __future__ import annotations

import functools
import threading
import warnings

import torch

_EXPLICIT = threading.local()  # set while torch.compile runs with an explicit Inductor choice


_WARNED = []


def _on_neuron(gm, inputs) -> bool:
    """Does the graph touch neuron tensors: as inputs, or as tensors it holds (an
    optimizer's state can be a graph attribute) or computes?"""
    if any(isinstance(x, torch.Tensor) and x.device.type == "neuron" for x in inputs):
        return True
    for node in getattr(getattr(gm, "graph", None), "nodes", ()):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor) and value.device.type == "neuron":
            return True
    return False


def _skip_our_code() -> None:
    """Dynamo must not trace into this package or the runtime (the device guard's
    methods, say, that torch.accelerator calls back into): they are the device, as a C++
    backend's code would be. Each room and module of the device is skipped, not the
    simulated NKI (``device/nki``, the package ``nki``): user code calls its kernels, and
    Dynamo traces a kernel's ``__call__`` on neuron tensors down to one node of the graph
    (``nki/_torch.py: device_call``, allowed in the graph). Likewise each module of the
    runtime but its kernel library, whose functions are thin wrappers of custom operators
    (one node each)."""
    if _SKIPPED:
        return
    _SKIPPED.append(True)
    import importlib.util
    import os
    import pkgutil

    from torch._dynamo import trace_rules

    for module in pkgutil.iter_modules([os.path.dirname(os.path.abspath(__file__))]):
        if module.name != "nki":
            trace_rules.add(f"{__package__}.{module.name}")
    runtime = importlib.util.find_spec("adaptive_eager")
    if runtime is not None:  # the runtime's modules, not its kernel library (``adaptive_eager.kernels``),
        for module in pkgutil.iter_modules(runtime.submodule_search_locations):  # user code calls it
            if module.name != "kernels":
                trace_rules.add(f"adaptive_eager.{module.name}")


_SKIPPED: list = []

# Threads compiling kernels in the background (adaptive_eager/generated.py: Inductor's CPU
# code for compiled mode's fused kernels). FX tracing sets a process-wide flag
# (torch.fx._symbolic_trace._is_fx_tracing_flag) that Dynamo reads on every call of a
# compiled function, on any thread, to refuse "FX tracing a dynamo-optimized function";
# while such a thread traces, the flag is its own, not the program's.
BACKGROUND_TRACERS: set = set()


def _thread_aware_fx_flag() -> None:
    symbolic = torch.fx._symbolic_trace
    original = symbolic.is_fx_symbolic_tracing
    if getattr(original, "_neuron_thread_aware", False):
        return

    @functools.wraps(original)
    def is_fx_symbolic_tracing() -> bool:
        if BACKGROUND_TRACERS and threading.get_ident() not in BACKGROUND_TRACERS:
            return False  # (the flag is a background compile's)
        return original()

    is_fx_symbolic_tracing._neuron_thread_aware = True
    symbolic.is_fx_symbolic_tracing = is_fx_symbolic_tracing


def install() -> None:
    wrapper = torch._TorchCompileInductorWrapper
    if getattr(wrapper, "_neuron_routing", False):
        return
    original_init, original_call, original_compile = wrapper.__init__, wrapper.__call__, torch.compile

    @functools.wraps(original_init)
    def __init__(self, mode, options, *args, **kwargs):
        original_init(self, mode, options, *args, **kwargs)
        self._neuron_explicit = getattr(_EXPLICIT, "value", False) or (mode not in (None, "default")) or bool(options)

    @functools.wraps(original_call)
    def __call__(self, model_, inputs_, **kwargs):
        if not _on_neuron(model_, inputs_):
            return original_call(self, model_, inputs_, **kwargs)
        if self._neuron_explicit and not _WARNED:
            _WARNED.append(True)
            warnings.warn("Inductor has no code generator for the neuron device: this graph compiles with "
                          "backend='neuron' instead, and Inductor's mode and options do not apply", stacklevel=2)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("neuron")(model_, inputs_)

    @functools.wraps(original_compile)
    def compile(*args, **kwargs):
        _skip_our_code()
        _thread_aware_fx_flag()  # before Dynamo's wrapper takes the function
        previous = getattr(_EXPLICIT, "value", False)
        _EXPLICIT.value = kwargs.get("backend") == "inductor"
        try:
            return original_compile(*args, **kwargs)
        finally:
            _EXPLICIT.value = previous

    wrapper.__init__, wrapper.__call__ = __init__, __call__
    wrapper._neuron_routing = True
    torch.compile = compile
