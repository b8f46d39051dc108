"""Model definitions as ``flax.nnx`` modules: one decoder configured per architecture (one file
per family: config translation and checkpoint names), the registry, checkpoint loading into the
declared parameters, and the split model (graph definition and state) the engine runs."""
