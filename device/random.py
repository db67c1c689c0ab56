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

Ops with a ``generator`` argument get the device generator when the caller passed none.
``native_dropout`` (what ``F.dropout`` becomes on an accelerator) takes no generator; it is
rewritten to ``neuron::native_dropout``, which draws its mask exactly as the CPU's
``dropout`` does (``bernoulli_(1 - p)``, then ``/ (1 - p)``) so the numbers match.
"""
from __future__ import annotations

import torch

GENERATOR = torch.Generator()
GENERATOR.manual_seed(torch.initial_seed())

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


def _synchronize() -> None:
    # Pending random kernels must draw from the old state before the seed changes.
    from .sync import synchronize

    synchronize("rng_state")


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
