"""Extraction stage: frozen encoder -> keyed on-disk caches of word-level maps and hidden states.

:mod:`.settings` (the ``extract`` node as one object), :mod:`.cache` (on-disk format, the cache key of every
kind, build lock), :mod:`.stage` (attention maps: its own loop on one device, Lightning's predict loop across
devices and processes), :mod:`.representations` (hidden states, on the same loops), :mod:`.runner` (find or
build an entry of any kind, in a child process if asked), :mod:`.attention_caches` (the attention caches of treebank splits; ``python -m probes.extract``),
:mod:`.precision` (``precision=auto``).
"""
