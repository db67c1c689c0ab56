"""Storage views and legacy storage classes on the device, compared with the CPU.

A sliced ``UntypedStorage`` (``t.untyped_storage()[a:b]``) is a storage ATen makes over
an address inside another storage's allocation (``device/csrc/memory.cpp``: the
allocation holding an address, by start address, and the offset in it). Reading,
writing and copying through it, and tensors set on it, behave as on the CPU; so do its
errors. ``tensor.storage_type()`` is the device's legacy class, ``torch.neuron.FloatStorage``,
as a CUDA tensor's is ``torch.cuda.FloatStorage`` (``device/memory/legacy_storage.py``).
"""
import warnings

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("any_mode"),
              pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")]

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]


def _values(dtype, n=15):
    values = (torch.arange(n, dtype=torch.float64) * 7 % 19 - 9).reshape(3, 5)
    return values.to(dtype)


def _pair(dtype):
    cpu = _values(dtype)
    return cpu, cpu.to("neuron")


def _error(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what is compared
        return type(error), str(error)
    return None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reading_every_element_through_byte_slices(dtype):
    cpu, dev = _pair(dtype)
    size = cpu.element_size()
    cpu_bytes, dev_bytes = cpu.untyped_storage(), dev.untyped_storage()
    for start in range(0, cpu.numel() * size, size):
        end = start + size
        assert list(dev_bytes[start:end]) == list(cpu_bytes[start:end])
    assert dev_bytes[size:5 * size].tolist() == cpu_bytes[size:5 * size].tolist()
    assert len(dev_bytes[3:11]) == len(cpu_bytes[3:11]) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.complex64], ids=str)
def test_slices_copy_to_the_cpu_and_slices_of_slices(dtype):
    cpu, dev = _pair(dtype)
    size = cpu.element_size()
    cpu_slice, dev_slice = cpu.untyped_storage()[2 * size:9 * size], dev.untyped_storage()[2 * size:9 * size]
    assert dev_slice.device.type == "neuron"
    assert dev_slice.cpu().tolist() == cpu_slice.tolist()
    assert dev_slice[size:3 * size].tolist() == cpu_slice[size:3 * size].tolist()
    assert dev_slice.clone().cpu().tolist() == cpu_slice.clone().tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.float64], ids=str)
def test_tensors_set_on_a_slice_read_where_it_starts(dtype):
    cpu, dev = _pair(dtype)
    size = cpu.element_size()
    results = []
    for t in (cpu, dev):
        view = t.untyped_storage()[3 * size:11 * size]
        whole = torch.tensor([], dtype=dtype, device=t.device).set_(view)
        part = torch.tensor([], dtype=dtype, device=t.device).set_(view, 2, (2, 3), (1, 2))
        as_bytes = torch.tensor([], dtype=torch.uint8, device=t.device).set_(view)
        results.append((whole.cpu(), part.cpu(), (whole * 2 + part.sum()).cpu(), as_bytes.cpu(),
                        whole.tolist()))
    for got, expected in zip(results[1], results[0]):
        assert torch.equal(got, expected) if isinstance(got, torch.Tensor) else got == expected


def test_writing_through_a_slice_writes_the_base():
    results = []
    for device in ("cpu", "neuron"):
        base = torch.arange(12.0).to(device)
        view = base.untyped_storage()[8:40]  # elements 2 .. 9
        view[1] = 255
        view[4:8] = 0
        view[8:12].fill_(7)
        view[12:20].copy_(torch.tensor([1.5, -2.5]).untyped_storage())
        over = torch.tensor([], device=device).set_(view[20:32])  # elements 7 .. 9
        over.mul_(10).add_(1)
        results.append(base.cpu())
    assert torch.equal(results[1], results[0])


def test_a_slice_of_a_storage_python_never_saw():
    results = []
    for device in ("cpu", "neuron"):
        storage = torch.UntypedStorage(16, device=device)
        storage[8:16].copy_(torch.arange(8, dtype=torch.uint8).untyped_storage())
        storage[0:8].fill_(3)
        results.append((storage.cpu().tolist(), storage[6:10].tolist()))
    assert results[1] == results[0]


