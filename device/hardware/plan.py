"""The plan format: what the planner hands the device, as frozen data.

Entry points: :class:`Plan` (a window's launches in order, with their costs),
:class:`KernelSpec` (one fused kernel, position-free), :class:`PatternSpec` (a chain
inside a kernel that runs as one library kernel), :class:`GroupSpec` (a planned group),
:class:`LaunchCosts` (the launches' costs, summed once) and :func:`library_kernels_off`
(which library kernels a given window's constants turn off).

The planner (``adaptive_eager.fusion``) builds these; the device (``fused_kernel.py``:
``WindowLaunches``, ``FusedKernel``) reads them by field and executes them; nothing
changes them once built.

A library kernel stands for a chain whose ops' constants it assumes (RMSNorm's ``eps``,
``pow``'s exponent 2): its ``checks``. The planner matches a chain only where they hold,
and a plan is reused for every window of the same structure, whose constants may differ
(a float's value is not part of an op's signature). So each launch of a plan is checked
once, on the host, when the window is handed to the device
(:func:`library_kernels_off`); a library kernel whose constants differ in this window
is off for that launch, which runs the chain's ops instead.
"""
from __future__ import annotations

import math


def constants_hold(checks, records) -> bool:
    """Do ``records`` hold the constants a match assumes? ``checks`` are
    ``(record index, arg index, value)``."""
    for offset, index, value in checks:
        args = records[offset].args
        actual = args[index] if index < len(args) else None
        if not isinstance(actual, (int, float)) or not math.isclose(actual, value, rel_tol=1e-12, abs_tol=0.0):
            return False
    return True


class PatternSpec:
    """A matched chain inside a fused kernel, by offsets within the kernel's members."""

    __slots__ = ("name", "impl", "members", "root", "inputs", "outputs", "checks", "constants", "charges")

    def __init__(self, name, impl, members, inputs, outputs, checks, constants, charges=()) -> None:
        self.name = name
        # (*input tensors, **constants) -> [output tensors]; TorchScript-able, so that a
        # native launch calls it from C++ (fused_kernel.library_function)
        self.impl = impl
        self.members = members  # offsets of the chain's ops, in program order
        self.root = members[-1]  # where the library kernel runs: the chain's last op
        self.inputs = inputs  # ((offset, arg index), ...) of the input references
        self.outputs = outputs  # ((offset, result index), ...) the kernel writes
        self.checks = checks  # ((offset, arg index, value), ...): the constants it assumes
        self.constants = constants  # keyword arguments of impl
        # ((offset, result index or ~argument index, bytes), ...): outputs it does not
        # write whole, inputs it does not read whole, and the bytes it moves instead
        # (fusion/kernels.py counts those)
        self.charges = charges


class KernelSpec:
    """A fused kernel, independent of where its ops sit in a window."""

    __slots__ = ("signature", "name", "dead", "dead_at", "last_uses", "bytes", "time_us", "bytes_saved", "ops",
                 "patterns", "__weakref__")

    def __init__(self, signature, name, dead, nbytes, time_us, bytes_saved, ops, patterns=(), last_uses=()) -> None:
        self.signature = signature
        self.name = name  # "mul|add|relu"
        self.dead = dead  # frozenset of (member offset, result position) kept in registers
        # per member offset: the result positions of that op kept in registers (or None)
        self.dead_at = tuple(frozenset(p for o, p in dead if o == offset) or None for offset in range(ops))
        # per member offset: the dead values (producer offset, result position) it reads
        # last, released from the kernel's registers once it has run
        self.last_uses = last_uses
        self.bytes = nbytes
        self.time_us = time_us  # without the launch overhead (the queue adds it)
        self.bytes_saved = bytes_saved
        self.ops = ops
        self.patterns = patterns  # PatternSpec: chains that run as one library kernel each


class GroupSpec:
    """A planned group: window positions, plus its kernel when it fuses several ops."""

    __slots__ = ("members", "kernel")

    def __init__(self, members: tuple, kernel: KernelSpec | None) -> None:
        self.members = members
        self.kernel = kernel  # None: a single op, launched as in strict eager


