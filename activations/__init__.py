"""Stage 1: model + tokens -> activation store, and back out as training batches.

The only stage that touches transformer-lens, transformers and ``datasets``.
"""
