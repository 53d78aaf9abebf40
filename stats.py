"""Statistics of eval.py: a number and its standard error, as a {"value", "se"} dict, clustered by prompt (or by
record); pass@k and the pair outcomes. Pure functions, imported by tests (through eval.py too)."""

import math
from collections import Counter


def ratio_mean(numerator: list, denominator: list, cluster: list) -> dict:
    """R = Σ numerator / Σ denominator and its cluster-robust standard error (linearisation): with the clusters' totals
    A_c, B_c, se² = C/(C-1) · Σ_c (A_c - R·B_c)² / (Σ B)² over the C clusters. A plain mean has denominator 1: one
    sample per cluster gives std(ddof=1)/sqrt(n), equal cluster sizes the same over the cluster means. value is None
    when Σ denominator is 0, se when there are fewer than two clusters."""
    numerator_totals = Counter()
    denominator_totals = Counter()
    for top, bottom, key in zip(numerator, denominator, cluster):
        numerator_totals[key] += top
        denominator_totals[key] += bottom
    denominator_sum = sum(denominator_totals.values())
    if denominator_sum == 0:
        return {"value": None, "se": None}
    ratio = sum(numerator_totals.values()) / denominator_sum
    num_clusters = len(numerator_totals)
    if num_clusters < 2:
        return {"value": ratio, "se": None}
    residuals = [numerator_totals[key] - ratio * denominator_totals[key] for key in numerator_totals]
    variance = num_clusters / (num_clusters - 1) * sum(r * r for r in residuals) / denominator_sum**2
    return {"value": ratio, "se": math.sqrt(variance)}


def mean_se(values: list, cluster: list) -> dict:
    """The mean of per-sample values and its standard error, clustered (ratio_mean with denominator 1)."""
    return ratio_mean(values, [1] * len(values), cluster)


def perplexity_se(logprob_sums: list, lengths: list, cluster: list) -> dict:
    """exp(Σ nll / Σ tokens) over all responses; se by the delta method on the clustered ratio's se."""
    nll = ratio_mean([-x for x in logprob_sums], lengths, cluster)
    if nll["value"] is None:
        return nll
    perplexity = math.exp(nll["value"])
    return {"value": perplexity, "se": None if nll["se"] is None else perplexity * nll["se"]}


def distinct_n(responses: list, n: int = 2) -> float:
    """Unique n-grams / all n-grams over all responses (token id lists); 0 when there are none."""
    grams = [tuple(r[i : i + n]) for r in responses for i in range(len(r) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def distinct_n_se(responses: list, cluster: list, n: int = 2) -> dict:
    """distinct_n and its delete-one-cluster jackknife standard error: leaving cluster c out removes its n-grams from
    the total and, from the unique ones, those no other cluster has; se² = (C-1)/C · Σ_c (θ_-c - mean θ_-c)²."""
    grams_of = {}
    for response, key in zip(responses, cluster):
        grams_of.setdefault(key, []).extend(tuple(response[i : i + n]) for i in range(len(response) - n + 1))
    clusters_with = Counter(gram for grams in grams_of.values() for gram in set(grams))
    num_unique = len(clusters_with)
    num_grams = sum(len(grams) for grams in grams_of.values())
    value = num_unique / num_grams if num_grams else 0.0
    num_clusters = len(grams_of)
    if num_clusters < 2:
        return {"value": value, "se": None}
    leave_out = []
    for grams in grams_of.values():
        only_here = sum(1 for gram in set(grams) if clusters_with[gram] == 1)
        grams_left = num_grams - len(grams)
        leave_out.append((num_unique - only_here) / grams_left if grams_left else 0.0)
    leave_out_mean = sum(leave_out) / num_clusters
    variance = (num_clusters - 1) / num_clusters * sum((x - leave_out_mean) ** 2 for x in leave_out)
    return {"value": value, "se": math.sqrt(variance)}


def win_outcomes(gold: list, ref_gold: list) -> list:
    """Per sample: 1 if the policy's gold beats the reference's on the same prompt and seed, 0.5 on a tie, else 0."""
    return [1.0 if g > r else 0.5 if g == r else 0.0 for g, r in zip(gold, ref_gold)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with c right among n samples, 1 - C(n-c, k)/C(n, k) (Chen et al. 2021), as
    1 - prod_{i=n-c+1}^{n} (1 - k/i): no binomial coefficient overflows. Needs 1 <= k <= n and 0 <= c <= n."""
    # k > n has no k-subset to count: an error, not the 1.0 of the branch below
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass@{k} of {c} right among {n} samples: needs 1 <= k <= n and 0 <= c <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pair_outcomes(gaps: list) -> list:
    """Per pair: 1 if the chosen response scores higher, 0.5 on a tie, else 0."""
    return [1.0 if gap > 0 else 0.5 if gap == 0 else 0.0 for gap in gaps]


def weighted_mean_se(values: list, weights: list, cluster: list) -> dict:
    """Σ w·x / Σ w with its standard error clustered by record (ratio_mean)."""
    return ratio_mean([w * x for w, x in zip(weights, values)], weights, cluster)
