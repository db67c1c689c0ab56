"""Every host read of device bytes waits for the kernels that write them.

Each test holds the device worker back (``held_device``), issues a kernel, and reads its
output on the host at once through one path: the read must wait, or it sees memory the
kernel has not written yet (``copy.deepcopy`` once returned uninitialized memory so).
Both modes: in adaptive eager the kernel also waits in the window.
"""
import copy
import io
import pickle

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.usefixtures("any_mode", "held_device")

EXPECTED = [0.0, 2.0, 4.0, 6.0]


def pending():
    """A tensor whose kernel cannot have run yet."""
    return torch.arange(4.0, device="neuron") * 2


def test_deepcopy():
    assert copy.deepcopy(pending()).cpu().tolist() == EXPECTED


def test_deepcopy_keeps_what_the_cpu_keeps():
    """A leaf tensor's attributes and grad are deep-copied, as on the CPU (a Parameter's
    deepcopy drops both on every device: torch's own Parameter.__deepcopy__)."""
    for device in ("cpu", "neuron"):
        t = (torch.arange(4.0) * 2).to(device).requires_grad_()
        t.grad = (t.detach() + 1)
        t.tag = "kept"
        u = copy.deepcopy(t)
        assert u.tag == "kept" and u.requires_grad and u.device.type == device
        assert u.detach().cpu().tolist() == EXPECTED and u.grad.cpu().tolist() == [1.0, 3.0, 5.0, 7.0]
        p = torch.nn.Parameter(pending().to(device))
        assert copy.deepcopy(p).detach().cpu().tolist() == EXPECTED


def test_pickle():
    assert pickle.loads(pickle.dumps(pending())).cpu().tolist() == EXPECTED


def test_torch_save():
    buffer = io.BytesIO()
    torch.save({"t": pending()}, buffer)
    buffer.seek(0)
    assert torch.load(buffer)["t"].cpu().tolist() == EXPECTED


def test_cpu_and_to():
    assert pending().cpu().tolist() == EXPECTED
    assert pending().to("cpu", torch.float64).tolist() == EXPECTED


def test_numpy_force_and_tolist():
    assert pending().numpy(force=True).tolist() == EXPECTED
    assert pending().tolist() == EXPECTED


def test_numpy_without_a_copy_refuses_as_cuda_does():
    with pytest.raises(TypeError, match="Tensor.cpu"):
        np.asarray(pending())


def test_item_bool_and_format():
    t = pending()
    assert t[3].item() == 6.0
    assert bool(t[1] > 1)
    assert f"{t[2]:.1f}" == "4.0"


def test_printing():
    assert "tensor([0., 2., 4., 6.], device='neuron:0')" == repr(pending())
    assert "[0., 2., 4., 6.]" in str(pending())


def test_copy_into_a_host_tensor():
    host = torch.empty(4)
    host.copy_(pending())
    assert host.tolist() == EXPECTED


def test_host_comparison_ops():
    assert torch.equal(pending(), torch.tensor(EXPECTED).to("neuron"))
    assert torch.allclose(pending(), torch.tensor(EXPECTED).to("neuron"))


def test_dlpack_from_torch_to_torch_aliases_and_others_refuse():
    """A DLPack capsule of a neuron tensor names PyTorch's PrivateUse1 device: torch reads
    it back as the same storage (so reads still wait for the kernels); numpy, which knows
    no such device, refuses it."""
    t = pending()
    again = torch.from_dlpack(t.__dlpack__())
    assert again.device.type == "neuron"
    assert again.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert again.cpu().tolist() == EXPECTED
    with pytest.raises(RuntimeError, match="Unsupported device"):
        np.from_dlpack(pending())


def test_kernels_run_under_the_default_dtype_they_were_issued_with():
    """The CPU kernels the worker runs read the process's default dtype as they run; a
    change of it on the host (``torch.set_default_dtype``) waits for the kernels already
    issued. Without the wait, the pending ``randn`` below ran as float64 and failed."""
    torch.manual_seed(0)
    expected = torch.randn(3)
    expected_sum = torch.tensor([0, 1, 2], dtype=torch.uint8) + 0.5
    torch.manual_seed(0)
    drawn = torch.randn(3, device="neuron")
    summed = torch.tensor([0, 1, 2], dtype=torch.uint8, device="neuron") + 0.5
    try:
        torch.set_default_dtype(torch.float64)
        assert drawn.dtype == summed.dtype == torch.float32
        assert torch.equal(drawn.cpu(), expected) and torch.equal(summed.cpu(), expected_sum)
    finally:
        torch.set_default_dtype(torch.float32)


def test_kernels_split_their_work_as_the_host_would(any_mode):
    """A CPU kernel's rounding may depend on how many intra-op threads split it (a large
    sum does): the worker runs each kernel with the host's ``torch.get_num_threads()``,
    also after ``torch.set_num_threads`` changes it, so the result is the CPU's."""
    saved = torch.get_num_threads()
    torch.manual_seed(0)
    x = torch.randn(1 << 22) * 1000
    on_device = x.to("neuron")
    try:
        for threads in (2, 1, 2):
            torch.set_num_threads(threads)
            assert on_device.sum().item() == x.sum().item(), threads
    finally:
        torch.set_num_threads(saved)
