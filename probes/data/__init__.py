"""Data: CoNLL-U treebanks, pinned sources, word vectors."""
