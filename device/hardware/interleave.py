"""Runs of multi-tensor ops the device worker may run parameter by parameter.

PyTorch gives an accelerator (``neuron`` too) the multi-tensor optimizers (``foreach``: each
op over every parameter before the next op). On CPU memory that order streams every
parameter's state from memory once per op. In an adaptive window such a run is one fused
kernel, and the worker runs its ops one parameter at a time instead
(``device/csrc/executor.cpp: run_interleaved``): the same kernels on the same elements, each
element's ops in the same order, so the same bits, with each parameter's state in cache
across the ops. This module says which runs qualify (:func:`interleaved_runs`);
``fused_kernel.py`` builds them (``_add_interleaved``) and fails a run the worker hands back
broken (``FusedKernel.resume``).

Strict eager launches each of those ops alone; the worker runs consecutive such launches
parameter by parameter too, by the same rules, checked in C (``executor.cpp:
run_strict_interleaved``, taking the batches rung after a run's own, ``take_pending``):
each stays its own kernel, accounted and completed as one, and only the order of its
per-parameter CPU kernels changes.
"""
from __future__ import annotations

from .. import _C as _native
from ..memory.storage import DeviceStorage, ViewRef

# A resume's offset flag (bit 19; offsets are below it): the worker handed the window back
# because a step of the interleaved run starting at that offset raised after the run began
# (executor.cpp: run_interleaved; FusedKernel.resume), or a strict launch back because the
# run of launches it was in did (executor.cpp: run_strict_interleaved; op_record._resume).
BROKEN = _native.BROKEN

# The multi-tensor ops a run may hold (each of ``aten::_foreach_<name>``, in place or not):
# elementwise, and on the CPU each is the per-tensor op applied tensor by tensor. One list,
# which the worker's strict runs read too (executor.cpp: interleaved_names).
_INTERLEAVED_NAMES = _native.INTERLEAVED_NAMES
_INTERLEAVABLE: dict = {}
_MIN_RUN = 2  # ops in a run worth reordering


def _interleavable(op) -> bool:
    known = _INTERLEAVABLE.get(op)
    if known is None:
        name = op._schema.name
        known = _INTERLEAVABLE[op] = (name.startswith("aten::_foreach_")
                                      and name[len("aten::_foreach_"):].rstrip("_") in _INTERLEAVED_NAMES)
    return known


def _tensor_storage(value):
    """The storage a tensor argument names (a storage, a view of one), else None."""
    kind = type(value)
    if kind is DeviceStorage:
        return value
    if kind is ViewRef:
        return value.storage
    return None


def _parameter_count(parts):
    """How many parameters a multi-tensor op of the run kind spans, or None when it is not
    one: an op of ``_INTERLEAVED_NAMES``, every list argument as long, each element a
    tensor of one floating dtype or a number, its other tensor arguments of that dtype too,
    one result per parameter or none."""
    op, args, kwargs, results, _ = parts
    if not _interleavable(op):
        return None
    values = (*args, *kwargs.values()) if kwargs else args
    lists = [value for value in values if type(value) is list]
    if not lists:
        return None
    count = len(lists[0])
    if count < 2 or any(len(items) != count for items in lists) or (results and len(results) != count):
        return None
    dtype = None
    for value in values:
        for item in (value if type(value) is list else (value,)):
            storage = _tensor_storage(item)
            if storage is None:
                if type(item) not in (int, float, bool):
                    return None
            elif dtype is None:
                dtype = storage.dtype
            elif storage.dtype is not dtype:
                return None
    for storage in results:
        if type(storage) is not DeviceStorage or storage.dtype is not dtype:
            return None
    return count if dtype is not None and dtype.is_floating_point else None


def interleaved_runs(kernel, skipped, at_root) -> dict:
    """``{start: end}``: the runs of a fused kernel's ops (``parts`` each) the worker may run
    parameter by parameter (``executor.cpp: run_interleaved``): at least ``_MIN_RUN``
    consecutive multi-tensor ops (:func:`_parameter_count`, no library kernel's) over as many
    parameters, in which no tensor written (in place or as a result) appears at two
    parameters, and no tensor outside the lists is written. Each element's ops then run in
    the same order on the same values: the results are PyTorch's order's, bit for bit."""
    runs: dict = {}
    offset, total = 0, len(kernel)
    while offset < total:
        count = None if offset in skipped or offset in at_root else _parameter_count(kernel[offset])
        end = offset + 1
        while count is not None and end < total and end not in skipped and end not in at_root \
                and _parameter_count(kernel[end]) == count:
            end += 1
        if count is not None and end - offset >= _MIN_RUN and _disjoint(kernel[offset:end]):
            runs[offset] = end
        offset = end
    return runs


def _disjoint(run) -> bool:
    where: dict = {}  # id(storage) -> the parameters it appears at
    single = set()    # storages of tensor arguments outside the lists
    written = set()
    for _, args, kwargs, results, writes in run:
        written.update(id(storage) for storage in writes)
        written.update(id(storage) for storage in results)
        for value in ((*args, *kwargs.values()) if kwargs else args):
            if type(value) is list:
                for index, item in enumerate(value):
                    storage = _tensor_storage(item)
                    if storage is not None:
                        where.setdefault(id(storage), set()).add(index)
            else:
                storage = _tensor_storage(value)
                if storage is not None:
                    single.add(id(storage))
        for index, storage in enumerate(results):
            where.setdefault(id(storage), set()).add(index)
    return not (single & written) and all(len(at) == 1 for key, at in where.items() if key in written)


def at_parameter(value, index: int):
    """An argument of a run's op at one parameter: a list's element, as a list of one."""
    return [value[index]] if type(value) is list else value
