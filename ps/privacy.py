"""The privacy budget of a federation with client-level differential privacy, from an accountant.

Each round the server adds Gaussian noise of standard deviation
``noise_multiplier x clipping_norm`` to the sum of the clipped client updates
(Flower's DP wrappers do the clipping and the noise). Which clients take part is
a Poisson sample of rate ``sampling_rate``. Google's ``dp-accounting`` RDP
accountant turns that into the epsilon spent after each round at a given delta.
"""

from __future__ import annotations

import dataclasses
import logging


@dataclasses.dataclass
class DPSettings:
    """Client-level differential privacy of a federation (``--dp.*``)."""

    noise_multiplier: float = 0.0
    """Each client clips its update to --dp.clipping-norm and the server adds Gaussian noise of this many
    clipping norms to their sum (0: off, unless a budget alone is given). Epsilon is in every round's metrics and
    in the run record."""
    clipping_norm: float = 1.0
    """L2 norm each client's update (its weights minus the global ones) is clipped to."""
    delta: float = 1e-5
    """Delta at which the accountant states epsilon."""
    target_epsilon: float | None = None
    """Privacy budget. With --dp.noise-multiplier, the federation stops after the last round whose epsilon stays
    within it, and says so; alone, the noise is the least that spends it over --rounds."""
    sample_noise_multiplier: float = 0.0
    """Sample-level differential privacy, on top of or instead of the client level: every client trains with
    DP-SGD through Opacus, adding Gaussian noise of this many --dp.sample-clipping-norm to each step's clipped
    per-clip gradients (0: off). Each client's epsilon at --dp.delta is in the round metrics and run record."""
    sample_clipping_norm: float = 1.0
    """L2 norm each clip's gradient is clipped to in DP-SGD."""

    def problem(self) -> str | None:
        """What is wrong with these settings, in one line (None: nothing)."""
        if self.noise_multiplier < 0 or self.clipping_norm <= 0 or not 0 < self.delta < 1:
            return "--dp.noise-multiplier must be 0 or more, --dp.clipping-norm positive, --dp.delta in (0, 1)"
        if self.sample_noise_multiplier < 0 or self.sample_clipping_norm <= 0:
            return "--dp.sample-noise-multiplier must be 0 or more and --dp.sample-clipping-norm positive"
        if self.target_epsilon is not None and self.target_epsilon <= 0:
            return f"--dp.target-epsilon {self.target_epsilon}: give a positive budget"
        return None

    def noise_for(self, sampling_rate: float, rounds: int) -> float:
        """The noise multiplier: the one given, or, with only a budget, the least that spends it over ``rounds``."""
        if self.noise_multiplier > 0 or self.target_epsilon is None:
            return self.noise_multiplier
        return calibrate(self.target_epsilon, sampling_rate, rounds, self.delta)


class _Unconverged(logging.Filter):
    """The accountant leaves out a fractional order whose series does not converge and logs it, five lines a
    call: a federation's log (a call a round) would be mostly these."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


_QUIETED = _Unconverged()


def epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """Epsilon after ``rounds`` rounds at ``delta`` (infinite without noise)."""
    import dp_accounting
    from absl import logging as absl_logging
    from dp_accounting.rdp import rdp_privacy_accountant

    absl_logging.get_absl_logger().addFilter(_QUIETED)  # absl's own logger, once absl made it (a set: added once)

    if noise_multiplier <= 0:
        return float("inf")
    if rounds <= 0:
        return 0.0
    event = dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return float(accountant.get_epsilon(delta))


def rounds_within(target: float, noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> int:
    """The most rounds, up to ``rounds``, whose epsilon stays within ``target``.

    Bisection: epsilon only grows with the rounds, and each accountant call costs tens of milliseconds, so a scan
    of 1000 rounds took over a minute at every start.
    """
    if epsilon(noise_multiplier, sampling_rate, rounds, delta) <= target:
        return rounds
    low, high = 0, rounds  # within at low (0: none), beyond at high
    while high - low > 1:
        middle = (low + high) // 2
        if epsilon(noise_multiplier, sampling_rate, middle, delta) <= target:
            low = middle
        else:
            high = middle
    return low


def calibrate(target: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """The smallest noise multiplier (to 0.1%) whose epsilon after ``rounds`` rounds stays within ``target``.

    Bisection on the accountant, as Opacus's get_noise_multiplier does; epsilon falls as the noise grows.
    """
    low, high = 0.0, 1.0
    while epsilon(high, sampling_rate, rounds, delta) > target:
        low, high = high, high * 2
        if high > 1e4:
            raise ValueError(f"no noise multiplier up to 1e4 keeps {rounds} rounds within epsilon {target}")
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if epsilon(middle, sampling_rate, rounds, delta) > target else (low, middle)
    return high
