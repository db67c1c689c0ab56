"""Adaptive eager's policies, as a table: ours, and TorchNeuron's own.

Entry points: :data:`POLICIES` (name -> :class:`AdaptivePolicy`) and :func:`breaks_region`
(what breaks a TorchNeuron region). ``NEURON_ADAPTIVE_POLICY`` picks a row (``ours`` by
default), read live through ``window.WindowPolicy.rules``; the window
(``adaptive_eager/window.py``: when to buffer, when to flush) and the planner
(``fusion/planner.py``: what one launch holds) read the row's fields. One machinery, two
rows: the same window, plan cache, kernel specs, cost model and statistics.

**ours** (the default): the window holds up to ``NEURON_ADAPTIVE_WINDOW`` ops and is
flushed early once the device's simulated backlog falls to ``NEURON_ADAPTIVE_SHALLOW_US``;
the planner fuses by the loop rules, the on-chip rule and the pattern library.

**torchneuron**: TorchNeuron's adaptive eager ("concatenation") as built, from its source
(``../shared/docs/CONTEXT.md``, "Adaptive eager, as built"):

- it buffers only while more than about 15 ops wait in the execution queue: below that
  low-water mark each op launches at once, and what the window held is flushed first. The
  depth is the simulated queue's, in kernels (``ExecutionQueue.backlog_kernels``);
- it holds at most 1,024 ops;
- a region closes at a matmul-like op (linear, mm, bmm, addmm, baddbmm, conv, custom
  kernels, and their backwards): the op ends its region, the next op starts a new one
  (``fusion/categories.py``'s ``MATMUL`` ops; ops outside aten, custom kernels, always run
  alone);
- in-place ops (any op that writes one of its arguments: ``add_``, ``out=``, foreach
  updates), collectives and non-compute kernels (copies: ``clone``, ``_to_copy``,
  ``copy_``) break a region: it is flushed and they run alone; stream changes flush it, as
  under ours;
- deterministic algorithms (``torch.use_deterministic_algorithms(True)``) turn it off:
  each op launches alone;
- a region is compiled whole (the Neuron compiler fuses inside it): one launch per region,
  with ours' rules for what it writes back (an intermediate nothing outside reads is not)
  and the same cost model. No pattern library, no loop rules.

Both policies run the same ATen kernels in program order, so results are equal; they
differ in how ops are grouped into launches.
"""
from __future__ import annotations

from .fusion.categories import BARRIER, KERNEL, MATMUL


class AdaptivePolicy:
    """One row of :data:`POLICIES`. ``None`` in a field means "the configuration's value"
    (``NEURON_ADAPTIVE_*``, read live by ``WindowPolicy``).

    - ``max_ops``: most ops a window holds;
    - ``low_water_kernels``: buffer only while more kernels than this are in the queue
      (None: ours, the backlog rule of ``min_ops`` and ``shallow_us``);
    - ``closes_after``: fusion categories whose op ends its window;
    - ``breaks``: whether ops that break a region (:func:`breaks_region`) run alone;
    - ``off_when_deterministic``: deterministic algorithms turn buffering off;
    - ``whole_window``: the planner makes each window one launch (a compiled region);
    - ``patterns``: the pattern library (None: ``NEURON_ADAPTIVE_PATTERNS``).
    """

    __slots__ = ("name", "doc", "max_ops", "low_water_kernels", "closes_after", "breaks", "off_when_deterministic",
                 "whole_window", "patterns")

    def __init__(self, name, doc, max_ops=None, low_water_kernels=None, closes_after=frozenset(), breaks=False,
                 off_when_deterministic=False, whole_window=False, patterns=None) -> None:
        self.name, self.doc = name, doc
        self.max_ops = max_ops
        self.low_water_kernels = low_water_kernels
        self.closes_after = frozenset(closes_after)
        self.breaks = breaks
        self.off_when_deterministic = off_when_deterministic
        self.whole_window = whole_window
        self.patterns = patterns

    def __repr__(self) -> str:
        return f"AdaptivePolicy({self.name!r})"


POLICIES = {
    "ours": AdaptivePolicy(
        "ours", "windows flushed when the device is about to starve; loop rules, on-chip rule, pattern library"),
    "torchneuron": AdaptivePolicy(
        "torchneuron", "TorchNeuron's own: buffer while more than 15 kernels wait, at most 1,024 ops, a region "
        "closes at a matmul-like op, in-place ops and copies break it, one launch per region",
        max_ops=1024, low_water_kernels=15, closes_after={MATMUL}, breaks=True, off_when_deterministic=True,
        whole_window=True, patterns=False),
}

# Non-compute kernels: they move bytes and compute nothing (copies, casts). ``copy_`` is
# in place too.
NON_COMPUTE = frozenset({"aten::copy_", "aten::clone", "aten::_to_copy", "aten::_copy_from",
                         "aten::_copy_from_and_resize", "aten::lift_fresh_copy"})
_BREAKS: dict = {}  # op -> what breaks its region ("" for nothing)


def breaks_region(op, kind) -> str:
    """Why ``op`` breaks a TorchNeuron region ("in place", "non-compute", "custom kernel"),
    or "" when it does not."""
    found = _BREAKS.get(op)
    if found is None:
        schema = op._schema
        if kind is BARRIER or kind is KERNEL:
            found = "custom kernel"  # outside aten: an NKI kernel, a custom op or a collective
        elif schema.name in NON_COMPUTE:
            found = "non-compute"
        elif any(argument.alias_info is not None and argument.alias_info.is_write for argument in schema.arguments):
            found = "in place"
        else:
            found = ""
        _BREAKS[op] = found
    return found
