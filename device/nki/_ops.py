"""The operators ``nl.add``, ``nl.exp`` ... : ALU operators and activation functions.

Each is an :class:`Op`: an ISA instruction takes it as ``op=`` (its numpy definition in float32,
or on integer bit patterns for the bitvec operators), and calling it, ``nl.add(a, b)``, runs the
``nki.language`` function of that name (``language.py`` gives it its body). The tables are
``nki/api/nki.api.shared.rst``: "Supported Math Operators for NKI ISA" (ALU) and "Supported
Activation Functions for NKI ISA".
"""
from __future__ import annotations

import numpy as np

_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


def _erf(x):
    """erf in float32: Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7)."""
    x = np.asarray(x, dtype=np.float64)
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(-a * a)
    return (sign * y).astype(np.float32)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def _gelu(x):
    return (0.5 * x * (1.0 + _erf(x / np.float32(np.sqrt(2.0))))).astype(np.float32)


def _gelu_dx(x):
    return (0.5 * (1.0 + _erf(x / np.float32(np.sqrt(2.0)))) + x * np.exp(-0.5 * x * x) / np.float32(np.sqrt(2 * np.pi))).astype(np.float32)


def _gelu_tanh(x):
    return (0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + np.float32(0.044715) * x * x * x)))).astype(np.float32)


def _gelu_sigmoid(x):
    return (x * _sigmoid(np.float32(1.702) * x)).astype(np.float32)


def _gelu_sigmoid_dx(x):
    s = _sigmoid(np.float32(1.702) * x)
    return (s + np.float32(1.702) * x * s * (1.0 - s)).astype(np.float32)


def _silu_dx(x):
    s = _sigmoid(x)
    return (s * (1.0 + x * (1.0 - s))).astype(np.float32)


def _softplus(x):
    return np.logaddexp(np.float32(0), x).astype(np.float32)


def _logical(f):
    return lambda a, b: f(a != 0, b != 0).astype(np.float32)


def _cmp(f):
    return lambda a, b: f(a, b).astype(np.float32)


def _right_shift(a, b):
    unsigned = a.astype(np.uint64) & np.uint64((1 << (8 * a.dtype.itemsize)) - 1) if a.dtype.kind == "i" else a
    return (unsigned >> b.astype(unsigned.dtype)).astype(a.dtype)


def _abs_max(a, b):
    return np.where(np.abs(a) > np.abs(b), a, b)


def _abs_min(a, b):
    return np.where(np.abs(a) < np.abs(b), a, b)


