"""How the device handles each aten op, decided once per overload from its schema and tags.

Entry point: :func:`op_entry` returns the cached :class:`OpEntry` of an ``OpOverload``.

An op is named the same way everywhere in the device, the planner and the runtime:

- ``op``: the ``OpOverload`` itself (``torch.ops.aten.add.Tensor``). PyTorch's own
  hooks call it ``func`` (``__torch_dispatch__``); the device's functions do not;
- ``entry``: its :class:`OpEntry` here, classified once (``entry.op`` is the op);
- ``name`` (``op_name`` as a parameter): its qualified name, ``"aten::add"``
  (``entry.name``, ``OpRecord.name``); a kernel's display name drops the ``aten::``;
- ``entry.serial``: a small int standing for the op inside signatures;
- ``signature``: one *call* of it, the op with its arguments' metadata (the shape
  cache's key, ``OpRecord.signature``), and ``signature_id``, the small int standing for
  that signature in plan-cache keys. A fused kernel's ``KernelSpec.signature`` is the
  same idea one level up: its ops' signatures and their data flow.

Kinds (plain strings, compared by identity on the hot path):

- ``VIEW``: returns an alias of an input; metadata only, runs on the host, no launch.
- ``METADATA``: mutates an input's metadata in place (``t_``, ``resize_``, ``set_``).
- ``KERNEL``: computes on device memory; one launch (strict) or one window entry
  (adaptive). Covers functional, in-place and ``out=`` ops and factories.
- ``COPY``: ``copy_`` and ``_to_copy``, which may cross between host and device.
- ``HOST_READ``: returns a host value read from device memory (``item``, ``equal``):
  a sync point.
- ``DATA_DEPENDENT``: output shape depends on the data (``nonzero``, ``unique``): a sync
  point, then the op runs as one blocking launch.
- ``COLLECTIVE``: a ``torch.distributed`` collective (``c10d::allreduce_``): a sync point,
  then gloo runs it on the CPU bytes (``device/ops/collectives.py``).
- ``NO_OP``: nothing to do on this device (``record_stream``: memory is already freed
  in stream order, since a storage lives until the last kernel using it has run);
- ``LIKE``: ``zeros_like``, ``ones_like``, ``full_like``: an allocation shaped like the
  input plus one fill kernel, as ATen writes them. The input's metadata is read, never
  its data (so no dependency on the kernel that writes it, and a FakeTensor input works:
  FakeTensor runs an op with no meta kernel on zeros made this way).
- ``DECOMPOSE``: a composite of other ops (a ``CompositeImplicitAutograd`` kernel:
  ``contiguous``, ``reshape``, ``linear``). Autograd decomposes them before they reach the
  device, except when it is off (inference mode) or when a composite kernel running on
  device tensors calls them: then they are decomposed here, as on any backend. Not the
  composites the CPU overrides with a kernel of its own (:func:`cpu_kernel_over_composite`:
  ``silu_backward``, ``mish_backward``): the device registers a kernel for those and runs
  the CPU's, so it computes what the CPU computes (the composite rounds each step to the
  tensor's dtype, the CPU's kernel computes a bfloat16 gradient in float32).
"""
from __future__ import annotations

import itertools

import torch

from ..hardware.op_record import GUARDED_WRITES

VIEW = "view"
METADATA = "metadata"
KERNEL = "kernel"
COPY = "copy"
HOST_READ = "host_read"
DATA_DEPENDENT = "data_dependent"
NO_OP = "no_op"
COLLECTIVE = "collective"
DECOMPOSE = "decompose"
LIKE = "like"

aten = torch.ops.aten


def overload_named(name: str):
    """The ``OpOverload`` of a dispatcher name: ``"aten::add.Tensor"`` ->
    ``torch.ops.aten.add.Tensor`` (no overload: ``.default``)."""
    namespace, _, qualified = name.partition("::")
    packet, _, overload = qualified.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def registration_name(op) -> str:
    """What ``Library.impl`` takes for ``op``: ``"add.Tensor"``, ``"relu"``."""
    name = op._schema.name.partition("::")[2]
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


_NO_OPS = {aten.record_stream.default}
# Ops that return an alias of an input although their schema does not say so: metadata
# only, like views ("unsafe": the caller promises not to use the input again).
_UNANNOTATED_VIEWS = {aten._unsafe_view.default, aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default,
                      aten.unsafe_chunk.default}
# Ops that only allocate: no kernel runs (as on CUDA, torch.empty launches nothing).
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
                aten.new_empty_strided.default, aten.empty_like.default}
# each ``LIKE`` op: its fill op, and the fill's arguments after the tensor, from the op's
LIKE_FILLS = {aten.zeros_like.default: (aten.zero_.default, lambda args: ()),
              aten.ones_like.default: (aten.fill_.Scalar, lambda args: (1,)),
              aten.full_like.default: (aten.fill_.Scalar, lambda args: (args[1],))}
