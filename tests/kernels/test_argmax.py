"""The greedy argmax kernel (`kernels/argmax.py`) against torch's argmax, first of equals."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import DEVICE, HALF, HAS_CUDA, _gen, _randn
from tokenmill.layers.kernels import argmax


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows,vocab,block", [(1, 1000, 128), (3, 4096, 512), (2, 77, 4096)])
def test_greedy_argmax_matches_torch_first_of_equals(dtype, rows, vocab, block):
    gen = _gen(11)
    logits = _randn(rows, vocab, dtype=dtype, gen=gen)
    # ties across chunks and within one: the first index must win, as torch's argmax picks it
    top = logits.float().max() + 1
    logits[0, [5, 700 % vocab, vocab - 1]] = top.to(dtype)
    if rows > 1:
        logits[1, :] = -1.0
        logits[1, [vocab - 2, vocab - 1]] = 3.0
    expect = logits.argmax(-1)
    for _ in range(2):     # the counters are left zeroed: a second launch gives the same tokens
        got = argmax.greedy(logits, block=block)
        assert got.dtype == torch.int64
        torch.testing.assert_close(got, expect, rtol=0, atol=0)
    from tokenmill.layers.kernels import counters
    assert all(int(c.abs().sum()) == 0 for bufs in counters._kept.values() for c in bufs)


def test_greedy_argmax_on_a_strided_view_into_given_output():
    logits = _randn(4, 600, gen=_gen(12))[1:3, :500]
    out = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax.greedy(logits, out, block=64) is out
    torch.testing.assert_close(out, logits.argmax(-1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="unit last stride"):
        argmax.greedy(logits.t())


def test_greedy_argmax_publishes_into_the_turns_row():
    # the tokens also go into row `turn` of a pinned host table, the turn read on the device at run time
    logits = _randn(3, 900, gen=_gen(14))
    host = torch.full((2, 4), -7, dtype=torch.int64)
    if HAS_CUDA:
        host = host.pin_memory()
    for turn in (1, 0):
        got = argmax.greedy(logits, block=256, publish=(host, torch.tensor([turn], dtype=torch.int32,
                                                                             device=DEVICE)))
        if HAS_CUDA:
            torch.cuda.synchronize()
        assert host[turn, :3].tolist() == got.tolist() == logits.argmax(-1).tolist()
    assert host[:, 3].tolist() == [-7, -7]                   # past the rows: untouched
    with pytest.raises(ValueError, match="int64 \\[turns, >= 3\\]"):
        argmax.greedy(logits, publish=(host[:, :2], torch.zeros(1, dtype=torch.int32, device=DEVICE)))
