"""The sampling kernel (`kernels/sampling.py`) against its reference, the torch path of `runner/sampler.py`,
given the same noise (every row seeded, so both draw E from `seeded_exponential`), and against the kept-set
rule itself computed in float64: ties at the cut-off stay together, nothing outside the kept set is drawn,
draws follow the truncated distribution, seeded rows do not depend on their batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_testing import DEVICE, HALF, gpu
from tokenmill.layers.kernels import sampling
from tokenmill.runner.sampler import _random_tokens_torch, sample
from tokenmill.runner.sampling_rows import ROW
from tokenmill.runner.sampling_tensors import SamplingTensors


def _tensors(vocab, temperature, top_k=None, top_p=None, min_p=None, seeds=None, positions=None):
    """SamplingTensors of len(temperature) seeded rows (top_k 0: off)."""
    rows = np.zeros(len(temperature), dtype=ROW)
    rows["temperature"] = temperature
    rows["top_k"] = [k or vocab for k in top_k] if top_k is not None else vocab
    rows["top_p"] = 1.0 if top_p is None else top_p
    rows["min_p"] = 0.0 if min_p is None else min_p
    rows["seed"] = np.arange(len(rows)) * 7919 + 3 if seeds is None else seeds
    rows["position"] = 0 if positions is None else positions
    rows["seeded"], rows["repetition_penalty"] = 1, 1.0
    return SamplingTensors.from_rows(rows, vocab, torch.device(DEVICE))


def _kernel(logits, t, block=None, filtered=True):
    return sampling.sample(logits, *t.kernel_params, filtered=filtered, block=block)


def _allowed(logits, t):
    """The kept set in float64 [R, V], and the tokens too close to a top-p or min-p boundary for float32 to
    decide (|mass above - top_p * total| or |p / p_max - min_p| within 1e-4)."""
    temperature, top_k, top_p, min_p = (x.cpu().double() for x in t.kernel_params[:4])
    x = logits.cpu().double()
    keep = torch.ones_like(x, dtype=torch.bool)
    unsure = torch.zeros_like(keep)
    for i in range(x.shape[0]):
        xi = x[i]
        if temperature[i] < 1e-5:
            keep[i] = False
            keep[i, xi.argmax()] = True
            continue
        e = torch.exp((xi - xi.max()) / temperature[i])
        survive = e >= min_p[i]
        unsure[i] |= (e - min_p[i]).abs() <= 1e-4
        greater = xi[None, :] > xi[:, None]                 # [j, i]: token i strictly above token j
        keep[i] = survive & (xi > float("-inf"))
        if top_k[i] < x.shape[1]:
            keep[i] &= greater.sum(1) < top_k[i]
        total = e[keep[i]].sum()                             # top-p over what min-p and top-k keep
        if top_p[i] < 1:
            above = (greater * e[None, :]).sum(1)
            keep[i] &= above < top_p[i] * total
            unsure[i] |= (above - top_p[i] * total).abs() <= 1e-4 * total
    return keep, unsure


def _mixed_rows(gen, rows, vocab):
    """Row parameters covering greedy rows, each filter alone and together, flat and peaked rows."""
    def pick(options):
        return [options[int(i)] for i in torch.randint(len(options), (rows,), generator=gen)]
    temperature = pick([0.0, 0.3, 0.8, 1.0, 1.7])
    top_k = pick([0, 0, 1, 2, 17, 50, vocab - 1])
    top_p = pick([1.0, 1.0, 0.05, 0.5, 0.9, 0.95])
    min_p = pick([0.0, 0.0, 0.0, 0.05, 0.3])
    return _tensors(vocab, temperature, top_k, top_p, min_p,
                    seeds=torch.randint(-2**62, 2**62, (rows,), generator=gen).numpy(),
                    positions=torch.randint(0, 5000, (rows,), generator=gen).numpy())


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_kernel_gives_the_torch_paths_tokens_given_the_same_noise(dtype):
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 16, 600
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(rows // 4)[:, None]      # flat to peaked rows
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(dtype)
    logits[3, ::3] = float("-inf")                                              # masked tokens
    logits[5, :] = logits[5, :].round()                                         # wide ties
    t = _mixed_rows(gen, rows, vocab)
    logits = logits.to(DEVICE)
    got = _kernel(logits, t, block=128)
    expect = _random_tokens_torch(logits.float(), t)
    assert got.dtype == torch.int64
    assert got.tolist() == expect.tolist()
    keep, _ = _allowed(logits.float(), t)
    assert keep[torch.arange(rows), got.cpu()].all()


def test_race_skips_no_block_that_holds_the_winner():
    # flat rows over many blocks: the best ratio improves late, often by a small factor, where a skip bound
    # that is too tight would keep the earlier token
    gen = torch.Generator().manual_seed(2)
    rows, vocab = 48, 256
    logits = (torch.randn(rows, vocab, generator=gen) * 0.5).to(DEVICE)
    t = _tensors(vocab, [1.0] * rows)
    assert _kernel(logits, t, block=32).tolist() == _random_tokens_torch(logits, t).tolist()


def test_rows_whose_first_winner_top_p_drops_race_again_and_agree_with_the_torch_path():
    # flat rows with top-p alone (and with min-p): the race over every token often ends outside the nucleus;
    # the kernel then races over the tokens above that winner (and bisects after RETRIES dropped winners,
    # likely at top_p 0.05), and must draw the race's winner over the kept set, as the torch path does
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 32, 256
    logits = (torch.randn(rows, vocab, generator=gen) * 0.4).to(DEVICE)
    top_p = [0.05] * 8 + [0.3] * 8 + [0.6] * 8 + [0.9] * 8
    min_p = [0.0, 0.2] * (rows // 2)
    t = _tensors(vocab, [1.0] * rows, top_p=top_p, min_p=min_p,
                 seeds=torch.randint(0, 2**62, (rows,), generator=gen).numpy(),
                 positions=torch.randint(0, 5000, (rows,), generator=gen).numpy())
    keep, _ = _allowed(logits, t)
    unfiltered = _tensors(vocab, [1.0] * rows, min_p=min_p, seeds=t.kernel_params[4].cpu().numpy(),
                          positions=t.kernel_params[5].cpu().numpy())
    first = _random_tokens_torch(logits, unfiltered).cpu()    # each row's winner over its min-p survivors
    dropped = ~keep[torch.arange(rows), first]
    assert dropped.sum() >= 8, "too few rows take the path under test"
    got = _kernel(logits, t, block=64).cpu()
    assert got.tolist() == _random_tokens_torch(logits, t).cpu().tolist()
    assert keep[torch.arange(rows), got].all()


@pytest.mark.parametrize("case", range(20))
def test_kernel_never_draws_outside_the_kept_set(case):
    # random small rows, half of them integer-valued (wide ties), with masked tokens and any mix of filters
    # (a seeded loop rather than hypothesis, which the GPU machine lacks)
    gen = torch.Generator().manual_seed(100 + case)
    rows, vocab = 4, int(torch.randint(2, 41, (1,), generator=gen))

    def pick(options):
        return [options[int(i)] for i in torch.randint(len(options), (rows,), generator=gen)]
    logits = torch.randn(rows, vocab, generator=gen) * torch.tensor(pick([0.1, 1.0, 3.0]))[:, None]
    if case % 2:
        logits = (logits * 2).round()
    logits[0, torch.rand(vocab, generator=gen) < 0.5] = float("-inf")
    logits[0, 0] = 0.0                                                          # one token left at least
    t = _tensors(vocab, pick([0.0, 0.5, 1.0, 2.0]), torch.randint(0, vocab + 1, (rows,), generator=gen).tolist(),
                 pick([0.1, 0.5, 0.8, 0.95, 1.0]), pick([0.0, 0.0, 0.0, 0.1, 0.5]),
                 seeds=torch.randint(0, 2**62, (rows,), generator=gen).numpy())
    got = _kernel(logits.to(DEVICE), t, block=16).cpu()
    keep, unsure = _allowed(logits, t)
    assert (keep | unsure)[torch.arange(rows), got].all(), (got.tolist(), keep.int().tolist())


def test_ties_at_the_cutoff_stay_together_in_kernel_and_torch_path():
    # top-k 2 over [3, 2, 2, 2, 0, ...]: the second-largest value is shared, so four tokens stay. top-p 0.5
    # over p ~ [e, 1, 1, 1, e^-5]: the mass strictly above each tied token is e / (e + 3) = 0.475 < 0.5, so
    # all three stay with the first (a sorted prefix would cut the tie after its first member)
    draws = 60
    top_k = torch.tensor([3.0, 2.0, 2.0, 2.0, 0.0, -1.0, -2.0, -3.0])
    top_p = torch.tensor([1.0, 0.0, 0.0, 0.0, -5.0, -9.0, -9.0, -9.0])
    for logits, kw, kept in ((top_k, dict(top_k=[2] * draws), {0, 1, 2, 3}),
                             (top_p, dict(top_p=[0.5] * draws), {0, 1, 2, 3})):
        t = _tensors(8, [1.0] * draws, seeds=np.arange(draws), **kw)
        batch = logits.repeat(draws, 1).to(DEVICE)
        for got in (_kernel(batch, t, block=8), _random_tokens_torch(batch, t)):
            assert set(got.tolist()) == kept


@pytest.mark.parametrize("start", [0, 1])
@pytest.mark.parametrize("k", [2, 3])
def test_cutoff_between_adjacent_floats(start, k):
    # consecutive float32 values: bisection has to split neighbours, where a midpoint rounds (to even) onto
    # the bracket's top for one parity of the start and onto its bottom for the other
    draws = 24
    values = torch.tensor([1.0]).repeat(8 + start)
    for i in range(1, len(values)):
        values[i] = torch.nextafter(values[i - 1], torch.tensor(0.0))
    values = values[start:]
    t = _tensors(8, [50.0] * draws, top_k=[k] * draws, seeds=np.arange(draws))
    got = _kernel(values.repeat(draws, 1).to(DEVICE), t, block=8)
    assert set(got.tolist()) == set(range(k))


def test_sampled_frequencies_follow_the_truncated_distribution():
    # p = [.3, .25, .2, .12, .08, .05]: top-p 0.6 keeps the first three (mass above the third 0.55 < 0.6,
    # above the fourth 0.75); top-k 2 the first two; min-p 0.5 (p >= 0.15) the first three. Each group of
    # rows draws with its own seeds; chi-square against the renormalised kept probabilities.
    p = torch.tensor([0.3, 0.25, 0.2, 0.12, 0.08, 0.05])
    n = 80
    groups = [(dict(top_p=[0.6] * n), 3), (dict(top_k=[2] * n), 2), (dict(min_p=[0.5] * n), 3)]
    for g, (kw, kept) in enumerate(groups):
        t = _tensors(6, [1.0] * n, seeds=np.arange(n) + 1000 * g, positions=np.arange(n) % 7, **kw)
        got = _kernel(p.log().repeat(n, 1).to(DEVICE), t, block=8).cpu()
        counts = torch.bincount(got, minlength=6).double()
        assert counts[kept:].sum() == 0
        expect = p[:kept].double() / p[:kept].sum() * n
        chi2 = float(((counts[:kept] - expect) ** 2 / expect).sum())
        assert chi2 < 16.0, (g, counts.tolist(), chi2)           # df 1-2: p < 1e-3


def test_top_p_takes_the_nucleus_of_what_top_k_keeps():
    """vLLM's and Hugging Face's order: top-k 3 of p = [.3, .25, .2, .12, .08, .05] keeps [.4, .333, .267]
    renormalised, whose nucleus at top-p 0.7 is the first two (0.733 above the third); top-p over the whole
    row would keep the third too (0.55 above it). Kernel and torch path draw from the first two only, and
    both often enough (the first winner is settled by its lower bound or by the top-k mass, both taken)."""
    p = torch.tensor([0.3, 0.25, 0.2, 0.12, 0.08, 0.05])
    n = 60
    t = _tensors(6, [1.0] * n, top_k=[3] * n, top_p=[0.7] * n, seeds=np.arange(n) + 77)
    batch = p.log().repeat(n, 1).to(DEVICE)
    for got in (_kernel(batch, t, block=8).cpu(), _random_tokens_torch(batch, t).cpu()):
        counts = torch.bincount(got, minlength=6)
        assert counts[2:].sum() == 0 and counts[0] > 15 and counts[1] > 15, counts.tolist()


def test_seeded_rows_are_reproducible_and_independent_of_their_batch():
    gen = torch.Generator().manual_seed(9)
    vocab = 100
    row = torch.randn(vocab, generator=gen) * 2
    others = torch.randn(4, vocab, generator=gen) * 4

    def tokens(batch_rows, at):
        # the row at `at` for positions 0-3, beside rows of other parameters, seeds and positions
        n = len(batch_rows)
        logits = batch_rows.repeat(4, 1)
        logits[at::n] = row
        temps, top_p, seeds, positions = [1.3] * 4 * n, [0.7] * 4 * n, list(range(4 * n)), [3] * 4 * n
        for pos in range(4):
            i = pos * n + at
            temps[i], top_p[i], seeds[i], positions[i] = 0.8, 0.9, 1234, pos
        t = _tensors(vocab, temps, top_p=top_p, seeds=seeds, positions=positions)
        return _kernel(logits.to(DEVICE), t, block=32)[at::n].tolist()

    alone = tokens(row[None], 0)
    assert alone == tokens(others[:2], 1) == tokens(others, 3)
    assert len(set(alone)) > 1                                   # the position moves the draw


def test_greedy_rows_take_the_first_maximum():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    logits[0, [7, 300, 499]] = 9.0                              # ties across blocks: the first wins
    logits[1, :] = -1.0
    logits[2, :450] = float("-inf")
    t = _tensors(500, [0.0, 0.0, 0.0])
    got = _kernel(logits.to(DEVICE), t, block=64)
    assert got.tolist() == [7, 0, int(logits[2].argmax())]


def test_a_forced_token_is_drawn_under_every_filter():
    """A row that must take one token (a thinking budget's </think>: `SamplingTensors.forced`) keeps it alone:
    `sample` draws it whatever the row's temperature, top-k, top-p and min-p (on CUDA through the kernel), and
    so does the kernel given the logits `sample` hands it; a row that need not keeps its draw, and logprobs
    stay those of the model's distribution."""
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 8, 600
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(DEVICE)
    t = _mixed_rows(gen, rows, vocab)
    ids = torch.tensor([5, 17, 599, 0, 42, 300, 1, 2], device=DEVICE)
    must = torch.tensor([True, True, True, True, False, True, False, True], device=DEVICE)
    free = sample(logits, t).token_ids
    t.forced, t.max_logprobs = (torch.arange(rows, device=DEVICE), ids, must), 0
    out = sample(logits, t)
    assert torch.equal(out.token_ids, torch.where(must, ids, free))
    model = logits.float().log_softmax(-1).gather(-1, out.token_ids[:, None])
    assert torch.allclose(out.logprobs, model, atol=1e-5)
    alone = torch.full_like(logits, float("-inf"))
    alone[torch.arange(rows, device=DEVICE), ids] = 0.0
    assert torch.equal(_kernel(torch.where(must[:, None], alone, logits), t),
                       torch.where(must, ids, _kernel(logits, t)))


def test_kernel_parameters_are_views_of_one_packed_copy():
    t = _tensors(100, [0.0, 0.5], top_k=[0, 5], top_p=[1.0, 0.8], min_p=[0.0, 0.1], seeds=[-2**63, 2**62 + 1],
                 positions=[0, 2**40])
    temperature, top_k, top_p, min_p, seeds, positions = t.kernel_params
    assert temperature.tolist() == [0.0, 0.5] and top_k.tolist() == [100, 5]
    assert top_p.tolist() == pytest.approx([1.0, 0.8]) and min_p.tolist() == pytest.approx([0.0, 0.1])
    assert seeds.tolist() == [-2**63, 2**62 + 1] and positions.tolist() == [0, 2**40]
    assert len({x.untyped_storage().data_ptr() for x in t.kernel_params}) == 1
    assert t.top_k is top_k and t.seeds is seeds and t.seeded_rows.tolist() == [1, 1]
    with pytest.raises(ValueError, match="top_p must be"):
        sampling.sample(torch.zeros(2, 100, device=DEVICE), temperature, top_k, top_p[:1], min_p, seeds, positions)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("filtered", [True, False], ids=["filter-shape", "race-shape"])
def test_gpu_kernel_matches_the_torch_path_at_a_real_vocabulary(filtered):
    from tokenmill.runner.sampler import _top_k_top_p_min_p
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 64, 151936
    scale = torch.tensor([0.5, 2.0, 4.0, 8.0]).repeat(rows // 4)[:, None]
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(torch.bfloat16).cuda()
    t = _mixed_rows(gen, rows, vocab)
    got = _kernel(logits, t, filtered=filtered)      # either launch shape gives the same tokens
    expect = _random_tokens_torch(logits.float(), t)
    # the two compute p in different orders: only a near-tie of the two best ratios, or a top-p or min-p
    # boundary within float32 rounding, can tell them apart
    assert (got == expect).float().mean().item() >= 0.95, (got != expect).nonzero().flatten().tolist()
    kept = torch.isfinite(_top_k_top_p_min_p(logits.float() / t.temperature.clamp_min(1e-5)[:, None], t))
    kept |= (t.temperature < 1e-5)[:, None]
    assert kept[torch.arange(rows, device="cuda"), got].float().mean().item() >= 0.95


@pytest.mark.gpu
@gpu
def test_gpu_sample_with_bias_penalties_and_logprobs_through_the_kernel():
    vocab = 151936
    logits = torch.randn(4, vocab, device="cuda", dtype=torch.bfloat16)
    t = _tensors(vocab, [1.0, 0.8, 0.0, 1.0], top_p=[0.9, 1.0, 1.0, 0.5])
    t.logit_bias = (torch.tensor([0, 1], device="cuda"), torch.tensor([11, 22], device="cuda"),
                    torch.tensor([100.0, 100.0], device="cuda"))
    t.max_logprobs = 2
    out = sample(logits, t)
    assert out.token_ids.tolist()[:2] == [11, 22]
    assert out.token_ids[2].item() == logits[2].float().argmax().item()
    assert out.logprobs.shape == (4, 3) and out.logprob_token_ids[:, 0].tolist() == out.token_ids.tolist()
