"""Stage 3: latent -> name, concept bottleneck models, the exported concept dictionary."""
