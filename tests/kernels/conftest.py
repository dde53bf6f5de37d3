"""Kernel tests: without a GPU, Triton's interpreter runs the kernels (TRITON_INTERPRET=1, set here once,
before any test module of this folder imports a kernel). `triton.jit` picks interpreter or compiler when
a module is imported, triton's own `tl.sum` & co. included, so if triton was imported before (by a test
collected earlier), it and our kernels are imported afresh; the compiled extension `triton._C` is kept,
it does not depend on the mode. sm90.py compiles GPU code in another interpreter, started without the
variable (`sm90_compiler`)."""
from __future__ import annotations

import os
import sys

import pytest
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

    # Every call of a @triton.jit helper inside a kernel patches the language anew: it scans the helper's
    # module for the language modules and walks each of them with inspect.getmembers, a third of a kernel
    # test's time. Here the modules found are kept per module, and a namespace patched since the last
    # restore is not walked again (nothing but a restore unpatches a name); otherwise a patch visits the
    # builtin names listed once below, before any kernel has run, and skips those already patched, as the
    # interpreter's own walk does.
    import inspect

    _builtin_names = {id(pkg): [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
                      for pkg in (tl, tl.core, tl.core.tensor, tl.math, tl.core.tensor_descriptor_base)}
    _restores = [0]
    _patched_since = {}
    _patch_builtin = interpreter._patch_builtin
    _restore = interpreter._LangPatchScope.restore

    def _restore_counted(self):
        _restores[0] += 1
        _restore(self)

    def _patch_builtin_by_name(pkg, builder, scope):
        names = _builtin_names.get(id(pkg))
        if names is None:
            return _patch_builtin(pkg, builder, scope)
        if _patched_since.get(id(pkg)) == _restores[0]:
            return
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)
        _patched_since[id(pkg)] = _restores[0]

    _langs_of = {}

    def _patch_lang(fn):
        # the interpreter's `_patch_lang`, its language modules found once per module
        scope = interpreter._LangPatchScope()
        langs = _langs_of.get(id(fn.__globals__))
        if langs is None:
            langs = _langs_of[id(fn.__globals__)] = [value for value in fn.__globals__.values()
                                                     if inspect.ismodule(value) and value in (tl, tl.core)]
        assert langs, "triton.language must be visible from within jit'd function"
        builder = interpreter.interpreter_builder
        for lang in langs:
            _patch_builtin_by_name(lang, builder, scope)
            _patch_builtin_by_name(lang.tensor, builder, scope)
            if lang == tl:
                _patch_builtin_by_name(lang.math, builder, scope)
            interpreter._patch_lang_tensor(lang.tensor, scope)
            interpreter._patch_lang_core(lang, scope)
        _patch_builtin_by_name(tl.core.tensor_descriptor_base, builder, scope)
        return scope

    interpreter._LangPatchScope.restore = _restore_counted
    interpreter._patch_builtin = _patch_builtin_by_name
    interpreter._patch_lang = _patch_lang

    # The interpreter rebuilds its table of NumPy dtypes on every lookup (several per operation); the
    # answer depends on the element type only.
    _np_dtypes = {}
    _get_np_dtype = interpreter._get_np_dtype

    def _get_np_dtype_once(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):          # unhashable; every pointer is held as uint64
            return _get_np_dtype(key)
        np_dtype = _np_dtypes.get(key)
        if np_dtype is None:
            np_dtype = _np_dtypes[key] = _get_np_dtype(key)
        return np_dtype

    interpreter._get_np_dtype = _get_np_dtype_once

    # Every operation builds its result's block type anew (its shape validated and its name formatted); a
    # type is a value, so equal ones are shared.
    _block_types = {}

    def _block_type(dtype, shape):
        if isinstance(dtype, tl.pointer_type) or not all(type(s) is int for s in shape):
            return tl.block_type(dtype, shape)
        key = (dtype, tuple(shape))
        ty = _block_types.get(key)
        if ty is None:
            ty = _block_types[key] = tl.block_type(dtype, shape)
        return ty

    interpreter.InterpreterBuilder.get_block_ty = lambda self, dtype, shape: _block_type(dtype, shape)
    tl.core.block_type.with_element_ty = lambda self, scalar_ty: _block_type(scalar_ty, self.shape)

    # Every tensor an operation makes built its shape anew, a `tl.tuple` of constexprs (the tuple's type and
    # its name formatted), and its numel: a third of the kernel tests' time (103 -> 70 s on one core). Both
    # are functions of the shape alone, and nothing changes a tensor's shape in place (`tl.tuple._setitem`
    # serves a launch's argument tuples), so tensors of one shape share them.
    import math

    _shapes = {}

    def _tensor_init(self, handle, type):
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        dims = tuple(type.shape.values) if type.is_block() else ()      # a block type's shape is a tl.tuple
        shape = _shapes.get(dims)
        if shape is None:
            shape = _shapes[dims] = (tl.core.constexpr(math.prod(dims)),
                                     tl.core.tuple([tl.core.constexpr(d) for d in dims]))
        self.numel, self.shape = shape

    tl.core.tensor.__init__ = _tensor_init

    # Broadcasting two blocks of one shape returns them as they are, but only after comparing the shapes
    # through constexprs and tuples built for the purpose (the kernel tests 70 -> 64 s without that). Blocks
    # whose shapes are equal lists of ints are returned at once; any other pair takes the interpreter's way.
    from triton.language.semantic import TritonSemantic

    _broadcast_impl_value = TritonSemantic.broadcast_impl_value

    def _broadcast_unless_same_shape(self, lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        if lhs_ty.is_block() and rhs_ty.is_block() and lhs_ty.shape.values == rhs_ty.shape.values:
            return lhs, rhs
        return _broadcast_impl_value(self, lhs, rhs)

    TritonSemantic.broadcast_impl_value = _broadcast_unless_same_shape


@pytest.fixture(scope="session")
def sm90_compiler():
    """`sm90.Compiler`: the one Python, without TRITON_INTERPRET, that compiles sm90 code for the session's
    tests. A Python of its own for each script imported torch, triton and our kernels each time: the six
    files of sm90 tests took 47 s on one core of the 2-core CPU machine, 32 s with one Python."""
    import sm90
    compiler = sm90.Compiler()
    yield compiler
    compiler.close()
