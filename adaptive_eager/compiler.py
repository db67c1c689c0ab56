"""Compiled mode: torch.compile's ``neuron`` backend runs whole captured graphs through
the fusion engine.

Entry point: :func:`neuron_backend`, registered through the ``torch_dynamo_backends``
entry point (setup.cfg) as ``backend="neuron"``; ``torch.compile(model)`` with no
backend named uses it for graphs on neuron tensors (``device/dynamo.py``).

The path of one compiled step:

1. TorchDynamo captures a graph (a new shape or a failed guard recompiles; the reason is
   counted, ``COMPILED.recompiles``).
2. AOTAutograd traces it into a forward and a backward aten graph. No decomposition
   table beyond AOTAutograd's own: the graphs hold the op vocabulary eager mode sees, so
   the same legality rules and pattern library apply to both, and adaptive eager is
   measured against compiled mode on equal terms.
3. Mutations of graph inputs go back in place (``reinplace.py``: an optimizer step runs
   eager's ``_foreach_*_`` ops, not functionalization's copies).
4. Each aten graph gets a :class:`GraphRunner`: a graph-sized op window (the adaptive
   window with no size limit and no flush policy). A call records every op of the graph,
   then flushes once ("graph"): the planner plans the whole graph (cycle check, patterns,
   dead intermediates, the on-chip rule) and each fused group is one launch on the
   execution queue. The plan is cached per graph and input structure, and the window runs
   as one native launch on the device worker, as in adaptive eager. A sync point inside a
   graph (a CPU fallback, a data-dependent shape) flushes early, as in eager.

Everything downstream is the eager machinery: the cost model, the trace, deferred errors
(located at the user's line through the FX node's ``stack_trace``: the generated code's
line -> its node, ``location.register_generated_code``),
poisoning, ``NEURON_LAUNCH_BLOCKING``. Shapes: a graph compiled for symbolic shapes (an
explicit ``dynamic=True``, or Dynamo's automatic dynamic shapes after a size change) is
planned per concrete shape, so every kernel the device runs has static shapes.
"""
from __future__ import annotations

import copy
import itertools
import re
import sys
import weakref

import torch
from torch._dynamo.backends.common import aot_autograd
from torch.fx._lazy_graph_module import _LazyGraphModule

from adaptive_eager_device.ops import recorder
from adaptive_eager_device.hardware import sink
from adaptive_eager_device.core.config import CONFIG
from adaptive_eager_device import _C as _native
from adaptive_eager_device.hardware.execution_queue import HOST_LOCK, QUEUE
from adaptive_eager_device.hardware.streams import STATE as _STREAMS
from adaptive_eager_device.core.location import SourceLocation, is_internal, register_generated_code
from adaptive_eager_device.core.counters import COUNTERS
from adaptive_eager_device.core.reasons import Flush
from . import replay
from .host_split import split_host_part
from .reinplace import inputs_distinct, reinplace_input_mutations
from .statistics import COMPILED
from .policies import POLICIES
from .window import AdaptiveSink, WindowPolicy

_GRAPH_IDS = itertools.count()
_MAX_SIGNATURES = 32  # templates (or refusals) kept per graph
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


class _WholeGraph(WindowPolicy):
    """The window policy of a compiled graph: no size limit, no early flush."""

    max_ops = min_ops = sys.maxsize
    policy = "ours"  # a compiled graph is planned whole by our rules, whatever adaptive eager's policy

    def limits(self) -> tuple:
        return POLICIES[self.policy], self.max_ops, self.min_ops, self.shallow_us


class _GraphSink(AdaptiveSink):
    """A compiled graph's window. While a call is recorded (``recording``), it notes
    early flushes and keeps the records of the one "graph" flush (``replay.py``)."""

    def __init__(self) -> None:
        super().__init__(_WholeGraph(), name="compiled", shared_caches=False)
        self.recording = None

    def flush(self, reason: str, key: tuple | None = None) -> None:
        recording = self.recording
        if recording is not None:
            if reason == Flush.GRAPH:
                recording.capture(self.records)
            else:
                recording.early_flushes += 1
        super().flush(reason, key)


