"""The CPU's decode attention (`attention.paged_attention_torch`) in groups of decodes whose gathered K and V fit
the cache (`attention._decode_chunks`): shortest context first, within `DECODE_CHUNK_BYTES`, with the output of
the batch attended at once."""
from __future__ import annotations

import torch

from tokenmill.layers import attention


def _batch(lens: list[int], q_lens: list[int], block_size: int = 8, hkv: int = 2, hq: int = 4, d: int = 16):
    gen = torch.Generator().manual_seed(5)
    blocks = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(blocks) + 2, generator=gen)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[used:used + n].int()
        used += n
    k = torch.randn(len(perm), block_size, hkv, d, generator=gen)
    v = torch.randn(len(perm), block_size, hkv, d, generator=gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32), qsl


def test_cpu_decodes_attend_in_groups_that_fit_the_cache(monkeypatch):
    lens = [5, 40, 300, 17, 120, 33, 64, 1]
    q_lens = [1, 1, 1, 1, 1, 9, 1, 1]                       # sequence 5: a prefill chunk beside the decodes
    q, k, v, table, seq_lens, qsl = _batch(lens, q_lens)
    per_position = 2 * k.shape[2] * k.shape[3] * 4           # float32 K and V of one position
    one_batch = attention.paged_attention_torch(q, k, v, table, seq_lens, qsl, 0.25)

    groups = []
    decode = attention._decode_attention
    monkeypatch.setattr(attention, "_decode_attention",
                        lambda q, *a: groups.append(a[4]) or decode(q, *a))   # a[4]: the group's contexts
    monkeypatch.setattr(attention, "DECODE_CHUNK_BYTES", 130 * per_position)
    got = attention.paged_attention_torch(q, k, v, table, seq_lens, qsl, 0.25)
    torch.testing.assert_close(got, one_batch, rtol=1e-6, atol=1e-6)
    # every decode once, shortest first; a group holds as many as fit 130 positions each padded to its
    # longest, and the 300-position context, over the budget alone, is a group of its own
    assert groups == [[1, 5, 17], [40, 64], [120], [300]]
    assert all(len(g) * max(g) <= 130 for g in groups[:-1])


def test_a_batch_within_the_budget_is_one_group():
    k = torch.empty(1, 16, 2, 64)
    assert attention._decode_chunks([3, 0, 2], [10, 20, 5, 7], k, torch.device("cpu")) == [[2, 3, 0]]   # shortest first
    assert attention._decode_chunks([], [], k, torch.device("cpu")) == []
