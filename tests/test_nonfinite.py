"""A non-finite value in a cached map stops training with an error naming the batch's sentences and the cache
entry, even when the entry's checksums were fixed up to match (so only the value check can catch it); a run
never ends with non-finite metrics."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from hydra.utils import instantiate

from probes.extract import cache as C
from probes.extract.attention_caches import ensure_caches
from probes.train import NonFiniteMetricsError, _fit_and_test, train
from probes.training.module import NonFiniteInputError
from tests.conftest import chain_overrides, compose_train


def _poison(entry, sentence: int, element: int = 10, count: int = 3) -> None:
    """Overwrite ``count`` float16 values of ``sentence``'s maps from ``element`` on with NaN and write the shard's
    new CRC-32 into the manifest, as if the damage had been there when the entry was written."""
    manifest = json.loads((entry / "manifest.json").read_text())
    shard = manifest["shards"][0]
    idx = np.load(entry / C.index_name(shard))  # (n, 3): sentence, offset (values), side
    offset = int(idx[idx[:, 0] == sentence][0, 1])
    data = bytearray((entry / shard).read_bytes())
    nan = np.array([np.nan] * count, dtype=np.float16).tobytes()
    data[2 * (offset + element): 2 * (offset + element) + len(nan)] = nan
    (entry / shard).write_bytes(bytes(data))
    manifest["checksums"][shard]["crc32"] = f"{zlib.crc32(bytes(data)):08x}"
    (entry / "manifest.json").write_text(json.dumps(manifest))


def _poisoned_run(chain_data, tmp_path, workers: int, **poison):
    """A one-epoch attn_only run on the chain data whose train entry has NaN in sentence 7 (checksums fixed up)."""
    cfg = compose_train(chain_overrides(chain_data, tmp_path) + ["probe=attn_only", "trainer.max_epochs=1",
                                                                 f"data.num_workers={workers}"])
    caches = ensure_caches(cfg.encoder, instantiate(cfg.data.treebank), ["train"], cfg.extract,
                           cfg.paths.cache_dir, child=False)
    entry = caches["train"].path
    _poison(entry, sentence=7, **poison)
    C._VERIFIED.clear()
    assert C.verify(entry, force=True)  # the checksums pass: only the values are wrong
    with pytest.raises(NonFiniteInputError) as e:
        train(cfg)
    assert not (tmp_path / "out" / "metrics.json").exists()
    return str(e.value), entry


@pytest.mark.parametrize("workers", [0, 1])  # 1: the maps are checked in the loader's worker process
def test_a_nan_in_a_cached_map_stops_training_naming_sentence_and_entry(chain_data, tmp_path, workers):
    msg, entry = _poisoned_run(chain_data, tmp_path, workers)
    assert "train batch" in msg and "of epoch 0" in msg and "items [7]" in msg
    assert "6 non-finite values (NaN/inf) in 'feats'" in msg  # each word-pair value is in feats twice (j->i, i->j)
    assert str(entry) in msg and "rebuilt by" in msg


def test_a_nan_the_features_leave_out_still_stops_training(chain_data, tmp_path):
    """[CLS] -> [CLS] (the first value of a map) is in no feature: the maps as read are checked, not the batch."""
    msg, entry = _poisoned_run(chain_data, tmp_path, 0, element=0, count=1)
    assert "items [7]" in msg and "1 non-finite values" in msg and "the data read" in msg and str(entry) in msg


class _Trainer:
    """What :func:`probes.train._fit_and_test` reads of a Trainer whose validation gave NaN."""
    checkpoint_callback, world_size, is_global_zero = None, 1, True

    def validate(self, model, datamodule):
        return [{"val/uas": float("nan"), "val/loss": 1.0}]


class _Model:
    def trainable(self):
        return False


def test_non_finite_metrics_are_an_error_and_no_metrics_json(chain_data, tmp_path):
    cfg = compose_train(chain_overrides(chain_data, tmp_path) + ["test=false"])
    with pytest.raises(NonFiniteMetricsError, match=r"non-finite metrics \{'val/uas': nan\}"):
        _fit_and_test(cfg, object(), _Model(), _Trainer(), [], tmp_path / "out")
    assert not (tmp_path / "out" / "metrics.json").exists()
