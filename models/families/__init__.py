"""One file per architecture family: each translates its HF (and GGUF) config into a
``DecoderConfig`` and maps its checkpoint names onto the declared fields; nothing else. The
registry (``models.registry``) names which family serves which architecture."""
