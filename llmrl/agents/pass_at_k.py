"""pass@k evaluation.

The unbiased estimator of Chen et al., "Evaluating Large Language Models Trained on Code" (2021):
with n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k). The ratio of binomials is
evaluated as a running product, prod_{i=n-c+1}^{n} (1 - k/i), which never forms the (huge) binomial
coefficients and so stays exact to float precision for any n.
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n is correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    failure = 1.0
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure
