"""Stage 2 of :mod:`probes.analysis.kovaleva.linguistic_attention`: the tables of a
:class:`~.scoring.LinguisticResult` (no file written)."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from probes.analysis.kovaleva.linguistic_attention.scoring import LinguisticResult
from probes.analysis.naming import head_name
from probes.analysis.tables import layer_head_frame


@dataclass
class LinguisticTables:
    """The analysis's tables (``<name>.csv``)."""

    attention: pd.DataFrame         # linguistic_attention
    cls_last_layer: pd.DataFrame
    token_to_token: pd.DataFrame
    change: pd.DataFrame            # linguistic_change


def _frames(parts: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    """The per-(layer, head) tables of :func:`~probes.analysis.tables.layer_head_frame` as one, in ``columns`` order."""
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)


def tables(result: LinguisticResult) -> LinguisticTables:
    """The four tables of ``result`` (see the package doc for their columns)."""
    rows, crows, trows = [], [], []
    for run in result.runs:
        acc, racc = run.kinds, run.relations
        for f, m in run.kind_means().items():
            L, H = m.shape
            rows.append(layer_head_frame(dict(value=m), source=run.source, model=run.model, feature=f,
                                         n_examples=acc.count[f]))
            c = acc.cls_mean(f)  # (L, H) or None
            if c is not None:
                last, nc = L - 1, len(acc.cls_per_example(f))
                for h in range(H):
                    crows.append(dict(source=run.source, model=run.model, feature=f, layer=last, head=h,
                                      name=head_name(last, h), value=float(c[last, h]), n_examples=nc))
                crows.append(dict(source=run.source, model=run.model, feature=f, layer=last, head=-1,
                                  name=f"{last + 1}-mean", value=float(c[last].mean()), n_examples=nc))
        n_pair = run.n_with_pair()
        for r, m in run.relation_means().items():
            trows.append(layer_head_frame(dict(value=m), source=run.source, model=run.model, relation=r,
                                          n_examples=racc.count[r], n_with_pair=n_pair[r]))
    return LinguisticTables(
        attention=_frames(rows, ["source", "model", "feature", "layer", "head", "name", "value", "n_examples"]),
        cls_last_layer=pd.DataFrame(crows),
        token_to_token=_frames(trows, ["source", "model", "relation", "layer", "head", "name", "value", "n_examples",
                                       "n_with_pair"]),
        change=pd.DataFrame(result.changes, columns=["source", "kind", "type", "statistic", "pretrained", "finetuned",
                                                     "diff", "lo", "hi", "change", "n_examples"]))