class GraphRunner:
    """One AOTAutograd graph (forward or backward) on the device: its own graph-sized
    window, plan cache and kernel cache. Called boxed (a list of inputs, which it frees).
    A call whose input signature has a template replays it (``replay.py``) instead of
    running the FX code."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str) -> None:
        self._boxed_call = True  # an instance attribute: the wrappers AOTAutograd adds copy it
        self.kind = kind
        self.sink = _GraphSink()
        self.entry = COMPILED.graph(next(_GRAPH_IDS), kind, sum(1 for n in gm.graph.nodes if n.op == "call_function"),
                                    {"plan_cache": self.sink.plan_cache, "kernel_cache": self.sink.kernel_cache})
        # Input mutations back in place (reinplace.py); the graph as traced stays for a
        # call whose mutated inputs share storage with other inputs.
        traced_graph = copy.deepcopy(gm.graph)
        position = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        written = reinplace_input_mutations(gm)
        self.written_inputs = tuple(position[p] for p in written)
        self.entry["inputs_written_in_place"] = len(written)
        self.gm = gm
        self.as_traced = torch.fx.GraphModule(gm, traced_graph) if written else gm
        # the host part split off (an optimizer's CPU step counters), so the rest replays
        self.split = split_host_part(gm)
        self.entry["host_values_split_off"] = self.split.hoisted if self.split else 0
        modules = (self.gm, self.as_traced) + ((self.split.device,) if self.split else ())
        for module in {id(m): m for m in modules}.values():
            _LazyGraphModule.force_recompile(module)  # its code now, so that its file name is known
            register_generated_code(module.forward.__code__.co_filename, _node_locator(module))
        # input signature -> Template, or the reason its calls run the FX code
        self.templates: dict = {}

    def __call__(self, args: list):
        key, storages = (None, None)
        gm = None
        if CONFIG.compiled_replay:
            split = self.split
            if split is not None and (not self.written_inputs or inputs_distinct(args, self.written_inputs)):
                args.extend(split.host(*args))  # the host part first: the device part takes its values
                gm = split.device
            key, storages = replay.input_signature(args)
            if storages is not None:
                template = self.templates.get(key)
                if type(template) is replay.Template:
                    reason = _replay_refused()
                    if reason is None:
                        outputs = self._replay(template, args, storages)
                        if outputs is not None:
                            return outputs
                        reason = "out of memory: the FX code raises at the op"
                    self._fell_back(reason)
                elif template is not None:
                    self._fell_back(template)
            else:
                self._fell_back(key)
        recording = None
        if storages is not None and key not in self.templates and _replay_refused() is None:
            recording = replay.Recording(args, storages)
        return self._run(args, recording, key, gm)

    def _run(self, args: list, recording, key, gm=None):
        """The FX code (``gm``: the graph's, or its device part): every op through the
        per-op path into the window, one flush."""
        previous = sink.current_sink()
        sink.set_sink(self.sink)  # flushes the eager window first
        launched = COUNTERS.kernels_launched
        recorded = COUNTERS.ops_recorded
        if gm is None:  # (a split's written inputs are distinct: checked before its host part ran)
            gm = self.gm
            if self.written_inputs and not inputs_distinct(args, self.written_inputs):
                gm = self.as_traced
                if recording is not None:
                    self.templates[key] = "mutated inputs alias: the graph as traced runs"
                    recording = None
        args_after = None
        self.sink.recording = recording
        if recording is not None:
            recorder.HOST_SNAPSHOTS = recording.snapshots
        try:
            outputs = gm(*args)
            if recording is not None:
                after, _ = replay.input_signature(args)
                args_after = list(args) if after == key else None
            args.clear()
        finally:
            recorder.HOST_SNAPSHOTS = None
            self.sink.flush(Flush.GRAPH)
            self.sink.recording = None
            sink.set_sink(previous)
            entry = self.entry
            entry["calls"] += 1
            entry["ops"] += COUNTERS.ops_recorded - recorded
            entry["launches"] += COUNTERS.kernels_launched - launched
        if recording is not None:
            self._keep(recording, outputs, args_after, key, gm)
        return outputs

    def _keep(self, recording, outputs, args_after, key, gm) -> None:
        """Make the recorded call a template, or note why its signature cannot replay."""
        try:
            if args_after is None:
                raise replay.NotReplayable("the call changed an input's metadata")
            self.templates[key] = replay.Template(recording, outputs, args_after, gm)
        except replay.NotReplayable as reason:
            self.templates[key] = str(reason)
        if len(self.templates) > _MAX_SIGNATURES:  # a graph of symbolic shapes meets many
            del self.templates[next(iter(self.templates))]  # the oldest
        self.entry["replay_signatures"] = sum(type(t) is replay.Template for t in self.templates.values())

    def _replay(self, template, args: list, storages):
        """A call replayed from its template; None when its memory cannot be allocated (the
        FX code then runs, and raises at the op, as eager does)."""
        made = template.binder.call(args, storages, CONFIG.hbm_bytes)  # storages, cells, outputs
        if made is None:
            return None
        table, cells, outputs = made
        previous = sink.current_sink()
        sink.set_sink(self.sink)  # flushes the eager window first
        launched = COUNTERS.kernels_launched
        try:
            with HOST_LOCK:  # one issue order, as the per-op path issues under it
                args.clear()  # (before the plan: a written input may be dead now)

                def plan_for(cache):
                    return template.plan_for(table, cache)

                def native_launch(plan):
                    """One native call of the template's program (its records made only if the
                    worker hands it back), issued as the per-op path would have issued it."""
                    program = template.program(plan, table)
                    if program is None:
                        return None
                    stream = _STREAMS.current
                    first = QUEUE.issue_ops(template.ops)
                    COUNTERS.ops_recorded += template.ops
                    call = replay.ReplayedCall(template, table, stream, first, plan, program[1])
                    return _native.bind(program[0], table, call, cells), program[1], stream

                if not self.sink.hand_over_program(Flush.GRAPH, plan_for, native_launch):
                    cells.wrap(table)  # the records name every storage
                    self.sink.records = template.issue(table)
                    self.sink.flush(Flush.GRAPH, template.structure(table))
                table = cells = None
        finally:
            sink.set_sink(previous)
        entry = self.entry
        entry["calls"] += 1
        entry["replays"] += 1
        entry["ops"] += template.ops
        entry["replayed_ops"] += template.ops
        entry["launches"] += COUNTERS.kernels_launched - launched
        return outputs

    def _fell_back(self, reason: str) -> None:
        fallbacks = self.entry["replay_fallbacks"]
        fallbacks[reason] = fallbacks.get(reason, 0) + 1


def _replay_refused():
    """Why no call can replay now (everything then runs the FX code), or None."""
    if CONFIG.launch_blocking:
        return "NEURON_LAUNCH_BLOCKING"
    return None


def _node_locator(gm: torch.fx.GraphModule):
    """lineno of gm's generated code -> the user's line of the node it runs (from the
    node's ``stack_trace``), or None. Holds gm weakly: a graph Dynamo drops is freed."""
    module = weakref.ref(gm)
    line_map = getattr(gm, "_lineno_map", None) or {}
    start = getattr(gm, "_prologue_start", 0)  # the map counts lines from forward's def

    def locate(lineno: int):
        index = line_map.get(lineno - start)
        gm = module()
        if index is None or gm is None:
            return None
        nodes = list(gm.graph.nodes)
        return user_frame(nodes[index].meta.get("stack_trace")) if index < len(nodes) else None

    return locate


def user_frame(stack_trace: str | None):
    """The innermost frame of an FX ``stack_trace`` that is the user's code."""
    if not stack_trace:
        return None
    frames = [m for m in _FRAME.finditer(stack_trace) if not is_internal(m["file"])]
    if not frames:
        return None
    last = frames[-1]
    return SourceLocation(last["file"], int(last["line"]), last["function"])


def _compiler(kind: str):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        return GraphRunner(gm, kind)

    return compile_graph


_AOT = aot_autograd(fw_compiler=_compiler("forward"), bw_compiler=_compiler("backward"),
                    inference_compiler=_compiler("inference"), keep_inference_input_mutations=True)


def neuron_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """torch.compile's ``neuron`` backend (``backend="neuron"``): a Dynamo graph ->
    AOTAutograd forward and backward graphs, each run by a :class:`GraphRunner`.
    ``mode``/``options`` are Inductor's and are refused."""
    if options:
        raise RuntimeError(f"torch.compile(backend='neuron') takes no mode or options (got {sorted(options)}); "
                           "they configure Inductor, which has no code generator for the neuron device")
    COMPILED.captured(_recompile_reason())
    return _AOT(gm, example_inputs)


def _recompile_reason():
    """Why Dynamo is compiling this frame again (its first failed guard), or None for a
    first compile."""
    try:
        from torch._dynamo.utils import get_metrics_context

        return get_metrics_context()._metrics.get("recompile_reason")
    except Exception:  # a private structure of Dynamo's: the count still holds
        return None
