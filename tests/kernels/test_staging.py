"""Step staging (`kernels/staging.py`): the inputs' copy and placeholder fill, and the tokens' publish."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import DEVICE, HAS_CUDA, _gen
from tokenmill.layers.kernels import staging


@pytest.mark.parametrize("n_ids,with_prev", [(1, True), (5, False), (1500, True)])
def test_stage_copies_the_span_and_fills_placeholders(n_ids, with_prev):
    gen = _gen(13)
    ids_bytes, nbytes = 8 * 1600, 8 * 1600 + 4 * 2500
    src = torch.randint(0, 255, (nbytes + 64,), generator=gen, dtype=torch.uint8)
    ids = torch.randint(0, 1000, (n_ids,), generator=gen)
    prev = torch.randint(0, 1000, (7,), generator=gen).to(DEVICE)
    if with_prev:
        ids[::3] = -(torch.arange(len(ids[::3])) % 7) - 1      # placeholders -(row + 1), rows 0..6
    src[:n_ids * 8].view(torch.int64).copy_(ids)
    if HAS_CUDA:
        src = src.pin_memory()
    want = torch.full((nbytes + 64,), 9, dtype=torch.uint8, device=DEVICE)
    got = want.clone()
    staging.stage_torch(want, src, nbytes, ids_bytes, n_ids, prev if with_prev else None)
    staging.stage(got, src, nbytes, ids_bytes, n_ids, prev if with_prev else None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    filled = want[:n_ids * 8].view(torch.int64).cpu()
    if with_prev:
        assert (filled[::3] == prev.cpu()[(-ids[::3] - 1)]).all()
    assert (filled >= 0).all() and (want[n_ids * 8:ids_bytes] == 9).all() and (want[nbytes:] == 9).all()
    torch.testing.assert_close(want[ids_bytes:nbytes].cpu(), src[ids_bytes:nbytes], rtol=0, atol=0)


@pytest.mark.parametrize("n_ids", [0, 1, 1500])
def test_fill_placeholders_resolves_them_in_place(n_ids):
    # the copy-engine path's fill: ids already on the device, placeholders -(row + 1) replaced by prev[row]
    gen = _gen(19)
    prev = torch.randint(0, 1000, (7,), generator=gen).to(DEVICE)
    ids = torch.randint(0, 1000, (n_ids + 3,), generator=gen)
    ids[::2] = -(torch.arange(len(ids[::2])) % 7) - 1
    want = torch.where(ids < 0, prev.cpu()[(-ids - 1).clamp(min=0)], ids)
    got = ids.to(DEVICE)
    staging.fill_placeholders(got[:n_ids], prev)
    assert torch.equal(got[:n_ids].cpu(), want[:n_ids])
    assert torch.equal(got[n_ids:].cpu(), ids[n_ids:])          # past the span: untouched
    with pytest.raises(ValueError, match="contiguous int64"):
        staging.fill_placeholders(got[::2], prev)


def test_stage_rejects_bad_layouts_and_publish_copies_tokens():
    dst = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="whole int32 words"):
        staging.stage(dst, torch.zeros(64, dtype=torch.uint8), 62, 16, 1, None)
    with pytest.raises(ValueError, match="whole int32 words"):
        staging.stage(dst, torch.zeros(64, dtype=torch.uint8), 64, 16, 3, None)
    with pytest.raises(ValueError, match="at least 128 bytes"):
        staging.stage(dst, torch.zeros(64, dtype=torch.uint8), 128, 16, 1, None)
    tokens = torch.arange(5, dtype=torch.int64, device=DEVICE) * 3
    host = torch.zeros(8, dtype=torch.int64)
    if HAS_CUDA:
        host = host.pin_memory()
    staging.publish(tokens, host)
    if HAS_CUDA:
        torch.cuda.synchronize()
    assert host.tolist() == [0, 3, 6, 9, 12, 0, 0, 0]
