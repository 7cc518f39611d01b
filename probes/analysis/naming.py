"""Head naming: files use 0-based (layer, head); figures use the paper's 1-based ``layer-head``."""


def head_name(layer: int, head: int) -> str:
    """Paper-style 1-based name of the 0-based (layer, head): ``head_name(7, 9) == "8-10"``."""
    return f"{int(layer) + 1}-{int(head) + 1}"


def model_layers(layers, count: int) -> list[int]:
    """The model's 0-based layer of each of ``count`` stored layers: a cache's ``layers`` (an entry of some
    layers only, ``extract.layers``) or, for None, 0..count-1."""
    out = list(range(count)) if layers is None else [int(l) for l in layers]
    if len(out) != count:
        raise ValueError(f"{len(out)} layer indices {out} for {count} stored layers")
    return out