class Op:
    """An NKI operator.

    ``arity`` 1 or 2; ``bitvec`` operators work on integer bit patterns; ``reduce_identity`` is
    set for the legal reduction operators; ``activation`` marks the Scalar Engine functions."""

    def __init__(self, name, arity, fn, *, bitvec=False, reduce_identity=None, activation=False, alias=None):
        self.name = name
        self.arity = arity
        self.fn = fn
        self.bitvec = bitvec
        self.reduce_identity = reduce_identity
        self.activation = activation
        self.alias = alias  # the operator this one means when passed as op= (nl.max -> maximum)
        self.language = None  # the nki.language function; language.py sets it

    @property
    def op(self) -> "Op":
        return self.alias or self

    def __call__(self, *args, **kwargs):
        if self.language is None:
            raise TypeError(f"nl.{self.name} is an operator constant, not a function")
        return self.language(*args, **kwargs)

    def __repr__(self):
        return f"nl.{self.name}"

    def apply(self, a, b=None, relu_param=0.0):
        if self.arity == 1:
            if self.name == "prelu":
                return np.where(a >= 0, a, a * np.float32(relu_param)).astype(np.float32)
            return self.fn(a)
        return self.fn(a, b)

    def reduce(self, values: np.ndarray) -> np.ndarray:
        """Reduce a (P, K) array along K (float32 math for arithmetic operators)."""
        name = self.op.name
        if name == "add":
            return np.add.reduce(values, axis=1)
        if name == "subtract":
            return values[:, 0] - np.add.reduce(values[:, 1:], axis=1)
        if name == "multiply":
            return np.multiply.reduce(values, axis=1)
        if name == "maximum":
            return np.max(values, axis=1)
        if name == "minimum":
            return np.min(values, axis=1)
        if name == "average":
            return np.mean(values, axis=1, dtype=np.float32)
        if name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
            return getattr(np, name).reduce(values, axis=1)
        if name in ("logical_and", "logical_or", "logical_xor"):
            base = {"logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor}[name]
            return base.reduce(values != 0, axis=1).astype(np.float32)
        raise ValueError(f"nl.{name} is not a reduction operator")


def _ops():
    f32 = np.float32
    table = [
        Op("add", 2, np.add, reduce_identity=0.0),
        Op("subtract", 2, np.subtract, reduce_identity=0.0),
        Op("multiply", 2, np.multiply, reduce_identity=1.0),
        Op("divide", 2, lambda a, b: np.divide(a, b)),
        Op("maximum", 2, np.maximum, reduce_identity=-np.inf),
        Op("minimum", 2, np.minimum, reduce_identity=np.inf),
        Op("power", 2, lambda a, b: np.power(a, b)),
        Op("fmod", 2, np.fmod),
        Op("mod", 2, np.mod),
        Op("abs_max", 2, _abs_max),
        Op("abs_min", 2, _abs_min),
        Op("equal", 2, _cmp(np.equal)),
        Op("not_equal", 2, _cmp(np.not_equal)),
        Op("less", 2, _cmp(np.less)),
        Op("less_equal", 2, _cmp(np.less_equal)),
        Op("greater", 2, _cmp(np.greater)),
        Op("greater_equal", 2, _cmp(np.greater_equal)),
        Op("logical_and", 2, _logical(np.logical_and), reduce_identity=1.0),
        Op("logical_or", 2, _logical(np.logical_or), reduce_identity=0.0),
        Op("logical_xor", 2, _logical(np.logical_xor), reduce_identity=0.0),
        Op("bitwise_and", 2, np.bitwise_and, bitvec=True, reduce_identity=-1),
        Op("bitwise_or", 2, np.bitwise_or, bitvec=True, reduce_identity=0),
        Op("bitwise_xor", 2, np.bitwise_xor, bitvec=True, reduce_identity=0),
        Op("left_shift", 2, lambda a, b: np.left_shift(a, b.astype(a.dtype)), bitvec=True),
        Op("right_shift", 2, _right_shift, bitvec=True),
        Op("average", 2, lambda a, b: (a + b) / f32(2), reduce_identity=0.0),
        Op("bypass", 2, lambda a, b: a),
        # unary (ALU and activation)
        Op("invert", 1, np.invert, bitvec=True),
        Op("logical_not", 1, lambda a: (a == 0).astype(f32)),
        Op("abs", 1, np.abs, activation=True),
        Op("square", 1, np.square, activation=True),
        Op("relu", 1, lambda a: np.maximum(a, f32(0)), activation=True),
        Op("rsqrt", 1, lambda a: (f32(1) / np.sqrt(a)).astype(f32), activation=True),
        Op("reciprocal", 1, lambda a: (f32(1) / a).astype(f32), activation=True),
        Op("negative", 1, np.negative),
        Op("sign", 1, np.sign, activation=True),
        Op("copy", 1, lambda a: a, activation=True),
        Op("identity", 1, lambda a: a, activation=True),
        Op("exp", 1, np.exp, activation=True),
        Op("log", 1, np.log, activation=True),
        Op("sqrt", 1, np.sqrt, activation=True),
        Op("tanh", 1, np.tanh, activation=True),
        Op("sigmoid", 1, _sigmoid, activation=True),
        Op("gelu", 1, _gelu, activation=True),
        Op("gelu_dx", 1, _gelu_dx, activation=True),
        Op("gelu_apprx_tanh", 1, _gelu_tanh, activation=True),
        Op("gelu_apprx_sigmoid", 1, _gelu_sigmoid, activation=True),
        Op("gelu_apprx_sigmoid_dx", 1, _gelu_sigmoid_dx, activation=True),
        Op("silu", 1, lambda a: (a * _sigmoid(a)).astype(f32), activation=True),
        Op("silu_dx", 1, _silu_dx, activation=True),
        Op("softplus", 1, _softplus, activation=True),
        Op("mish", 1, lambda a: (a * np.tanh(_softplus(a))).astype(f32), activation=True),
        Op("erf", 1, _erf, activation=True),
        Op("erf_dx", 1, lambda a: (f32(2 / np.sqrt(np.pi)) * np.exp(-a * a)).astype(f32), activation=True),
        Op("sin", 1, np.sin, activation=True),
        Op("cos", 1, np.cos),
        Op("tan", 1, np.tan),
        Op("arctan", 1, np.arctan, activation=True),
        Op("ceil", 1, np.ceil),
        Op("floor", 1, np.floor),
        Op("trunc", 1, np.trunc),
        Op("prelu", 1, None, activation=True),
    ]
    ops = {op.name: op for op in table}
    ops["max"] = Op("max", 2, np.maximum, reduce_identity=-np.inf, alias=ops["maximum"])
    ops["min"] = Op("min", 2, np.minimum, reduce_identity=np.inf, alias=ops["minimum"])
    return ops


OPS = _ops()


def as_op(op, what: str, role: str = "op") -> Op:
    from ._state import fail

    if isinstance(op, Op):
        return op.op
    if op is None:
        return None
    name = getattr(op, "__name__", None)
    if isinstance(op, str):
        name = op
    if name in OPS:
        return OPS[name].op
    fail(what, f"{role}={op!r} is not an NKI operator (nl.add, nl.multiply, nl.exp, ...)")
