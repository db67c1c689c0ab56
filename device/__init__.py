"""The simulated Neuron device: a complete strict-eager PyTorch device named ``neuron``.

Importing this package registers the device (``device.backend.register``). The layer
works alone: one op is one kernel launch on the single hardware execution queue. The
adaptive runtime (``adaptive_eager``) plugs in between op interception and the queue
through ``device.sync.set_sink``.

Installed as ``adaptive_eager_device`` (see setup.cfg): ``import torch`` loads this
package alone.
"""
# torch first: `import torch` itself autoloads this package's entry point
# (backend.register), which must find torch fully imported, not half-way.
import torch  # noqa: F401

from .backend import register  # noqa: E402
from .core.counters import COUNTERS  # noqa: E402
from .core.errors import NeuronRuntimeError, PoisonedTensorError  # noqa: E402
from .hardware.execution_queue import QUEUE  # noqa: E402
from .hardware.sink import synchronize  # noqa: E402

__all__ = ["NeuronRuntimeError", "PoisonedTensorError", "COUNTERS", "QUEUE", "register", "synchronize"]

register()
