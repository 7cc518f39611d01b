"""The model-access layer: the one way into any encoder.

* :mod:`probes.model.load` - loading (hub id, folder, packaged default, random weights, fine-tuned runs)
* :mod:`probes.model.hooks` - attention capture, early stop, head interventions, values, block functions,
  live attention of many sequences (`iter_attention`)
* :mod:`probes.model.inputs` - pre-split words to pieces, padding, length batches, word pooling
* :mod:`probes.model.families` - per-family conventions (usable length, prefix space, adapters)
* :mod:`probes.model.tiny` - tiny random models of every supported family with offline tokenizers

No other module calls ``output_attentions``, registers hooks on a model or looks for its layers.
"""
