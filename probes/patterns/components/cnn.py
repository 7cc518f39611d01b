"""Kovaleva et al. 2019 §3: a small CNN that classifies one self-attention map into five pattern types.

Preprocessing (:func:`preprocess`, shared by training, ``classify`` and ``analysis=pattern_types``):

1. the square map (rows = from/query, columns = to/key) is scaled by its own maximum, as the
   labelling guide displays the maps (so a map's absolute level, which shrinks with its length
   because rows sum to 1, does not matter; all-zero maps stay zero);
2. it is resized to ``size x size`` with **area interpolation** (``F.interpolate(mode="area")`` =
   adaptive average pooling). Why area: the labelled maps are 12-64 wordpieces long, so with the
   default 32 a map is either shrunk (at most 2x) or enlarged. Shrinking by averaging keeps every
   one-token column and the one-token diagonal as a (fainter) line, where bilinear sampling at
   stride 2 can skip a column entirely; enlarging with area is block replication (crisp lines,
   no blur that would make a diagonal look like a band). 32 is near the median map length;
3. optional extra channels: ``sqrt`` (square root of the scaled map: lifts faint diagonals under a
   dominant column, the vertical vs vertical+diagonal distinction of the guide).

The network: ``len(channels)`` input channels, three conv(3x3)-BatchNorm-ReLU-maxpool(2) blocks
(widths ``widths``), flatten (positions matter: column 0 = [CLS], the main diagonal), dropout, a
hidden linear layer and a linear layer to the classes. Not global pooling: where a stripe sits is
part of the pattern.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

CLASSES = ("vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous")
RESIZE_MODES = ("area", "bilinear", "nearest")
CHANNELS = ("max", "sqrt")


def check_map(a, where: str = "map") -> np.ndarray:
    """The map as a 2-D float32 array; ValueError naming ``where`` if it is empty, not square or not finite."""
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"{where}: expected a square 2-D array, got shape {tuple(a.shape)}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"{where}: empty array of shape {tuple(a.shape)}")
    if a.shape[0] != a.shape[1]:
        raise ValueError(f"{where}: not square, shape {tuple(a.shape)}")
    if not np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.complexfloating):
        raise ValueError(f"{where}: expected real numbers, got dtype {a.dtype}")
    a = a.astype(np.float32)
    if not np.isfinite(a).all():
        raise ValueError(f"{where}: contains NaN or infinite values")
    return a


def preprocess(maps: torch.Tensor | np.ndarray, size: int = 32, resize: str = "area",
               channels: Sequence[str] = ("max",)) -> torch.Tensor:
    """One (T, T) map or a batch (B, T, T) of equal-size maps -> (B, C, size, size) float32."""
    x = torch.as_tensor(np.asarray(maps) if not isinstance(maps, torch.Tensor) else maps).float()
    if x.dim() == 2:
        x = x[None]
    if x.dim() != 3 or x.shape[-1] != x.shape[-2] or x.shape[-1] == 0:
        raise ValueError(f"expected (T, T) or (B, T, T) maps, got {tuple(x.shape)}")
    if resize not in RESIZE_MODES:
        raise ValueError(f"resize must be one of {RESIZE_MODES}, got {resize!r}")
    _check_channels(channels)
    peak = x.flatten(1).amax(1).clamp_min(1e-12)[:, None, None]
    x = (x / peak).clamp_min(0.0)[:, None]  # (B, 1, T, T) in [0, 1]
    if resize == "bilinear":
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    else:
        x = F.interpolate(x, size=(size, size), mode=resize)
    return _with_channels(x, channels)


def _check_channels(channels: Sequence[str]) -> None:
    unknown = [c for c in channels if c not in CHANNELS]
    if unknown:
        raise ValueError(f"unknown channel {unknown[0]!r}; expected one of {CHANNELS}")


def _with_channels(x: torch.Tensor, channels: Sequence[str]) -> torch.Tensor:
    """(N, 1, S, S) scaled and resized maps -> (N, C, S, S), the ``channels`` of each (the one ``max`` channel: x
    itself, no copy)."""
    if tuple(channels) == ("max",):
        return x
    return torch.cat([x if c == "max" else x.clamp_min(0).sqrt() for c in channels], 1)


def area_matrix(n: torch.Tensor, T: int, size: int) -> torch.Tensor:
    """(M, size, T) the rows of area interpolation (``F.interpolate(mode="area")``, adaptive average pooling) of a
    length n_m to ``size`` as a matrix: row i averages the positions ``floor(i n / size) .. ceil((i + 1) n / size)
    - 1``; the columns n_m .. T - 1 (padding) are zero. n: (M,) long, 1 <= n_m <= T."""
    i = torch.arange(size, device=n.device)  # (size,)
    start = (i[None] * n[:, None]) // size  # (M, size)
    end = ((i[None] + 1) * n[:, None] + size - 1) // size  # (M, size)
    t = torch.arange(T, device=n.device)  # (T,)
    inside = (t[None, None] >= start[..., None]) & (t[None, None] < end[..., None])  # (M, size, T)
    return inside.float() / (end - start).float()[..., None]


def nearest_matrix(n: torch.Tensor, T: int, size: int) -> torch.Tensor:
    """(M, size, T) nearest interpolation (``mode="nearest"``: row i takes position ``floor(i * (n / size))``, in
    float32 as torch computes it) as a matrix; the columns n_m .. T - 1 (padding) are zero."""
    i = torch.arange(size, device=n.device, dtype=torch.float32)  # (size,)
    src = (i[None] * (n.float() / size)[:, None]).floor().long().minimum(n[:, None] - 1)  # (M, size)
    return F.one_hot(src, T).float()


# resize modes that are one matrix per length (a map of n pieces resized is R X R^T, R (size, n)): maps of
# different lengths padded into one tensor are resized at once (:func:`preprocess_padded`)
RESIZE_MATRICES = {"area": area_matrix, "nearest": nearest_matrix}


def preprocess_padded(maps: torch.Tensor, lengths: torch.Tensor, size: int = 32, resize: str = "area",
                      channels: Sequence[str] = ("max",)) -> torch.Tensor:
    """Padded maps of different lengths at once, as :func:`preprocess` of each map cut to its length (to the rounding
    of the resize's sums, ~1e-7): maps (B, K, T, T), item b's K maps real in ``[:lengths[b], :lengths[b]]`` (the
    rest ignored, non-finite values included) -> (B K, C, size, size) float32, on the maps' device. Each map scaled
    by its largest real entry and clamped at 0, then resized by the matrix of its length (``R X R^T``,
    :data:`RESIZE_MATRICES`: area and nearest; ValueError for another mode: resize such maps by length with
    :func:`preprocess`)."""
    if maps.dim() != 4 or maps.shape[-1] != maps.shape[-2] or maps.shape[-1] == 0:
        raise ValueError(f"expected (B, K, T, T) maps, got {tuple(maps.shape)}")
    if resize not in RESIZE_MATRICES:
        raise ValueError(f"resize {resize!r} is not one matrix per length; padded maps need one of "
                         f"{tuple(RESIZE_MATRICES)} (or preprocess() on the maps of each length)")
    _check_channels(channels)
    B, K, T, _ = maps.shape
    n = torch.as_tensor(lengths, device=maps.device).long()  # (B,)
    if n.shape != (B,) or bool(((n < 1) | (n > T)).any()):
        raise ValueError(f"lengths: expected {B} values in 1..{T}, got {n.tolist()}")
    real = torch.arange(T, device=maps.device)[None] < n[:, None]  # (B, T)
    x = torch.where((real[:, :, None] & real[:, None, :])[:, None], maps.float(), 0.0)  # (B, K, T, T)
    peak = x.flatten(2).amax(2).clamp_min(1e-12)[:, :, None, None]  # (B, K, 1, 1) each map's largest real entry
    x = x.div_(peak).clamp_min_(0.0)  # (B, K, T, T) in [0, 1], padding 0
    R = RESIZE_MATRICES[resize](n, T, size)  # (B, size, T)
    # two products with B large matrices each (not B K small ones): the keys, then the queries of all K maps at once
    y = torch.bmm(x.view(B, K * T, T), R.transpose(1, 2))  # (B, K T, size) = X R^T
    y = y.view(B, K, T, size).permute(0, 2, 1, 3).reshape(B, T, K * size)  # (B, T, K size)
    z = torch.bmm(R, y).view(B, size, K, size).permute(0, 2, 1, 3)  # (B, K, size, size) = R X R^T
    return _with_channels(z.reshape(B * K, 1, size, size), channels)


def preprocess_many(maps: Sequence[np.ndarray], size: int = 32, resize: str = "area",
                    channels: Sequence[str] = ("max",)) -> torch.Tensor:
    """Maps of different sizes -> (N, C, size, size), grouped by size internally."""
    out = torch.empty(len(maps), len(channels), size, size)
    by_size: dict[int, list[int]] = {}
    for i, m in enumerate(maps):
        by_size.setdefault(int(np.shape(m)[0]), []).append(i)
    for idx in by_size.values():
        out[idx] = preprocess(np.stack([np.asarray(maps[i], dtype=np.float32) for i in idx]), size, resize, channels)
    return out


class MaxPool2(nn.Module):
    """``nn.MaxPool2d(2)`` (2 x 2 windows, stride 2, an odd last row or column left out) as the largest of four
    strided views of the input: no indices are made, and the input's memory format is kept. One thread of a 2-vCPU
    AMD EPYC Zen 4, 128 channels-last maps of the default CNN: 10 us a map for the three pools against 21."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S') -> (B, C, S // 2, S' // 2)."""
        h, w = 2 * (x.shape[-2] // 2), 2 * (x.shape[-1] // 2)
        out = torch.maximum(x[..., 0:h:2, 0:w:2], x[..., 0:h:2, 1:w:2])
        torch.maximum(out, x[..., 1:h:2, 0:w:2], out=out)
        return torch.maximum(out, x[..., 1:h:2, 1:w:2], out=out)


class PatternCNN(nn.Module):
    """conv-BN-ReLU-maxpool blocks -> flatten -> dropout -> hidden -> classes."""

    def __init__(self, num_classes: int = len(CLASSES), in_channels: int = 1, size: int = 32,
                 widths: Sequence[int] = (16, 32, 64), hidden: int = 64, dropout: float = 0.3):
        super().__init__()
        layers: list[nn.Module] = []
        c, s = in_channels, size
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
                       nn.MaxPool2d(2)]
            c, s = w, s // 2
        if s < 1:
            raise ValueError(f"size {size} too small for {len(widths)} pooling stages")
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(c * s * s, hidden),
                                  nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, size, size) -> (B, num_classes) logits."""
        return self.head(self.features(x))

    def inference_net(self) -> nn.Sequential:
        """A frozen copy for eval-mode inference, the same function as :meth:`forward` in eval mode: each block's
        BatchNorm folded into its conv (``fuse_conv_bn_eval``), the max-pool as :class:`MaxPool2` (the same
        maxima), the ReLU after it (max commutes with a nondecreasing function: a quarter of the work), the feature
        maps channels-last. Logits differ from
        :meth:`forward`'s by rounding only (about 1e-7 relative; classes identical on 62,856 maps of MiniLM on
        GLUE dev, a trained CNN). One thread of a 2-vCPU AMD EPYC Zen 4, 128 maps of size 32: 0.08 ms a map
        against 0.25 (channels-first max-pooling with indices was half of it, BatchNorm a tenth)."""
        layers: list[nn.Module] = []
        mods = list(copy.deepcopy(self.features).eval())
        for i in range(0, len(mods), 4):
            conv, bn, _, _ = mods[i:i + 4]  # conv, BatchNorm, ReLU, nn.MaxPool2d(2)
            layers += [fuse_conv_bn_eval(conv, bn), MaxPool2(), nn.ReLU(inplace=True)]
        net = nn.Sequential(*layers, *copy.deepcopy(self.head)).eval()
        for p in net.parameters():
            p.requires_grad_(False)
        return net.to(memory_format=torch.channels_last)
