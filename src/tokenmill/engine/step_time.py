"""A running model of step time against batch shape, and the latency target that reads it.

`StepTimeModel` fits `seconds ~ a + b * tokens + c * seqs` (tokens: all tokens the step computes, decodes
and prefill chunks; seqs: the sequences in it) by exponentially weighted least squares: each observation
multiplies the weight of those before it by `decay`, so the fit follows drift (contexts grow, the mix of
prompts changes) with a memory of about 1 / (1 - decay) steps. The coefficients are kept non-negative, as
adding work never makes a step cheaper; that also settles the split between b and c while every step so
far was pure decode (tokens == seqs, where only b + c can be told from the data).

`LatencyTarget` turns the fit into caps for the scheduler: the most tokens a step of a given number of
sequences may take, and the most sequences that may run, so that the predicted step time plus a margin
for the measured noise stays under the target.
"""
from __future__ import annotations

import math
import sys

# the three features: the intercept, tokens, seqs
_NUM_FEATURES = 3


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if a[pivot][col] == 0.0:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


class StepTimeModel:
    # ridge added to each diagonal entry, relative to it: it only decides directions the data leaves
    # undetermined (b against c under pure decode), giving them equal shares, and leaves the others be
    RIDGE = 1e-7

    def __init__(self, decay: float = 0.99):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.count = 0
        self._xx = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]    # decayed sum of x x^T
        self._xy = [0.0] * _NUM_FEATURES                                    # decayed sum of x * seconds
        self._yy = 0.0                                                      # decayed sum of seconds^2
        self._weight = 0.0                                                  # decayed number of steps
        self._coef = (0.0, 0.0, 0.0)
        self._mse = 0.0
        self._stale = False

    def observe(self, tokens: int, seqs: int, seconds: float) -> None:
        x = (1.0, float(tokens), float(seqs))
        d = self.decay
        for i in range(_NUM_FEATURES):
            self._xy[i] = d * self._xy[i] + x[i] * seconds
            row = self._xx[i]
            for j in range(_NUM_FEATURES):
                row[j] = d * row[j] + x[i] * x[j]
        self._yy = d * self._yy + seconds * seconds
        self._weight = d * self._weight + 1.0
        self.count += 1
        self._stale = True

    @property
    def coef(self) -> tuple[float, float, float]:
        """(a, b, c): seconds per step, per token, per sequence."""
        self._refit()
        return self._coef

    @property
    def rmse(self) -> float:
        """The fit's residual standard deviation over the steps it weighs: the noise of a step's time plus
        what the linear form misses. In sample, on purpose: errors of predictions made before the model had
        data (a cold start) say nothing about the model now, and would inflate a margin for hundreds of
        steps."""
        self._refit()
        return math.sqrt(self._mse)

    def predict(self, tokens: int, seqs: int) -> float:
        a, b, c = self.coef
        return a + b * tokens + c * seqs

    def _refit(self) -> None:
        if not self._stale:
            return
        self._stale = False
        self._coef, loss = self._fit()
        dof = self._weight - _NUM_FEATURES          # degrees of freedom left, for an unbiased variance
        self._mse = max(self._yy + loss, 0.0) / dof if dof > 0.0 else 0.0

    def _fit(self) -> tuple[tuple[float, float, float], float]:
        """Non-negative least squares, exact for three unknowns: the optimum is the unconstrained optimum
        over its own support, so it is the best of the supports whose solution is non-negative. Returns the
        coefficients and their weighted squared error less the constant sum(w * seconds^2)."""
        best, best_loss = (0.0, 0.0, 0.0), 0.0
        for mask in range(1, 1 << _NUM_FEATURES):
            idx = [i for i in range(_NUM_FEATURES) if mask >> i & 1]
            m = [[self._xx[i][j] + (self.RIDGE * self._xx[i][i] if i == j else 0.0) for j in idx] for i in idx]
            sol = _solve(m, [self._xy[i] for i in idx])
            if sol is None or min(sol) < 0.0:
                continue
            theta = [0.0] * _NUM_FEATURES
            for i, v in zip(idx, sol):
                theta[i] = v
            loss = sum(theta[i] * self._xx[i][j] * theta[j] for i in range(_NUM_FEATURES)
                       for j in range(_NUM_FEATURES)) - 2.0 * sum(t * y for t, y in zip(theta, self._xy))
            if loss < best_loss:
                best, best_loss = (theta[0], theta[1], theta[2]), loss
        return best, best_loss


class LatencyTarget:
    """Caps each step's shape so that `model.predict(tokens, seqs) + MARGIN_SIGMAS * model.rmse` stays
    under `target` seconds. The scheduler keeps the rest of the contract: running decodes are never
    dropped by a cap (over the target, it only stops admitting work until the running set shrinks), and
    a step with nothing running still admits one request, so a target below a step's fixed cost slows the
    engine down but never stalls it."""

    # steps measured before the model is trusted; until then, one request is admitted per step, which
    # also gives the fit steps of varied shapes (one more sequence each step, prompts of varied length)
    MIN_SAMPLES = 8
    # a normal noise stays under 3 standard deviations in 99.9% of steps
    MARGIN_SIGMAS = 3.0
    # a cap reaches at most this many times the largest step measured: a linear fit is not trusted far
    # beyond the shapes it has seen, and growing by steps lets it correct itself before a big miss
    GROWTH = 2.0
    # the sequence cap leaves this share of the step's time above its fixed cost to prefill chunks: with
    # every seat taken by decodes, a freed seat would bring only the few tokens its decode gave up, and a
    # newly admitted prompt would trickle in over many steps
    PREFILL_SHARE = 0.25

    def __init__(self, target_seconds: float, model: StepTimeModel | None = None):
        if not 0.0 < target_seconds < math.inf:
            raise ValueError(f"target_seconds must be positive and finite, got {target_seconds}")
        self.target = target_seconds
        self.model = model or StepTimeModel()
        self.last_seconds = 0.0
        self.max_tokens_seen = 0
        self.max_seqs_seen = 0

    def observe(self, tokens: int, seqs: int, seconds: float) -> None:
        self.model.observe(tokens, seqs, seconds)
        self.last_seconds = seconds
        self.max_tokens_seen = max(self.max_tokens_seen, tokens)
        self.max_seqs_seen = max(self.max_seqs_seen, seqs)

    @property
    def ready(self) -> bool:
        return self.model.count >= self.MIN_SAMPLES

    def _headroom(self) -> float:
        return self.target - self.MARGIN_SIGMAS * self.model.rmse

    def token_cap(self, seqs: int) -> int:
        """The most tokens a step of `seqs` sequences may compute (decodes included)."""
        if not self.ready:
            return sys.maxsize
        a, b, c = self.model.coef
        room = self._headroom() - a - c * seqs
        cap = self.GROWTH * max(self.max_tokens_seen, 1)
        if b > 0.0:
            cap = min(cap, room / b)
        return max(int(cap), 0) if room > 0.0 else 0

    def seq_cap(self, num_running: int) -> int:
        """The most sequences that may run (admission stops at this many)."""
        if not self.ready:
            return num_running + 1
        if self.last_seconds > self.target:
            return num_running          # the last step ran over: admit nothing until the fit catches up
        a, b, c = self.model.coef
        room = (1.0 - self.PREFILL_SHARE) * (self._headroom() - a)
        cap = self.GROWTH * max(self.max_seqs_seen, 1)
        if b + c > 0.0:
            cap = min(cap, room / (b + c))      # a decode step of `cap` sequences: tokens == seqs
        return max(int(cap), 0) if room > 0.0 else 0
