"""Builds the one C++ extension of the device (device/csrc: the PrivateUse1 hooks Python
cannot reach; module.cpp says what each translation unit holds). Everything else is
declared in setup.cfg."""
import os

# torch's import would load an installed neuron device whose extension this build replaces
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

SOURCES = [
    f"device/csrc/{name}.cpp"
    for name in ("memory", "host_pool", "hooks", "hot_path", "record", "views", "sparse", "cells", "cow", "executor", "profiler", "module")
]
# profiler.cpp: the Kineto headers the torch wheel ships, and the defines they need
# (USE_KINETO: privateuse1_profiler.h is empty without it; KINETO_NAMESPACE: output_base.h;
# FMT_HEADER_ONLY: GenericTraceActivity::addMetadata formats with fmt, which libtorch does
# not export)
KINETO_INCLUDE = os.path.join(os.path.dirname(torch.__file__), "include", "kineto")
KINETO_DEFINES = [("USE_KINETO", None), ("KINETO_NAMESPACE", "libkineto"), ("FMT_HEADER_ONLY", None)]

setup(
    ext_modules=[
        CppExtension(
            "adaptive_eager_device._C", SOURCES, depends=["device/csrc/neuron.h"], extra_compile_args=["-O2"],
            include_dirs=[KINETO_INCLUDE], define_macros=KINETO_DEFINES,
        ),
    ],
    cmdclass={"build_ext": BuildExtension},
)
