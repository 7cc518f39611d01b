"""Probing classifiers over the self-attention of BERT-family encoders."""

__version__ = "0.1.0"