class LaunchCosts:
    """The costs of a plan's launches, summed once for the queue's accounting
    (``ExecutionQueue.launch_batch``): ``each`` is ``(key, bytes, time_us, ops)`` per
    launch in order (``key``: the op, or the fused kernel's name). Times are without the
    launch overhead: the queue adds it per launch when it accounts for them (it is read
    live, and a plan is reused for every window of its structure)."""

    __slots__ = ("each", "nbytes", "time_us", "ops", "by_key")

    def __init__(self, each) -> None:
        self.each = tuple(each)
        self.nbytes = sum(item[1] for item in self.each)
        self.time_us = sum(item[2] for item in self.each)
        self.ops = sum(item[3] for item in self.each)
        by_key: dict = {}
        for key, nbytes, time_us, _ in self.each:
            totals = by_key.setdefault(key, [0, 0.0, 0])
            totals[0] += 1
            totals[1] += time_us
            totals[2] += nbytes
        # ((key, launches, time_us, bytes), ...)
        self.by_key = tuple((key, *totals) for key, totals in by_key.items())


NONE_OFF = frozenset()


class Plan:
    """The groups of a window in launch order; ``refusals`` counts the planner's reasons.

    ``launches`` is what a flush walks: ``(position, None)`` for an op launched alone,
    ``(positions, KernelSpec)`` for a fused kernel; ``costs`` are their
    :class:`LaunchCosts`; ``totals`` are the fused kernels' (count, ops, bytes saved, dead
    intermediates); ``library`` lists each library kernel as ``(launch index, pattern
    index, name, ops, checks by window position)``. A plan is reused for every window of
    the same structure, whose ops have the same signatures and so the same costs.
    """

    __slots__ = ("groups", "refusals", "launches", "costs", "totals", "library", "programs", "matched")

    def __init__(self, groups: list, refusals: dict, records) -> None:
        self.groups = groups  # [GroupSpec] in launch order
        self.programs: dict = {}  # the native programs of its windows (fused_kernel.WindowLaunches.native)
        self.matched: dict = {}  # library kernels off -> the library patterns a window matches (matched_patterns)
        self.refusals = refusals
        self.launches = tuple(
            (group.members[0], None) if group.kernel is None else (group.members, group.kernel) for group in groups
        )
        each = []
        for members, spec in self.launches:
            if spec is None:
                record = records[members]
                each.append((record.op, record.cost.bytes, record.cost.time_us, 1))
            else:
                each.append((spec.name, spec.bytes, spec.time_us, spec.ops))
        self.costs = LaunchCosts(each)
        fused = [group.kernel for group in groups if group.kernel is not None]
        self.totals = (
            len(fused),
            sum(spec.ops for spec in fused),
            sum(spec.bytes_saved for spec in fused),
            sum(len(spec.dead) for spec in fused),
        )
        self.library = tuple(
            (launch, index, pattern.name, len(pattern.members),
             tuple((members[o], a, v) for o, a, v in pattern.checks))
            for launch, (members, spec) in enumerate(self.launches) if spec is not None
            for index, pattern in enumerate(spec.patterns)
        )

    def matched_patterns(self, off) -> tuple:
        """``(name, kernels, ops)`` of each library pattern a window of this plan runs, with
        the library kernels in ``off`` turned off (their ops run as ops), by name in the
        order first met; kept for a few ``off`` sets."""
        found = self.matched.get(off)
        if found is None:
            by_name: dict = {}
            for launch, index, name, ops, _ in self.library:
                if (launch, index) not in off:
                    counts = by_name.setdefault(name, [0, 0])
                    counts[0] += 1
                    counts[1] += ops
            found = tuple((name, kernels, ops) for name, (kernels, ops) in by_name.items())
            if len(self.matched) < 8:  # (kernels turned off vary with the windows' constants)
                self.matched[off] = found
        return found


def library_kernels_off(plan: Plan, records) -> frozenset:
    """The library kernels of ``plan`` whose constants differ in this window's
    ``records``: ``{(launch index, pattern index)}``, each of which runs its chain's ops
    for this launch. Checked once per launch, on the host (the module docstring)."""
    off = [(launch, index) for launch, index, _, _, checks in plan.library
           if checks and not constants_hold(checks, records)]
    return frozenset(off) if off else NONE_OFF
