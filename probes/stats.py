"""Statistics of the package, one implementation each: entropy, Jensen-Shannon divergence (in bits, base 2,
in [0, 1], everywhere), Spearman rank correlation, top-1 agreement, OLS with clustered errors, bootstrap
resampling and the seeding of the global random generators.

Distributions lie along the last axis; maps are (..., T, T) with rows = attending position. This module imports
no other module of the package, so that every layer may use it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from scipy import special, stats
from scipy.stats import rankdata

LN2 = float(np.log(2.0))


def entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Shannon entropy (nats) along ``dim``; 0 log 0 = 0."""
    return -torch.special.xlogy(p, p).sum(dim)


def js_divergence_matrix(attn: torch.Tensor, max_elements: int = 2 ** 24,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pairwise Jensen-Shannon divergence between heads, summed over the attending tokens.

    attn: (K, T, T) rows are distributions. Returns (K, K) float64, symmetric, zero diagonal:
    D[a, b] = sum_t JS(attn[a, t], attn[b, t]), JS(P, Q) = H((P + Q) / 2) - (H(P) + H(Q)) / 2, in bits (entropies in nats / ln 2).
    Only pairs a <= b are computed (in ``dtype``), in chunks of heads so that at most
    ``max_elements`` values are held at once; identical heads give exactly 0.
    """
    attn = attn.to(dtype)
    K, T, _ = attn.shape
    h_rows = entropy(attn).sum(-1)  # (K,) sum over tokens of row entropies
    out = torch.zeros(K, K, dtype=torch.float64, device=attn.device)
    chunk = max(1, max_elements // max(K * T * T, 1))
    for s in range(0, K, chunk):
        e = min(s + chunk, K)
        p = attn[s:e, None]  # (c, 1, T, T)
        m = (p + attn[None, s:]) / 2  # (c, K - s, T, T): pairs with b >= s
        h_m = entropy(m).sum(-1)  # (c, K - s)
        out[s:e, s:] = (h_m - (h_rows[s:e, None] + h_rows[None, s:]) / 2).double()
    out = torch.triu(out).clamp_min(0)
    out = out + out.T
    out.fill_diagonal_(0)
    return out / LN2


def js_divergence(p: torch.Tensor | np.ndarray, q: torch.Tensor | np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Jensen-Shannon divergence (base 2, in [0, 1]) between distributions along the last axis."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    p = p / p.sum(-1, keepdims=True)
    q = q / q.sum(-1, keepdims=True)
    m = 0.5 * (p + q)

    def kl(a, b):
        return np.where(a > 0, a * (np.log2(np.maximum(a, eps)) - np.log2(np.maximum(b, eps))), 0.0).sum(-1)

    return np.clip(0.5 * kl(p, m) + 0.5 * kl(q, m), 0.0, 1.0)


def _rank(a: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank) along the last axis."""
    return rankdata(a, axis=-1, method="average")


def spearman_rows(a, b) -> np.ndarray:
    """Spearman rank correlation of ``a`` and ``b`` along the last axis (NaN where one row is constant)."""
    ra, rb = _rank(np.asarray(a, dtype=np.float64)), _rank(np.asarray(b, dtype=np.float64))
    ra = ra - ra.mean(-1, keepdims=True)
    rb = rb - rb.mean(-1, keepdims=True)
    den = np.sqrt((ra ** 2).sum(-1) * (rb ** 2).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ra * rb).sum(-1) / np.where(den > 0, den, 1.0), np.nan)


