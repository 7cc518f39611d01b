"""Attention analyses: Clark et al. 2019 (sections 3-5), Kovaleva et al. 2019, Westera 2019, Pascual et al. 2021.

Run with ``python -m probes.analyze analysis=<name>``; one module per analysis:

* :mod:`probes.analysis.clark.head_stats` - surface statistics per head (Clark §3, Figs 1, 2, 4), wordpiece level.
* :mod:`probes.analysis.clark.dep_heads` - dependency relations per head vs fixed-offset baselines
  (Clark §4.1, Table 1), word level from the attention cache.
* :mod:`probes.analysis.clark.clustering` - Jensen-Shannon distances between heads and their 2-D MDS
  embedding (Clark §5, Fig 6), wordpiece level.
* :mod:`probes.analysis.clark.coref_heads` - antecedent selection per head vs nearest / head-match / rule-based
  baselines (Clark §4.2, Table 2), word level from a cache of document segments.
* :mod:`probes.analysis.clark.grad_sep` - gradient of a configured loss w.r.t. attention to [SEP] vs
  punctuation vs other tokens, per layer (Clark §3, Fig 3).
* :mod:`probes.analysis.westera.flow` / :mod:`probes.analysis.westera.flow_correlates` - gradient flow G, G* vs
  attention A and its linguistic correlates (Westera 2019).
* :mod:`probes.analysis.pascual.attribution` - gradient attribution of head outputs vs attention (Pascual et al. 2021).
* :mod:`probes.analysis.kovaleva.finetune_cosine`, :mod:`probes.analysis.kovaleva.disable_heads`,
  :mod:`probes.analysis.kovaleva.pattern_types`, :mod:`probes.analysis.kovaleva.linguistic_attention` - Kovaleva et al. 2019.
* :mod:`probes.analysis.beyond.sink` - Gu et al. 2024's attention-sink metric: per head, the mean attention to
  the first token on 64-piece windows of running text, and the share of heads above a threshold.

Conventions: every file (CSV, JSON) uses **0-based** ``layer`` and ``head`` columns; figures and
the ``name`` columns use the paper's **1-based** ``layer-head`` names (``8-10`` is layer index 7,
head index 9). Attention maps are ``(L, H, T, T)`` with rows = attending (from) position and
columns = attended (to) position; rows sum to 1. Pure computations live in
:mod:`probes.analysis.clark.metrics` and take plain tensors, so tests can feed synthetic attention.
"""

from probes.analysis.naming import head_name

__all__ = ["head_name"]
