"""The emoji testbed: a small pixel-space PixArt-Σ trained in JAX on emoji bitmaps, for W4A4 evaluations on CPU.

* :mod:`models.testbed.data`: the dataset (Noto Color Emoji bitmaps, Unicode-name captions, MiniLM tokens).
* :mod:`models.testbed.model`: the model config, the flow-matching objective, the Euler sampler, image grids.
* :mod:`models.testbed.training`: the training step (optimizer, EMA, jitted chunks) and its resumable state.
* :mod:`models.testbed.evaluation`: sampling, capture and image metrics of the W4A4 evaluation, and its outputs.

The command-line mains are ``scripts/build_emoji_dataset.py``, ``scripts/train_testbed.py``,
``scripts/eval_testbed.py`` (``kroquant evaluate``), ``scripts/demo.py`` and ``scripts/testbed_generalisation.py``.
"""
