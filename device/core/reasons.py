"""Every reason the runtime gives, in one table: why the op window flushed (a sync point,
a flush-policy decision or a mode change) and why the planner refused a fusion.

Entry points: :class:`Flush` and :class:`Refused` (the reasons: a ``StrEnum`` each, so a
reason counts, logs and dumps as its plain string), :meth:`Flush.of` and
:meth:`Refused.of` (a reason with the op or pattern it concerns: ``"barrier: aten::nonzero"``),
and :func:`explain` (a reason, with or without that detail, in plain words).

The producers (``device/``'s sync points, the adaptive window's flush policy, the planner)
give only these members; the statistics keep their strings, and the stats CLI, the HTML
report and the demo read the explanations from here. ``tests/device/test_reasons.py`` checks that
no producer passes a string of its own, so a new reason cannot land unexplained.
"""
from __future__ import annotations

import enum


class _Reason(enum.StrEnum):
    def __new__(cls, value: str, why: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.why = why
        return member

    def of(self, detail) -> str:
        """This reason about one op, kernel or pattern: ``"fallback: aten::nonzero"``."""
        return f"{self.value}: {detail}"


class Flush(_Reason):
    """Why the op window was flushed (launched) before its ops could wait longer."""

    # sync points: the host waits for the device
    SYNCHRONIZE = "synchronize", "explicit synchronize()"
    HOST_READ = "host_read", "the host reads a value the device computes (.item(), .tolist(), bool(tensor))"
    COPY_TO_HOST = "copy_to_host", "a copy to the host (.cpu(), .numpy() of a copy, printing, torch.save)"
    FALLBACK = "fallback", "an op runs on the CPU and needs its inputs"
    META_REJECTED = "meta_rejected", "the op's shape function refused its arguments, so the CPU runs it to raise CPU's error"
    MEMORY_OVERLAP = "memory_overlap", "a written tensor overlaps another argument, so the CPU runs the op to raise its error"
    DATA_DEPENDENT = "data_dependent", "op with a data-dependent output shape"
    RANDOM_ON_HOST = "random_on_host", "a random op the device cannot queue draws on the host, in stream order"
    RNG_STATE = "rng_state", "the generator's state is read or set (get_rng_state, manual_seed, a Generator)"
    RESIZE = "resize", "a tensor's storage is resized in place"
    STORAGE_RESIZE = "storage_resize", "an untyped storage is resized (FSDP2 frees and re-allocates parameters so)"
    METADATA = "metadata", "an op that changes a tensor's metadata in place must see its pending writes"
    COLLECTIVE = "collective", "a collective (torch.distributed) moves the bytes between processes"
    STREAM_QUERY = "stream_query", "stream.query() asks whether the stream's work is done"
    STREAM_SYNCHRONIZE = "stream_synchronize", "stream.synchronize()"
    EVENT_SYNCHRONIZE = "event_synchronize", "event.synchronize()"
    GLOBAL_SETTING = "global_setting", ("a global setting CPU kernels read as they run changes (the default dtype, "
                                        "deterministic algorithms): the kernels already issued run under the old one")
    # flush points: the window launches, the host does not wait
    BARRIER = "barrier", "an op that cannot wait in the window"
    WINDOW_FULL = "window_full", "window reached its maximum size"
    QUEUE_SHALLOW = "queue_shallow", "device queue about to run dry: launch to keep it busy"
    LAUNCH_BLOCKING = "launch_blocking", "NEURON_LAUNCH_BLOCKING=1"
    REGION_CLOSED = "region_closed", "TorchNeuron's policy: a matmul-like op closes the region it ends"
    REGION_BREAK = "region_break", ("TorchNeuron's policy: an op that breaks a region (in place, a copy, a collective) "
                                    "runs alone")
    DETERMINISTIC = "deterministic", "TorchNeuron's policy: deterministic algorithms turn adaptive eager off"
    GRAPH = "graph", "a compiled graph's call ends: the whole graph is one window"
    STREAM_CHANGE = "stream_change", "the current stream changes"
    EVENT_RECORD = "event_record", "an event is recorded"
    MODE_CHANGE = "mode_change", "switched between strict and adaptive eager (or into a compiled graph)"
    TRACE = "trace", "trace stopped"
    RESET_STATS = "reset_stats", "reset_stats()"
    EXIT = "exit", "process exit"


class Refused(_Reason):
    """Why the planner did not merge two groups of a window."""

    CYCLE = "would create a cycle", "the merged kernel would both feed and wait on another kernel of the window"
    OPAQUE = "opaque op", "this op has no loop form to fuse into (it runs alone unless its working set fits on chip)"
    OFF_CHIP = "working set exceeds on-chip memory", "the group only fused because it fit in one NeuronCore's SBUF; it no longer would"
    TWO_ANCHORS = "two anchors", "a streaming kernel holds at most one reduction or matmul"
    ITERATION_SPACES = "different iteration spaces", "the ops loop over different numbers of elements"
    MATMUL_PROLOGUE = "a matmul takes no prologue", "ops feeding a matmul are not folded into it, only its epilogue is"
    FAILED_BEFORE = "marked unfusable after a failure", "this chain failed once as a fused kernel; it now runs op by op"
    LIBRARY_KERNEL = "library kernel", "the group already runs as a library pattern's kernel, which takes no other ops"
    PATTERN = "pattern", "the chain looks like this pattern, but an intermediate is used elsewhere (e.g. kept for backward)"


def explain(reason: str) -> str:
    """What a flush or refusal reason means, in a few words ("" if unknown). A reason may
    carry a detail after its name: ``"barrier: aten::nonzero"``, ``"two anchors (matmul
    and reduction) in one kernel"``."""
    for table in (Flush, Refused):
        for member in table:
            if reason == member or reason.startswith(member.value + ":") or reason.startswith(member.value + " "):
                return member.why
    return ""
