"""Triton kernels. Each public function here is a thin wrapper that checks shapes, dtypes and strides
and launches one kernel; the plain-PyTorch references they are tested against live next to the layers
(`layers/attention.py`, `norm.py`, `activation.py`, `rotary.py`).

Modules are imported on first use (by the Triton backend, `layers/backend.py`), so the reference path
never needs a working Triton, and tests can set `TRITON_INTERPRET=1` before the first import.
"""
