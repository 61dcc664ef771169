"""The privacy budget of a federation with client-level differential privacy, from an accountant.

Each round the server adds Gaussian noise of standard deviation
``noise_multiplier x clipping_norm`` to the sum of the clipped client updates
(Flower's DP wrappers do the clipping and the noise). Which clients take part is
a Poisson sample of rate ``sampling_rate``. Google's ``dp-accounting`` RDP
accountant turns that into the epsilon spent after each round at a given delta.
"""

from __future__ import annotations


def epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """Epsilon after ``rounds`` rounds at ``delta`` (infinite without noise)."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    if noise_multiplier <= 0:
        return float("inf")
    if rounds <= 0:
        return 0.0
    event = dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return float(accountant.get_epsilon(delta))


def rounds_within(target: float, noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> int:
    """The most rounds, up to ``rounds``, whose epsilon stays within ``target``."""
    within = 0
    for r in range(1, rounds + 1):
        if epsilon(noise_multiplier, sampling_rate, r, delta) > target:
            break
        within = r
    return within