def test_empty_slices_as_on_the_cpu():
    cpu, dev = _pair(torch.float32)
    for a, b in ((60, 60), (70, 80), (100, 200), (5, 2)):
        cpu_slice, dev_slice = cpu.untyped_storage()[a:b], dev.untyped_storage()[a:b]
        assert len(dev_slice) == len(cpu_slice) == 0
        assert dev_slice.tolist() == cpu_slice.tolist() == []
        assert dev_slice.cpu().tolist() == []
        assert torch.tensor([], device="neuron").set_(dev_slice).cpu().numel() == 0


def test_bad_slices_and_indices_give_the_cpus_errors():
    cpu, dev = _pair(torch.float32)
    cpu_slice, dev_slice = cpu.untyped_storage()[4:12], dev.untyped_storage()[4:12]
    calls = [
        lambda s: s[8],
        lambda s: s[-9],
        lambda s: s[::2],
        lambda s: s.resize_(100),
        lambda s: s.__setitem__(9, 1),
        lambda s: torch.tensor([], device=s.device).set_(s, 0, (3,), (1,)),
        lambda s: torch.tensor([], device=s.device).set_(s).resize_(10),
    ]
    for call in calls:
        expected = _error(lambda: call(cpu_slice))
        assert expected is not None
        assert _error(lambda: call(dev_slice)) == expected
    assert dev.cpu().tolist() == cpu.tolist()  # nothing was written


def test_a_tensor_starting_inside_an_element_is_refused_clearly():
    dev = torch.arange(4.0).to("neuron")
    view = dev.untyped_storage()[1:9]
    odd = torch.tensor([], device="neuron").set_(view)  # metadata only: fine
    assert odd.shape == (2,)
    with pytest.raises(NotImplementedError, match="starts inside an element"):
        odd.cpu()
    assert torch.tensor([], dtype=torch.uint8, device="neuron").set_(view).cpu().tolist() == \
        list(torch.arange(4.0).untyped_storage()[1:9])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_legacy_storage_type_is_the_devices(dtype):
    name = torch.storage._dtype_to_storage_type_map()[dtype]
    cpu, dev = _pair(dtype)
    assert cpu.storage_type() is getattr(torch, name)
    device_class = dev.storage_type()
    assert device_class is getattr(torch.neuron, name) and device_class is not getattr(torch, name)
    assert device_class.__module__ == "torch.neuron" and device_class.dtype == dtype
    assert isinstance(dev.storage(), device_class) and not isinstance(cpu.storage(), device_class)
    assert dev.storage().type() == f"torch.neuron.{name}"


def test_legacy_storage_classes_make_device_storages():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = torch.neuron.IntStorage([1, -2, 3])
        assert type(made) is torch.TypedStorage and made.device.type == "neuron" and made.dtype == torch.int32
        assert made.tolist() == torch.IntStorage([1, -2, 3]).tolist()
        assert len(torch.neuron.FloatStorage(5)) == 5 and torch.neuron.FloatStorage(5).device.type == "neuron"
        assert torch.is_storage(torch.arange(3, device="neuron").storage())
        with pytest.raises(RuntimeError, match="Device of 'wrap_storage' must be neuron"):
            torch.neuron.FloatStorage(wrap_storage=torch.UntypedStorage(4))
        assert not hasattr(torch.neuron, "QInt8Storage")  # as torch.cuda: no quantized classes


def test_set_on_a_too_small_storage_grows_it_as_on_the_cpu():
    results = []
    for device in ("cpu", "neuron"):
        storage = torch.UntypedStorage(8, device=device)
        storage.copy_(torch.arange(8, dtype=torch.uint8).untyped_storage())
        t = torch.tensor([], dtype=torch.uint8, device=device).set_(storage, 2, (10,), (1,))
        t[6:].fill_(9)
        results.append((storage.nbytes(), t[:6].tolist(), storage[:8].tolist(), t.tolist()[6:]))
    assert results[1] == results[0]
