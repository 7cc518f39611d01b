import numpy as np
import pytest

from probes.analysis.tables import layer_head_frame


def test_layer_head_frame_is_tidy_with_both_namings():
    m = np.arange(6).reshape(2, 3) / 10
    df = layer_head_frame({"cosine": m, "n": np.full((2, 3), 4)}, task="mrpc")
    assert list(df.columns) == ["layer", "head", "name", "task", "cosine", "n"]
    row = df[(df["layer"] == 1) & (df["head"] == 2)].iloc[0]
    assert row["name"] == "2-3" and row["cosine"] == pytest.approx(0.5) and row["task"] == "mrpc"
    with pytest.raises(ValueError, match="shape"):
        layer_head_frame({"a": m, "b": np.zeros((3, 2))})
