"""Persisting L2 lines for a captured CUDA graph (Ampere and later), through the CUDA driver API.

A batch-1 decode step streams every weight once, so between one layer's kernels and the next layer's
the L2 cache has been refilled several times over. The small tensors that a kernel reads right after its
programmatic-dependent-launch wait (norm weights, the attention's counters and RoPE table) then come from
HBM, on the step's critical path. A kernel launched with an *access policy window* marks its accesses
inside the window as persisting: those lines stay in a set-aside part of L2 (`set_persisting`) and are
not evicted by the streaming accesses of other kernels.

`kernel_nodes` lists a captured graph's kernel nodes with their pointer arguments, and `set_window`
gives one node its window; a graph must be captured with `torch.cuda.CUDAGraph(keep_graph=True)` and
instantiated after its nodes are changed.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

# cuda.h
_ATTR_L2_CACHE_SIZE = 38
_ATTR_MAX_PERSISTING_L2_CACHE_SIZE = 108
_ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
_GRAPH_NODE_TYPE_KERNEL = 0
ACCESS_NORMAL, ACCESS_STREAMING, ACCESS_PERSISTING = 0, 1, 2


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("window", _Window)]


class _KernelParams(ctypes.Structure):      # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.POINTER(ctypes.c_void_p)),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


_lib = None


def _driver():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        p, sz = ctypes.c_void_p, ctypes.c_size_t
        sigs = {
            "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
            "cuCtxSetLimit": [ctypes.c_int, sz],
            "cuCtxGetLimit": [ctypes.POINTER(sz), ctypes.c_int],
            "cuCtxResetPersistingL2Cache": [],
            "cuGraphGetNodes": [p, ctypes.POINTER(p), ctypes.POINTER(sz)],
            "cuGraphNodeGetType": [p, ctypes.POINTER(ctypes.c_int)],
            "cuGraphKernelNodeGetParams_v2": [p, ctypes.POINTER(_KernelParams)],
            "cuFuncGetParamInfo": [p, sz, ctypes.POINTER(sz), ctypes.POINTER(sz)],
            "cuGraphKernelNodeSetAttribute": [p, ctypes.c_int, ctypes.POINTER(_AttrValue)],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        _lib = lib
    return _lib


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {code}")


def device_limits(index: int) -> dict[str, int]:
    """L2 size, the most of it persisting lines may take, and the largest window, in bytes."""
    lib, out = _driver(), {}
    for key, attr in (("l2_bytes", _ATTR_L2_CACHE_SIZE), ("max_persisting_bytes", _ATTR_MAX_PERSISTING_L2_CACHE_SIZE),
                      ("max_window_bytes", _ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE)):
        v = ctypes.c_int()
        _check(lib.cuDeviceGetAttribute(ctypes.byref(v), attr, index), "cuDeviceGetAttribute")
        out[key] = v.value
    return out


def set_persisting(nbytes: int) -> int:
    """Sets aside `nbytes` of L2 for persisting lines in the current context (0: none) and drops the
    lines persisting so far; returns the size the driver took."""
    lib = _driver()
    _check(lib.cuCtxSetLimit(_LIMIT_PERSISTING_L2_CACHE_SIZE, nbytes), "cuCtxSetLimit")
    _check(lib.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")
    got = ctypes.c_size_t()
    _check(lib.cuCtxGetLimit(ctypes.byref(got), _LIMIT_PERSISTING_L2_CACHE_SIZE), "cuCtxGetLimit")
    return got.value


@dataclass
class KernelNode:
    handle: int
    pointers: list[int]       # the values of its 8-byte arguments


def kernel_nodes(raw_graph: int) -> list[KernelNode]:
    """The kernel nodes of a graph (`CUDAGraph.raw_cuda_graph()`), each with its 8-byte arguments."""
    lib = _driver()
    n = ctypes.c_size_t()
    _check(lib.cuGraphGetNodes(raw_graph, None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    _check(lib.cuGraphGetNodes(raw_graph, nodes, ctypes.byref(n)), "cuGraphGetNodes")
    out = []
    for node in nodes[:n.value]:
        kind = ctypes.c_int()
        _check(lib.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value != _GRAPH_NODE_TYPE_KERNEL:
            continue
        params = _KernelParams()
        _check(lib.cuGraphKernelNodeGetParams_v2(node, ctypes.byref(params)), "cuGraphKernelNodeGetParams")
        pointers = []
        i, off, size = 0, ctypes.c_size_t(), ctypes.c_size_t()
        while (params.func and params.kernelParams
               and lib.cuFuncGetParamInfo(params.func, i, ctypes.byref(off), ctypes.byref(size)) == 0):
            if size.value == 8 and params.kernelParams[i]:
                pointers.append(ctypes.c_uint64.from_address(params.kernelParams[i]).value)
            i += 1
        out.append(KernelNode(node, pointers))
    return out


def set_window(node: KernelNode, base: int, nbytes: int, hit_ratio: float = 1.0,
               hit: int = ACCESS_PERSISTING, miss: int = ACCESS_NORMAL) -> None:
    value = _AttrValue()
    value.window = _Window(base, nbytes, hit_ratio, hit, miss)
    _check(_driver().cuGraphKernelNodeSetAttribute(node.handle, _LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW,
                                                   ctypes.byref(value)), "cuGraphKernelNodeSetAttribute")
