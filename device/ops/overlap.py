"""Memory-overlap checks at the call, as the CPU makes them.

Entry point: :func:`refused` (is this call one the CPU refuses for overlapping memory?).

ATen's kernels refuse an in-place or ``out=`` op whose written tensor shares memory with
another argument in a way the result would depend on the order of the loop
(``x[1:].add_(x[:-1])``, ``x.index_add_(0, i, x)``: "some elements of the input tensor
and the written-to tensor refer to a single memory location"). They check it when they
run, on the data pointers, and meta kernels do not; on the device that check would run
on the worker, and the error would be deferred to the next sync point, where CUDA and
the CPU raise it at the call. So a call that writes a storage another of its arguments
also reads (``writes_shared``) is tried first on CPU buffers with the same aliasing (one zeroed buffer per
storage, each argument a view of it with its own offset in the storage's allocation,
shape and strides): if the CPU
refuses it for overlap, the dispatcher runs the op on the host (``host_ops``), which
raises the CPU's own error at the user's line. Other errors of the trial (its zeros are
not the user's data) are not the call's, and are ignored. Aliasings the CPU accepted
(``torch.add(x, 1, out=x)``) are remembered by signature and offsets, so a loop pays
the trial once.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from .. import _C as _native
from ..memory.tensor import offset_of, storage_of

_ACCEPTED: set = set()  # (signature, aliasing) the CPU accepted
_MAX_ACCEPTED = 4096
_OVERLAP = "single memory location"  # in each of ATen's overlap messages


def aliased(reads) -> bool:
    """Does some storage appear twice among a call's tensor arguments? (The cheap test on
    the per-op path; :func:`writes_shared` says whether it matters.)"""
    return len(reads) > 1 and len(set(reads)) < len(reads)


def writes_shared(reads, writes) -> bool:
    """Is a storage the call writes among those that appear more than once in its tensor
    arguments? Two inputs sharing one (AdamW's ``_foreach_addcmul_(v, g, g)``) is fine."""
    seen: set = set()
    shared: set = set()
    for storage in reads:
        (shared if storage in seen else seen).add(storage)
    return not shared.isdisjoint(writes)


def refused(entry, key, args, kwargs) -> bool:
    """Would the CPU refuse this call (which writes a storage another of its arguments
    also reads) because a written tensor overlaps another argument?"""
    tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)
               and leaf.device.type == "neuron"]
    numbers: dict = {}
    aliasing = tuple((numbers.setdefault(storage_of(t), len(numbers)), offset_of(t)) for t in tensors)
    token = (key, aliasing)
    if token in _ACCEPTED:
        return False
    if _trial_refused(entry, args, kwargs):
        return True
    if len(_ACCEPTED) >= _MAX_ACCEPTED:
        _ACCEPTED.clear()
    _ACCEPTED.add(token)
    return False


def _trial_refused(entry, args, kwargs) -> bool:
    """Run the op on zeroed CPU buffers aliased as its arguments are: an overlap refusal?"""
    buffers: dict = {}

    def on_cpu(value):
        if not isinstance(value, torch.Tensor) or value.device.type != "neuron":
            return value
        storage = storage_of(value)
        buffer = buffers.get(storage)
        if buffer is None:  # the whole allocation: a storage view's tensor starts inside it
            nbytes = max(storage.nbytes or 0, value.untyped_storage().nbytes())
            buffer = buffers[storage] = torch.zeros(nbytes, dtype=torch.uint8).untyped_storage()
        return torch.empty(0, dtype=value.dtype).set_(buffer, offset_of(value), value.shape, value.stride())

    trial_args, trial_kwargs = tree_map(on_cpu, (tuple(args), dict(kwargs or {})))
    if entry.generator_arg is not None:  # a sampler draws from a throwaway generator
        trial_kwargs[entry.generator_arg] = torch.Generator()
    try:
        with _disable_current_modes(), warnings.catch_warnings():
            # the trial's own warnings (an out= tensor resized), Python's and C++'s: the real call warns
            warnings.simplefilter("ignore")
            _native.call_quietly("", entry.op, *trial_args, **trial_kwargs)
    except Exception as error:  # noqa: BLE001 - only an overlap refusal is the call's
        return _OVERLAP in str(error)
    return False
