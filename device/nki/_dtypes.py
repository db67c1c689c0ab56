"""NKI data types as numpy dtypes (ml_dtypes for bfloat16 and the float8 formats).

The table is ``nki/api/nki.api.shared.rst`` ("Supported Data Types by NKI"). Each NKI dtype is a
``numpy.dtype``, so ``tensor.dtype == nl.bfloat16`` holds for tensors made from numpy arrays of
``ml_dtypes.bfloat16``, dtypes work as dict keys, and ``str(nl.float8_e4m3) == "float8_e4m3"``
(nki-library sizes dtypes by their names). ``tfloat32`` and the x4-packed MX types have no numpy
equivalent: they are distinct structured dtypes of the right size (4 bytes), usable for storage
and reinterpretation; compute instructions read ``tfloat32`` as float32 and refuse the packed
types (NeuronCore-v4 only).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

bool_ = np.dtype(np.bool_)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)  # IEEE-like e4m3, max 240 (as nki-library's table)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)  # OCP e4m3, max 448
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)
tfloat32 = np.dtype([("tfloat32", "<f4")])
float8_e5m2_x4 = np.dtype([("float8_e5m2_x4", "u1", (4,))])
float8_e4m3fn_x4 = np.dtype([("float8_e4m3fn_x4", "u1", (4,))])
float4_e2m1fn_x4 = np.dtype([("float4_e2m1fn_x4", "u1", (2,))])

PACKED = (float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4)

_BY_NAME = {
    "bool": bool_, "bool_": bool_, "int8": int8, "int16": int16, "int32": int32, "uint8": uint8,
    "uint16": uint16, "uint32": uint32, "float16": float16, "float32": float32, "bfloat16": bfloat16,
    "tfloat32": tfloat32, "float8_e4m3": float8_e4m3, "float8e4": float8_e4m3, "float8_e4m3fn": float8_e4m3fn,
    "float8_e5m2": float8_e5m2, "float8e5": float8_e5m2, "float8_e8m0fnu": float8_e8m0fnu,
    "float8_e5m2_x4": float8_e5m2_x4, "float8_e4m3fn_x4": float8_e4m3fn_x4, "float4_e2m1fn_x4": float4_e2m1fn_x4,
    "fp32": float32, "fp16": float16, "bf16": bfloat16,
}

ALL = tuple(dict.fromkeys(_BY_NAME.values()))


def as_dtype(dtype) -> np.dtype:
    """An NKI dtype from an NKI dtype, a numpy/ml_dtypes type, a name, or a torch dtype."""
    if isinstance(dtype, np.dtype):
        if dtype.names or dtype in ALL:
            return dtype
        if dtype.kind in "biuf":
            return dtype
        raise TypeError(f"{dtype} is not an NKI data type")
    if isinstance(dtype, str):
        key = dtype.replace("torch.", "").replace("nl.", "")
        if key in _BY_NAME:
            return _BY_NAME[key]
        raise TypeError(f"{dtype!r} is not an NKI data type (nki.language has {sorted(set(_BY_NAME))})")
    module = type(dtype).__module__
    if module.startswith("torch"):
        return as_dtype(str(dtype).replace("torch.", "").replace("float8_e4m3fnuz", "float8_e4m3"))
    try:
        return as_dtype(np.dtype(dtype))
    except TypeError:
        raise TypeError(f"{dtype!r} is not an NKI data type") from None


def name(dtype: np.dtype) -> str:
    if dtype.names:
        return dtype.names[0]
    return str(dtype)


def is_float(dtype: np.dtype) -> bool:
    return dtype == tfloat32 or (dtype.names is None and dtype.kind == "f") or dtype in (
        bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu)


def is_int(dtype: np.dtype) -> bool:
    return dtype.names is None and dtype.kind in "iub" and dtype not in (
        bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu)


def is_16bit_float(dtype: np.dtype) -> bool:
    return dtype in (bfloat16, float16)


def is_fp8(dtype: np.dtype) -> bool:
    return dtype in (float8_e4m3, float8_e4m3fn, float8_e5m2)


def storage_view(dtype: np.dtype) -> np.dtype:
    """The numpy dtype values of ``dtype`` are read and written as."""
    if dtype == tfloat32:
        return float32
    return dtype


def sentinel(dtype: np.dtype):
    """What a fresh allocation holds: NaN for floats, 4 for integers (nki_simulator.rst,
    "Uninitialized Memory Detection")."""
    if dtype.names:
        return 0
    return np.nan if is_float(dtype) else 4


def cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` (float32, or an integer type for bit-exact paths) converted to ``dtype`` the way
    the engines write their float32 results: round to nearest even for floats (ml_dtypes), and for
    integers round to nearest and saturate (NaN becomes 0) - an assumption, the documents do not say."""
    target = storage_view(dtype)
    if target.names:
        raise TypeError(f"{name(dtype)} is a packed MX type (NeuronCore-v4 nc_matmul_mx/quantize_mx only)")
    values = np.asarray(values)
    if values.dtype == target:
        return values
    if is_int(target):
        if target == bool_:
            return values != 0
        if values.dtype.kind in "iub" and values.dtype not in (bfloat16,):
            info = np.iinfo(target)
            return np.clip(values.astype(np.int64), info.min, info.max).astype(target)
        info = np.iinfo(target)
        v = np.nan_to_num(np.rint(values.astype(np.float64)), nan=0.0)
        return np.clip(v, info.min, info.max).astype(target)
    if values.dtype.kind in "iu" and values.dtype.itemsize >= 4:
        values = values.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(target)


def to_f32(values: np.ndarray) -> np.ndarray:
    """Engine input conversion: every arithmetic engine computes in float32."""
    values = np.asarray(values)
    if values.dtype == np.float32:
        return values
    if values.dtype.names:
        raise TypeError("packed MX types cannot be read by compute instructions on NeuronCore-v3")
    return values.astype(np.float32)
