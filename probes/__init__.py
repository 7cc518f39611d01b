"""Probing classifiers over the self-attention of BERT-family encoders.

The public Python API (:mod:`probes.api`), loaded on first use so that ``import probes`` stays cheap:

* :func:`load_encoder` - the packaged default, a hub id, a local folder, a ``.gguf`` file or a fine-tuned run;
* :func:`word_maps` / :class:`WordMaps` - word-level maps of any kind for one's own sentences;
* :func:`document_maps` / :func:`document_stats` - a whole document's attention pooled to sentences, words or
  spans, and per-head statistics (:class:`Document`: its text and sentences);
* :func:`view` - one sentence's maps as a self-contained HTML page (``WordMaps.plot``: one map as a heatmap);
* :func:`read_conllu`, :func:`read_text`, :func:`treebank` - one's own CoNLL-U or plain-text files;
* :func:`analyze` / :class:`AnalysisResult` - any analysis of ``conf/analysis/`` as DataFrames and figures.
"""

from importlib import import_module as _import_module

from probes import quiet as _quiet  # noqa: F401  (libraries' noise a run cannot act on, filtered narrowly)

__version__ = "0.1.0"

__all__ = ["AnalysisResult", "Document", "DocumentMaps", "WordMaps", "__version__", "analyze", "document_maps",
           "document_stats", "load_encoder", "read_conllu", "read_text", "treebank", "view", "word_maps"]


def __getattr__(name: str):
    """The API's names, imported from :mod:`probes.api` on first access (PEP 562)."""
    if name in __all__ and name != "__version__":
        return getattr(_import_module("probes.api"), name)
    raise AttributeError(f"module 'probes' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API only (``__all__``): no helper, and no subpackage imported so far (``probes.api``, ...)."""
    return sorted(__all__)
