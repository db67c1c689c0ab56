"""Builds the one C++ extension of the device (device/csrc: the PrivateUse1 hooks Python
cannot reach; module.cpp says what each translation unit holds). Everything else is
declared in setup.cfg."""
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

SOURCES = [f"device/csrc/{name}.cpp" for name in ("memory", "hooks", "hot_path", "views", "sparse", "module")]

setup(
    ext_modules=[
        CppExtension("adaptive_eager_device._C", SOURCES, depends=["device/csrc/neuron.h"], extra_compile_args=["-O2"]),
    ],
    cmdclass={"build_ext": BuildExtension},
)