def spearman_test(x, y) -> tuple[float, float]:
    """Spearman's rho of two 1-D samples (:func:`spearman_rows`) and its two-sided p-value (Student t with
    n - 2 degrees of freedom, as :func:`scipy.stats.spearmanr`); NaN, NaN where rho is undefined."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)  # (n,)
    rho = float(spearman_rows(x, y))
    dof = len(x) - 2
    with np.errstate(divide="ignore", invalid="ignore"):
        t = rho * np.sqrt(np.clip(dof / ((rho + 1.0) * (1.0 - rho)), 0, None))
    return rho, float(2 * special.stdtr(dof, -np.abs(t)))


def top1_agreement(a, b) -> np.ndarray:
    """1.0 where the argmax of ``a`` and ``b`` along the last axis coincide, else 0.0."""
    return (np.asarray(a).argmax(-1) == np.asarray(b).argmax(-1)).astype(np.float64)


def ols(y: np.ndarray, X: np.ndarray, names: Sequence[str], groups: np.ndarray | None = None) -> list[dict]:
    """OLS of ``y`` on ``[1, X]`` with classical and (if ``groups``) cluster-robust (CR1) standard errors.

    Returns one dict per coefficient (intercept first): ``term, coef, se, t, p`` (classical, Student t
    with n - k df) and ``se_cluster, z_cluster, p_cluster`` (CR1 sandwich by group, normal p-values),
    plus ``n`` and ``n_groups``. Pure numpy/scipy (statsmodels is not a dependency).
    """
    y = np.asarray(y, dtype=np.float64)
    X = np.column_stack([np.ones(len(y)), np.asarray(X, dtype=np.float64).reshape(len(y), -1)])
    n, k = X.shape
    XtX_inv = np.linalg.pinv(X.T @ X)
    beta = XtX_inv @ X.T @ y
    resid = y - X @ beta
    dof = max(n - k, 1)
    sigma2 = resid @ resid / dof
    se = np.sqrt(np.maximum(np.diag(XtX_inv) * sigma2, 0))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = beta / se
    p = 2 * stats.t.sf(np.abs(t), dof)
    se_c = z_c = p_c = np.full(k, np.nan)
    n_groups = None
    if groups is not None:
        groups = np.asarray(groups)
        uniq, inv = np.unique(groups, return_inverse=True)
        n_groups = len(uniq)
        if n_groups > 1:
            scores = np.zeros((n_groups, k))
            np.add.at(scores, inv, X * resid[:, None])
            meat = scores.T @ scores
            c = n_groups / (n_groups - 1) * (n - 1) / dof
            V = c * XtX_inv @ meat @ XtX_inv
            se_c = np.sqrt(np.maximum(np.diag(V), 0))
            with np.errstate(divide="ignore", invalid="ignore"):
                z_c = beta / se_c
            p_c = 2 * stats.norm.sf(np.abs(z_c))
    names = ["intercept", *names]
    return [dict(term=names[i], coef=float(beta[i]), se=float(se[i]), t=float(t[i]), p=float(p[i]),
                 se_cluster=float(se_c[i]), z_cluster=float(z_c[i]), p_cluster=float(p_c[i]), n=int(n),
                 n_groups=n_groups) for i in range(k)]


def resamples(n: int, n_boot: int, rng: np.random.Generator, chunk: int = 1) -> Iterator[np.ndarray]:
    """The bootstrap's resamples of ``n`` examples (drawn with replacement), ``chunk`` resamples at a time.

    Args:
        n: The number of examples.
        n_boot: The number of resamples in all.
        rng: The generator they are drawn from, a block at a time as they are consumed (a caller may draw
            from it between blocks).
        chunk: Resamples per block.

    Returns:
        An iterator of (c, n) example indices, c <= ``chunk``, ``n_boot`` rows in all.
    """
    for s in range(0, n_boot, chunk):
        yield rng.integers(0, n, size=(min(chunk, n_boot - s), n))  # (c, n)


def bootstrap_mean(values, n_boot: int = 1000, seed: int = 0, level: float = 0.95, chunk: int = 100
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean over examples and its percentile-bootstrap interval, per column, NaN left out.

    values: (N, K) (or (N,)), one row per example. Examples are resampled with replacement (the same
    resamples for every column, ``n_boot`` of them, seeded). Returns ``(mean, lo, hi, n)`` each (K,)
    (n = the non-NaN examples of the column; a column without any is NaN)."""
    v = np.asarray(values, dtype=np.float64)
    v = v.reshape(len(v), -1)  # (N, K)
    N, K = v.shape
    ok = ~np.isnan(v)
    n = ok.sum(0)
    filled = np.where(ok, v, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = filled.sum(0) / n
    if N == 0:
        nan = np.full(K, np.nan)
        return mean, nan, nan, n
    boots = np.empty((n_boot, K))
    s = 0
    for idx in resamples(N, n_boot, np.random.default_rng(seed), chunk):  # (c, N)
        with np.errstate(invalid="ignore", divide="ignore"):
            boots[s:s + len(idx)] = filled[idx].sum(1) / ok[idx].sum(1)
        s += len(idx)
    a = (1 - level) / 2
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: NaN interval
        lo, hi = np.nanquantile(boots, a, axis=0), np.nanquantile(boots, 1 - a, axis=0)
    return mean, lo, hi, n


def seed_everything(seed: int, workers: bool = False) -> int:
    """Seed Python's, numpy's and torch's global generators (Lightning's ``seed_everything``, which also sets
    ``PL_GLOBAL_SEED`` for spawned processes).

    Args:
        seed: The seed.
        workers: Also seed each dataloader worker of a Lightning Trainer from it (``PL_SEED_WORKERS``).

    Returns:
        The seed.
    """
    return pl.seed_everything(seed, workers=workers)
