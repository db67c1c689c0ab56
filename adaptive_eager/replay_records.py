"""A compiled graph's template records: each recorded op with its storages as *slots*,
bound to a replayed call's storages (``replay.py``, its caller).

Entry points: :class:`RecordTemplate` (one record; ``bind`` makes the call's ``OpRecord``),
:class:`Slot` (a storage's index in the call's slot table) and :class:`NotReplayable`.

A replay binds every op of the graph at every call, so a record template sorts its
arguments once by how they bind: a storage at a position, a list of storages (a foreach
op's) through one ``itemgetter``, anything else with a slot in it (views, nested lists)
through ``_bound``; its reads, writes and results come from the table in one call each.
"""
from __future__ import annotations

from operator import itemgetter

import torch

from adaptive_eager_device import _C as _native
from adaptive_eager_device.hardware.op_record import OpRecord
from adaptive_eager_device.ops.rng import GENERATOR
from adaptive_eager_device.memory.storage import DeviceStorage, ReinterpretRef, ViewRef, storage_nbytes


class NotReplayable(Exception):
    """Why a call's template cannot be replayed (the fallback reason counted)."""


class Fresh:
    """A storage a compiled call allocated (a template's slot, ``replay.py``): made afresh at
    every replay."""

    __slots__ = ("shape", "stride", "dtype", "nbytes", "escapes")

    def __init__(self, storage: DeviceStorage, escapes: bool) -> None:
        self.shape, self.stride, self.dtype = storage.shape, storage.stride, storage.dtype
        self.nbytes = storage_nbytes(storage.shape, storage.stride, storage.dtype.itemsize)
        self.escapes = escapes  # an output's storage: it gets a PrivateUse1 storage (a tensor)


class Slot:
    """A storage in a template's records: its index in the slot table."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


class RecordTemplate:
    """One record of a template, its storages as slots, sorted once by how each argument
    is bound (``bind`` runs at every replayed call, for every op): ``args`` holds the
    constant arguments; ``slot_args`` puts a storage at a position, ``list_args`` a list
    of storages (a foreach op's), ``other_args`` anything else with a slot in it (views,
    nested lists); ``reads``, ``writes`` and ``results`` take their storages from the
    table in one call (``_getter``)."""

    __slots__ = ("op", "args", "marked_args", "slot_args", "list_args", "other_args", "kwargs", "bound_kwargs",
                 "nested", "reads", "writes", "results", "numbers", "location", "cost", "signature", "signature_id")

    def __init__(self, record, slot, host) -> None:
        for value in record.kwargs.values():
            if isinstance(value, torch.Generator):
                raise NotReplayable("the graph draws random numbers")  # RNG order: run as eager
        self.op = record.op
        args = [_template(value, slot, host) for value in record.args]
        self.marked_args = tuple(args)  # storages as slots: what a native program is built from
        slot_args, list_args, other_args = [], [], []
        for position, value in enumerate(args):
            kind = type(value)
            if kind is Slot:
                slot_args.append((position, value.n))
            elif (kind is list or kind is tuple) and value and all(type(item) is Slot for item in value):
                list_args.append((position, kind, _getter([item.n for item in value])))
            elif kind in _COMPOUND:
                other_args.append((position, value))
            else:
                continue
            args[position] = None
        self.args = args
        self.slot_args, self.list_args, self.other_args = tuple(slot_args), tuple(list_args), tuple(other_args)
        self.kwargs = {name: _template(value, slot, host) for name, value in record.kwargs.items()}
        self.bound_kwargs = tuple(name for name, value in self.kwargs.items()
                                  if type(value) is Slot or type(value) in _COMPOUND)
        self.nested = record.nested
        self.numbers = (tuple(slot(s).n for s in record.reads), tuple(slot(s).n for s in record.writes),
                        tuple(-1 if s is None else slot(s).n for s in record.results))  # table[-1] is None
        self.reads, self.writes, self.results = (_getter(numbers) for numbers in self.numbers)
        self.location = record.location
        self.cost = record.cost
        self.signature = record.signature
        self.signature_id = record.signature_id

    def bind(self, table, stream, issue) -> OpRecord:
        args = self.args.copy()
        for position, n in self.slot_args:
            args[position] = table[n]
        for position, kind, get in self.list_args:
            args[position] = kind(get(table))
        for position, value in self.other_args:
            args[position] = _bound(value, table)
        kwargs = self.kwargs
        if self.bound_kwargs:
            kwargs = kwargs.copy()
            for name in self.bound_kwargs:
                kwargs[name] = _bound(kwargs[name], table)
        return OpRecord(
            self.op, args, kwargs, self.nested, self.reads(table), self.writes(table), self.results(table),
            self.location, self.cost, self.signature, self.signature_id, stream, issue,
        )


def _no_storages(table) -> tuple:
    return ()


def _getter(numbers):
    """``table -> tuple`` of the table's entries at ``numbers``, in one call."""
    if not numbers:
        return _no_storages
    if len(numbers) == 1:
        return _one(numbers[0])
    return itemgetter(*numbers)


def _one(number):
    def get(table) -> tuple:
        return (table[number],)

    return get


class _ViewSlot:
    __slots__ = ("n", "shape", "stride", "offset")

    def __init__(self, n, ref: ViewRef) -> None:
        self.n, self.shape, self.stride, self.offset = n, ref.shape, ref.stride, ref.offset


_native.slot_types(Slot, _ViewSlot)  # a native program names a template's storages by them


class _ReinterpretSlot:
    __slots__ = ("n", "ref")

    def __init__(self, n, ref: ReinterpretRef) -> None:
        self.n, self.ref = n, ref


_COMPOUND = (_ViewSlot, _ReinterpretSlot, list, tuple)


def _template(value, slot, host):
    """A recorded argument with its storages (and host inputs' snapshots) as slots."""
    kind = type(value)
    if kind is DeviceStorage:
        return slot(value)
    if kind is ViewRef:
        return _ViewSlot(slot(value.storage).n, value)
    if kind is ReinterpretRef:
        return _ReinterpretSlot(slot(value.storage).n, value)
    if kind is list or kind is tuple:
        return kind(_template(item, slot, host) for item in value)
    if kind is torch.Tensor:
        return host(value)
    if value is GENERATOR:
        raise NotReplayable("the graph draws random numbers")
    return value


def _bound(value, table):
    """A template argument over a call's storages."""
    kind = type(value)
    if kind is Slot:
        return table[value.n]
    if kind is _ViewSlot:
        return ViewRef(table[value.n], value.shape, value.stride, value.offset)
    if kind is _ReinterpretSlot:
        ref = value.ref
        return ReinterpretRef(table[value.n], ref.shape, ref.stride, ref.offset, ref.dtype, ref.conj, ref.neg)
    if kind is list or kind is tuple:
        return kind(_bound(item, table) for item in value)
    return value
