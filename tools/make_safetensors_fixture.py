#!/usr/bin/env python3
"""Writes the safetensors fixtures of tests/io/data with the reference
implementation (pip install safetensors numpy), so that slime's reader is
tested against files it did not write. tests/io/test_safetensors.cpp checks
the values below; change both together.

    python3 tools/make_safetensors_fixture.py [out_dir]   # default tests/io/data
"""
import os
import sys

import numpy as np
import safetensors
from safetensors import TensorSpec, serialize_file
from safetensors.numpy import save_file


def bf16_bits(values):
    """fp32 -> bf16 bit patterns, round to nearest even (no NaN inputs)."""
    u = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "io", "data")
    os.makedirs(out, exist_ok=True)

    # safetensors.numpy: F32, F16, I64, I32, U8, a 0-d scalar and an empty tensor.
    save_file(
        {
            "weight": (np.arange(15, dtype=np.float32) * 0.25 - 1.5).reshape(3, 5),
            "half": np.array([0.0, 1.0, -2.0, 0.5, 65504.0, 2.0**-14, 2.0**-24], dtype=np.float16),
            "ids": np.array([0, -1, 2**40, -(2**62)], dtype=np.int64),
            "count": np.array([-7, 0, 2**31 - 1], dtype=np.int32),
            "bytes": np.array([[0, 1, 127], [128, 254, 255]], dtype=np.uint8),
            "scalar": np.array(3.5, dtype=np.float32),
            "empty": np.zeros((0, 4), dtype=np.float32),
        },
        os.path.join(out, "numpy_fixture.safetensors"),
        metadata={"format": "np", "producer": "tools/make_safetensors_fixture.py"},
    )

    # The low-level API for what numpy lacks: BF16 (bit patterns made here)
    # and F64, a valid safetensors dtype slime does not read.
    bf16 = bf16_bits([1.0, -2.5, 3.140625, 1e-3])
    f64 = np.array([1.0, 2.0], dtype=np.float64)
    serialize_file(
        {
            "bf16": TensorSpec(dtype="bfloat16", shape=[2, 2], data_ptr=bf16.ctypes.data, data_len=bf16.nbytes),
            "f64": TensorSpec(dtype="float64", shape=[2], data_ptr=f64.ctypes.data, data_len=f64.nbytes),
        },
        os.path.join(out, "bf16_fixture.safetensors"),
        metadata={"format": "pt"},
    )
    print(f"wrote fixtures to {out} with safetensors {safetensors.__version__}")


if __name__ == "__main__":
    main()
