"""Builds the one C++ extension of the device (device/csrc: the PrivateUse1 hooks Python
cannot reach; module.cpp says what each translation unit holds). Everything else is
declared in setup.cfg."""
import os

# torch's import would load an installed neuron device whose extension this build replaces
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

SOURCES = [f"device/csrc/{name}.cpp" for name in ("memory", "hooks", "hot_path", "views", "sparse", "cells", "executor", "module")]

setup(
    ext_modules=[
        CppExtension("adaptive_eager_device._C", SOURCES, depends=["device/csrc/neuron.h"], extra_compile_args=["-O2"]),
    ],
    cmdclass={"build_ext": BuildExtension},
)
