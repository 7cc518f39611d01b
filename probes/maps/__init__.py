"""From sentences to maps, one way for every caller: the extraction stage, the public API and the analyses.

:class:`MapEngine` holds a frozen model, a map kind (:mod:`probes.measures`; attention is one of them), the chosen
layers, the word pooling and the batch budget, and turns already encoded sentences
(:class:`probes.model.inputs.Encoded`) into piece maps or word maps, batch by batch. :mod:`probes.maps.batches`
makes the batches: encoding in chunks, the long-sentence policy, length batches bounded in pieces and attention
pairs, the pooling matrices of a padded batch, and building the next batch in a background thread on a GPU;
:mod:`probes.maps.timing` records where an extraction's time goes. Long texts: a batch whose whole maps exceed
``extract.attention_budget_mb`` is computed in blocks of query rows, each block reduced at once by
:mod:`probes.maps.reducers` (word maps, coarser units, head statistics).

Layer: above :mod:`probes.measures` and :mod:`probes.model`, below :mod:`probes.extract`, :mod:`probes.api` and
:mod:`probes.analysis`.
"""

from probes.maps.batches import (SentenceBatches, encode_all, make_batch, pinned, pooling_matrices, prefetched, select,
                                 split_by_pairs)
from probes.maps.engine import MapEngine, MapMemoryError, pad_id_of, pool_layers
from probes.maps.reducers import HeadDistances, HeadStats, Pool, Reducer, Several

__all__ = ["HeadDistances", "HeadStats", "MapEngine", "MapMemoryError", "Pool", "Reducer", "SentenceBatches",
           "Several", "encode_all", "make_batch", "pad_id_of", "pinned", "pool_layers", "pooling_matrices",
           "prefetched", "select", "split_by_pairs"]
