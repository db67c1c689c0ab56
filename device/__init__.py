"""The simulated Neuron device: a complete strict-eager PyTorch device named ``neuron``.

Importing this package registers the device (``device.backend.register``). The layer
works alone: one op is one kernel launch on the single hardware execution queue. The
adaptive runtime (``adaptive_eager``) plugs in between op interception and the queue
through ``device.sync.set_sink``.

Installed as ``adaptive_eager.device`` (see setup.cfg).
"""
from .backend import register

register()

from .errors import NeuronRuntimeError, PoisonedTensorError  # noqa: E402
from .metrics import COUNTERS  # noqa: E402
from .queue import QUEUE  # noqa: E402
from .sync import synchronize  # noqa: E402

__all__ = ["NeuronRuntimeError", "PoisonedTensorError", "COUNTERS", "QUEUE", "register", "synchronize"]
