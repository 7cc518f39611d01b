"""Probing classifiers over the self-attention of BERT-family encoders.

The public Python API (:mod:`probes.api`), loaded on first use so that ``import probes`` stays cheap:

* :func:`load_encoder` - the packaged default, a hub id, a local folder, a ``.gguf`` file or a fine-tuned run;
* :func:`word_maps` / :class:`WordMaps` - word-level maps of any kind for one's own sentences;
* :func:`view` - one sentence's maps as a self-contained HTML page (``WordMaps.plot``: one map as a heatmap);
* :func:`read_conllu`, :func:`read_text`, :func:`treebank` - one's own CoNLL-U or plain-text files;
* :func:`analyze` / :class:`AnalysisResult` - any analysis of ``conf/analysis/`` as DataFrames and figures.
"""

import importlib

__version__ = "0.1.0"

__all__ = ["AnalysisResult", "WordMaps", "__version__", "analyze", "load_encoder", "read_conllu", "read_text",
           "treebank", "view", "word_maps"]


def __getattr__(name: str):
    """The API's names, imported from :mod:`probes.api` on first access (PEP 562)."""
    if name in __all__ and name != "__version__":
        return getattr(importlib.import_module("probes.api"), name)
    raise AttributeError(f"module 'probes' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
