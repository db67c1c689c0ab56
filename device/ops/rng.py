"""The device's own random generator, and the random ops that need it.

Entry points: :data:`GENERATOR`, :func:`manual_seed`, :func:`get_rng_state`,
:func:`set_rng_state`, and :data:`DEVICE_REWRITES` (ops the dispatcher replaces by a
generator-taking equivalent).

Random kernels draw from one generator that belongs to the device, in queue order, so
results depend on the seed and the order of random ops only, never on what the host does
with the CPU generator meanwhile. ``torch.manual_seed(s)`` seeds it (through
``torch.neuron.manual_seed_all``), and it starts from the same sequence as the CPU
generator with the same seed, so a seeded loop on ``neuron`` draws the numbers the same
loop draws on the CPU.

How each random op reaches the generator (:func:`generator_rewrite` decides, once per
overload):

- ops with a ``generator`` argument get the device generator when the caller passed none;
- an overload without one (``rand_like.default``, ``randperm.default``) is rewritten to
  its sibling that takes one (``rand_like.generator``), or the CPU kernel would draw from
  the CPU's default generator, on the device worker, in the wrong order;
- ``native_dropout`` (what ``F.dropout`` becomes on an accelerator) takes no generator; it
  is rewritten to ``neuron::native_dropout``, which draws its mask exactly as the CPU's
  ``dropout`` does (``bernoulli_(1 - p)``, then ``/ (1 - p)``) so the numbers match;
- a random op with no generator in any overload (``HOST_RANDOM``) runs on the host after
  a sync point, with the device generator standing in for the CPU default generator
  (:func:`device_generator_as_default`);
- a caller's own CPU generator (``generator=g``) is shared with the host, which may draw
  from it right after: such an op runs on the host after a sync point, in program order;
- the mirror case, a random op on host tensors given a neuron generator (Diffusers'
  ``randn_tensor`` for a neuron pipeline), draws from that generator's CPU twin on the
  host after a sync point, and its result stays on the host
  (``host_ops.run_random_on_host_with_device_generator``).
"""
from __future__ import annotations

import contextlib

import torch

from ..core.reasons import Flush

GENERATOR = torch.Generator()  # the CPU twin of the device's default generator
GENERATOR.manual_seed(torch.initial_seed())


def generator_twin(generator):
    """The CPU generator a ``torch.Generator(device="neuron")`` draws through (the CPU
    kernels that run the device's ops take CPU generators), or None for another one."""
    from .. import _C as _native

    return _native.twin(generator)

_LIBRARY = torch.library.Library("neuron", "DEF")
_LIBRARY.define(
    "native_dropout(Tensor input, float p, bool? train, Generator? generator=None) -> (Tensor, Tensor)"
)


def _native_dropout_cpu(input, p, train, generator=None):
    if input.numel() == 0 or train is False:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = 1.0 - p
    noise = torch.empty_like(input).bernoulli_(keep, generator=generator)
    noise.div_(keep)
    return input * noise, noise.ne(0)


def _native_dropout_meta(input, p, train, generator=None):
    return torch.empty_like(input), torch.empty_like(input, dtype=torch.bool)


_LIBRARY.impl("native_dropout", _native_dropout_cpu, "CPU")
_LIBRARY.impl("native_dropout", _native_dropout_meta, "Meta")

native_dropout = torch.ops.neuron.native_dropout.default

# aten op -> the generator-taking op the device runs instead (same arguments, plus generator)
DEVICE_REWRITES = {torch.ops.aten.native_dropout.default: native_dropout}
HOST_RANDOM = "host_random"  # generator_rewrite's answer for a random op with no generator


def _arguments_without_generator(schema):
    return [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments if a.name != "generator"]


def generator_rewrite(op):
    """What the device runs for ``op``: None (itself), the overload to run instead (one
    that takes a generator), or ``HOST_RANDOM``."""
    rewrite = DEVICE_REWRITES.get(op)
    if rewrite is not None:
        return rewrite
    schema = op._schema
    if torch.Tag.nondeterministic_seeded not in op.tags or any(a.name == "generator" for a in schema.arguments):
        return None
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1], None)
    wanted = _arguments_without_generator(schema)
    for overload_name in packet.overloads() if packet is not None else ():
        sibling = getattr(packet, overload_name)
        arguments = sibling._schema.arguments
        if any(a.name == "generator" for a in arguments) and _arguments_without_generator(sibling._schema) == wanted:
            return sibling
    return HOST_RANDOM


@contextlib.contextmanager
def device_generator_as_default():
    """Let a CPU kernel that always draws from the CPU's default generator draw from the
    device generator instead. Host side only, after a sync point (the worker is idle)."""
    default = torch.default_generator
    saved = default.get_state()
    default.set_state(GENERATOR.get_state())
    try:
        yield
    finally:
        GENERATOR.set_state(default.get_state())
        default.set_state(saved)


def _synchronize() -> None:
    # Pending random kernels must draw from the old state before the seed changes.
    from ..hardware.sink import synchronize

    synchronize(Flush.RNG_STATE)


def manual_seed(seed: int) -> None:
    _synchronize()
    GENERATOR.manual_seed(int(seed))


def seed() -> int:
    _synchronize()
    return GENERATOR.seed()


def initial_seed() -> int:
    return GENERATOR.initial_seed()


def get_rng_state() -> torch.Tensor:
    _synchronize()
    return GENERATOR.get_state()


def set_rng_state(state: torch.Tensor) -> None:
    _synchronize()
    GENERATOR.set_state(state.cpu() if state.device.type != "cpu" else state)
