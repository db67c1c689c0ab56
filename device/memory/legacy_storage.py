"""The legacy typed-storage classes of the device: ``torch.neuron.FloatStorage`` and the
rest, as ``torch.cuda`` has them.

Entry point: :data:`CLASSES` (name -> class), which ``torch.neuron`` (``device/api.py``)
exports.

``tensor.storage_type()`` answers through ``TypedStorage._get_legacy_storage_class``:
for the PrivateUse1 backend it looks the class up in the device module, by the dtype's
legacy name (``getattr(torch.neuron, "FloatStorage")``), as it finds ``torch.cuda.FloatStorage``
for a CUDA tensor and ``torch.FloatStorage`` for a CPU one. Without these classes a
neuron tensor's ``storage_type()`` was ``None``. Each class is a ``_LegacyStorage`` whose
``__module__`` is ``torch.neuron``, which is how torch tells a legacy class's device
(``storage._get_device_from_module``): so ``torch.neuron.FloatStorage(3)`` is a float32
``TypedStorage`` on the device, and ``isinstance(t.storage(), torch.neuron.FloatStorage)``
holds for a float32 neuron tensor (and not for a CPU one). As for CUDA, there is one class
per dtype of the map but the quantized ones, and the classes are never instantiated
(their constructor returns a ``TypedStorage``).
"""
from __future__ import annotations

import torch
from torch._utils import classproperty
from torch.storage import _LegacyStorage, _warn_typed_storage_removal

_MODULE = "torch.neuron"
_QUANTIZED = {torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4}


class _NeuronLegacyStorage(_LegacyStorage):
    """What ``torch.cuda``'s legacy classes refuse, refused for device memory too."""

    @classmethod
    def from_buffer(cls, *args, **kwargs):
        _warn_typed_storage_removal()
        raise RuntimeError("from_buffer: Not available for neuron storage")

    @classmethod
    def _new_with_weak_ptr(cls, *args, **kwargs):
        raise RuntimeError("_new_with_weak_ptr: Not available for neuron storage")

    @classmethod
    def _new_shared_filename(cls, manager, obj, size, *, device=None, dtype=None):
        raise RuntimeError("_new_shared_filename: Not available for neuron storage")


def _legacy_class(name: str, dtype: torch.dtype) -> type:
    def public_dtype(cls):
        _warn_typed_storage_removal()
        return dtype

    namespace = {
        "__module__": _MODULE,
        "__qualname__": name,
        "__doc__": f"The legacy {dtype} storage class of the neuron device (torch.cuda.{name}'s counterpart).",
        "dtype": classproperty(public_dtype),
        "_dtype": classproperty(lambda cls: dtype),
    }
    return type(_NeuronLegacyStorage)(name, (_NeuronLegacyStorage,), namespace)


def _classes() -> dict:
    names = torch.storage._dtype_to_storage_type_map()
    return {name: _legacy_class(name, dtype) for dtype, name in names.items() if dtype not in _QUANTIZED}


CLASSES = _classes()
torch._storage_classes.update(CLASSES.values())  # torch.cuda adds its own so (torch.is_storage)
