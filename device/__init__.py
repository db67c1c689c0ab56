"""The simulated Neuron device: a complete strict-eager PyTorch device named ``neuron``.

Importing this package registers the device (``device.backend.register``). The layer
works alone: one op is one kernel launch on the single hardware execution queue. The
adaptive runtime (``adaptive_eager``) plugs in between op interception and the queue
through ``device.sync.set_sink``.

Installed as ``adaptive_eager_device`` (see setup.cfg): ``import torch`` loads this
package alone.
"""
from .backend import register
from .errors import NeuronRuntimeError, PoisonedTensorError
from .metrics import COUNTERS
from .queue import QUEUE
from .sync import synchronize

__all__ = ["NeuronRuntimeError", "PoisonedTensorError", "COUNTERS", "QUEUE", "register", "synchronize"]

register()
