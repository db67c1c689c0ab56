"""Builds the one C++ extension of the device (device/csrc/neuron.cpp: the PrivateUse1
hooks Python cannot reach). Everything else is declared in setup.cfg."""
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension("adaptive_eager_device._C", ["device/csrc/neuron.cpp"], extra_compile_args=["-O2"]),
    ],
    cmdclass={"build_ext": BuildExtension},
)
