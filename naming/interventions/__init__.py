"""Acting on concepts: steering through latents (``steer``, ``steerability``), erasing and switching a labelled
concept (``erase``, with the closed-form maps of ``erasure``: LEACE, SPLINCE, LEACE-Switch, MidSteer)."""
