"""Head naming: files use 0-based (layer, head); figures use the paper's 1-based ``layer-head``."""


def head_name(layer: int, head: int) -> str:
    """Paper-style 1-based name of the 0-based (layer, head): ``head_name(7, 9) == "8-10"``."""
    return f"{int(layer) + 1}-{int(head) + 1}"