_CHECKED_ON_CPU = {aten._softmax.default, aten.smooth_l1_loss.default, aten.celu.default, aten.celu_.default,
                   aten.rrelu_with_noise.default, aten.rrelu_with_noise_.default,
                   # a complex fill value for a real tensor
                   aten.index_fill.int_Scalar, aten.index_fill_.int_Scalar,
                   # a negative slope where the forward ran in place (is_result)
                   aten.elu_backward.default, aten.leaky_relu_backward.default,
                   aten.rrelu_with_noise_backward.default,
                   # nondeterministic on the CPU: refused under torch.use_deterministic_algorithms
                   aten.put_.default, aten.put.default,
                   # the CPU's warning for a uint8 mask (shapes.check_on_cpu forwards it)
                   aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
_COPY_OPS = {aten.copy_.default, aten._to_copy.default, aten._copy_from.default, aten._copy_from_and_resize.default}
# Host reads the schema does not tag as data-dependent.
_HOST_READS = {aten.is_nonzero.default, aten._local_scalar_dense.default}
# Ops ATen implements by reading data on the host although their output shape is fixed.
_DATA_DEPENDENT = {
    aten.histc.default,  # the CPU kernel reads min/max to choose bins when min == max
}


class OpEntry:
    """What the dispatcher needs to know about one overload, computed once."""

    __slots__ = (
        "op", "kind", "name", "mutated", "return_alias", "generator_arg", "random", "dropout_arg",
        "scalar_values_matter", "checked_on_cpu", "allocation", "rewrite", "host_random", "composite", "layout_arg", "serial",
        "fast",
    )

    def __init__(self, op) -> None:
        schema = op._schema
        tags = op.tags
        self.op = op
        self.name = schema.name  # "aten::add"
        self.mutated = tuple(
            (index, argument.name)
            for index, argument in enumerate(schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        )
        # For each return: None when it is a fresh tensor, else the (index, name) of the
        # mutated argument it returns (``add_`` returns self, ``add.out`` returns out).
        self.return_alias = tuple(
            _aliased_argument(schema, r.alias_info) if r.alias_info is not None else None
            for r in schema.returns
        )
        self.layout_arg = next(
            ((index, argument.name) for index, argument in enumerate(schema.arguments) if argument.name == "layout"),
            None,
        )
        self.generator_arg = next(
            (argument.name for argument in schema.arguments if argument.name == "generator"), None
        )
        # draws random numbers: tagged so, or takes a generator (binomial is not tagged)
        self.random = torch.Tag.nondeterministic_seeded in tags or self.generator_arg is not None
        # a random op that draws only for its dropout (the fused attention kernels, tagged
        # random for it): (position, name) of its ``dropout_p``; with 0 it draws nothing
        self.dropout_arg = next(
            ((i, a.name) for i, a in enumerate(schema.arguments) if a.name == "dropout_p" and self.random), None)
        # Whether float arguments can change output metadata (arange's end, interpolate's
        # scale). Not for pointwise ops, foreach/fused optimizer ops, or in-place ops
        # that return only their mutated inputs: their cache key holds a float's type,
        # not its value, so a learning-rate schedule does not defeat the caches. ``out=``
        # ops count: ATen resizes ``out`` to a shape the floats may decide
        # (``torch.arange(-1.0, 0.5, 0.5)`` fills an empty tensor through arange.out).
        base_name = self.name.split("::")[-1]
        only_mutates = bool(self.return_alias) and all(alias is not None for alias in self.return_alias)
        writes_out = any(argument.is_out for argument in schema.arguments)
        # Random ops key their values too: their argument checks (a negative std,
        # ``from > to``) depend on them, and a sampler's arguments rarely change.
        # The others key a float's sign (``float_class``), which the CPU's checks of
        # pointwise arguments depend on (CELU's alpha of 0).
        self.scalar_values_matter = self.random or not (
            torch.Tag.pointwise in tags
            or base_name.startswith(("_foreach_", "_fused_"))
            or (only_mutates and not writes_out)
            or (not schema.returns and self.mutated and not writes_out)
        )
        # Ops whose meta kernels skip argument checks the CPU makes (pointwise ops'
        # in-place casts and scalar checks, samplers' bounds, softmax's dim): a new
        # signature is also tried on one-element CPU tensors (``shapes.check_on_cpu``), so
        # the CPU's error raises at the call. Such tensors are valid inputs of these ops
        # whatever the real shapes (they broadcast).
        # Random factories (``randint``, ``randperm``) are tried too: their dtype and bound
        # checks (a complex ``randint``, ``randperm(257)`` into uint8) run in the kernel.
        factory = not any(isinstance(argument.type, torch.TensorType) and not argument.is_out
                          for argument in schema.arguments)
        self.checked_on_cpu = (
            torch.Tag.pointwise in tags
            or (self.random and ((only_mutates and not writes_out) or factory))
            or op in _CHECKED_ON_CPU
        )
        self.serial = next(_SERIALS)  # stands for the op in cache keys (an int: no GC tracking)
        self.allocation = op in _ALLOCATIONS
        self.rewrite = None  # the OpEntry of the op the device runs instead (rng.py)
        self.host_random = False  # a random op the device runs on the host (rng.py)
        # has a CompositeExplicitAutograd kernel: written in other ops, for every device
        self.composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd")
        self.kind = next((kind for kind, applies in _KIND_RULES if applies(op, self.name, tags)), KERNEL)

    def __repr__(self) -> str:
        return f"OpEntry({self.name}, {self.kind})"


def cpu_kernel_over_composite(name: str) -> bool:
    """Whether the aten op ``name`` ("aten::silu_backward") is a ``CompositeImplicitAutograd``
    composite for PrivateUse1 that the CPU overrides with a kernel of its own, and has an
    autograd formula (so a device kernel keeps it differentiable). For these the device
    registers a kernel (``backend._register_kernels``) and runs the CPU's: decomposed,
    they would round differently (in bfloat16, by up to a few steps). Asked once per op."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "CompositeImplicitAutograd") and has(name, "CPU") and has(name, "Autograd")


# How an op is classified: the first rule that applies gives its kind (else KERNEL).
_KIND_RULES = (
    (NO_OP, lambda op, name, tags: op in _NO_OPS),
    (COLLECTIVE, lambda op, name, tags: name.startswith(("c10d::", "_c10d_functional::"))),
    (KERNEL, lambda op, name, tags: cpu_kernel_over_composite(op.name())),
    (DECOMPOSE, lambda op, name, tags: torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd")),
    (COPY, lambda op, name, tags: op in _COPY_OPS),
    (LIKE, lambda op, name, tags: op in LIKE_FILLS),
    (VIEW, lambda op, name, tags: op.is_view or op in _UNANNOTATED_VIEWS),
    (METADATA, lambda op, name, tags: torch.Tag.inplace_view in tags),
    (DATA_DEPENDENT, lambda op, name, tags: torch.Tag.dynamic_output_shape in tags or op in _DATA_DEPENDENT),
    (HOST_READ, lambda op, name, tags: torch.Tag.data_dependent_output in tags or op in _HOST_READS),
)


def _aliased_argument(schema, alias_info):
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.before_set & alias_info.before_set:
            return (index, argument.name)
    return None


_ENTRIES: dict = {}
_SERIALS = itertools.count(1)
# Writes in place driven by index values (or masked_scatter's mask) that ATen checks as it
# writes: a bad value raises with part of the target written (op_record.py: GUARDED_WRITES).
_CHECKED_WHILE_WRITING = {"index", "indices"}


def _checks_while_writing(entry) -> bool:
    written = {name for _, name in entry.mutated}
    if entry.name == "aten::masked_scatter_":
        return True
    return bool(written) and any(
        argument.name in _CHECKED_WHILE_WRITING and argument.name not in written and "Tensor" in str(argument.type)
        for argument in entry.op._schema.arguments
    )


def _fast_fields(entry):
    """What ``_C.record`` (``device/csrc/record.cpp``, the recorder's common case in C) reads
    of an entry, ``(op, serial, scalar_values_matter, mutated, return_alias, dropout, copy)``,
    or None for an op it never records: one whose call ``record_kernel`` handles specially
    (an allocation, a rewrite, a random op drawing on the host or taking a generator, an
    indexing op's host checks) or that is not a kernel.

    A random op without a generator argument (a fused attention kernel, tagged random for
    its dropout) is recorded like any kernel: it draws from the device's stream on the
    queue, in order. One the device runs on the host (``rng.HOST_RANDOM``) is taken only
    when it draws nothing: ``dropout`` is its ``dropout_p`` argument's (index, name), which
    must be 0 (else None). Of the copies, ``copy_`` into a neuron tensor and ``_to_copy`` of
    one on the device are kernels too (``dispatch.run_copy``): ``copy`` is True, and they
    are taken when the first argument is a neuron tensor."""
    from .index_checks import INDEXING

    copy = entry.kind is COPY and entry.op in (aten.copy_.default, aten._to_copy.default)
    if ((entry.kind is not KERNEL and not copy) or entry.allocation or entry.rewrite is not None
            or (entry.host_random and entry.dropout_arg is None)
            or entry.generator_arg is not None or entry.op in INDEXING):
        return None
    dropout = entry.dropout_arg if entry.host_random else None
    return (entry.op, entry.serial, entry.scalar_values_matter, entry.mutated, entry.return_alias, dropout, copy)


def op_entry(op) -> OpEntry:
    entry = _ENTRIES.get(op)
    if entry is None:
        from .native import DEVICE_REWRITES
        from .rng import HOST_RANDOM, generator_rewrite

        entry = OpEntry(op)
        if entry.kind is KERNEL and _checks_while_writing(entry):
            GUARDED_WRITES.add(id(op))
        if entry.kind is KERNEL:
            rewrite = DEVICE_REWRITES.get(op) or generator_rewrite(op)
            if rewrite is HOST_RANDOM:
                entry.host_random = True
            elif rewrite is not None:
                entry.rewrite = op_entry(rewrite)
                if entry.random and rewrite._schema.name != entry.name:  # neuron::native_dropout's p
                    entry.rewrite.checked_on_cpu = True
        entry.fast = _fast_fields(entry)
        _ENTRIES[op] = entry
    return entry
