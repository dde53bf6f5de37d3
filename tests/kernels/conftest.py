"""Kernel tests: without a GPU, Triton's interpreter runs the kernels (TRITON_INTERPRET=1, set here once,
before any test module of this folder imports a kernel). `triton.jit` picks interpreter or compiler when
a module is imported, triton's own `tl.sum` & co. included, so if triton was imported before (by a test
collected earlier), it and our kernels are imported afresh; the compiled extension `triton._C` is kept,
it does not depend on the mode. sm90.py compiles GPU code in a fresh interpreter without the variable."""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(tl.sum, InterpretedFunction):
            for name in list(sys.modules):
                stale = (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")
                if stale or name.startswith("tokenmill.layers.kernels"):
                    del sys.modules[name]

    # The interpreter holds scalars as 1-element arrays and turns them into loop bounds with int(), which
    # NumPy >= 2.4 rejects for arrays with ndim > 0; index the single element instead.
    from triton.runtime import interpreter

    _original = interpreter._patch_lang_tensor

    def _patched(tensor, scope):
        _original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patched

    # The interpreter's float conversion rounds a mantissa up without carrying into the exponent (E4M3
    # 1.97 -> 1.0, where the GPU gives 2.0); conversions to or from E4M3 go through torch's, which round to
    # nearest even as the GPU's cvt does.
    import numpy as np
    import triton.language as tl

    _convert_float = interpreter._convert_float
    _torch_float = {tl.float32: (np.float32, torch.float32), tl.float16: (np.float16, torch.float16),
                    tl.bfloat16: (np.int16, torch.bfloat16), tl.float8e4nv: (np.uint8, torch.float8_e4m3fn)}

    def _convert_float_e4m3(input, input_dtype, output_dtype, rounding_mode):
        if tl.float8e4nv not in (input_dtype, output_dtype) or input_dtype not in _torch_float \
                or output_dtype not in _torch_float:
            return _convert_float(input, input_dtype, output_dtype, rounding_mode)
        raw, src = _torch_float[input_dtype]
        bits = getattr(np, f"uint{output_dtype.primitive_bitwidth}")
        x = torch.from_numpy(np.ascontiguousarray(input).view(raw)).view(src)
        return x.to(_torch_float[output_dtype][1]).view(getattr(torch, f"uint{output_dtype.primitive_bitwidth}")
                                                        ).numpy().view(bits).reshape(input.shape)

    interpreter._convert_float = _convert_float_e4m3

    # Every call of a @triton.jit helper inside a kernel patches the language anew, and each patch walked
    # the whole module with inspect.getmembers: a quarter of a kernel test's time. The builtin names of
    # each patched namespace, listed once here before any kernel has run (so none is patched yet), are
    # all a patch needs to visit; a name whose member is already patched is skipped, as before.
    import inspect

    _builtin_names = {id(pkg): [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
                      for pkg in (tl, tl.core, tl.core.tensor, tl.math, tl.core.tensor_descriptor_base)}
    _patch_builtin = interpreter._patch_builtin

    def _patch_builtin_by_name(pkg, builder, scope):
        names = _builtin_names.get(id(pkg))
        if names is None:
            return _patch_builtin(pkg, builder, scope)
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = _patch_builtin_by_name
