"""From ``--model-id`` to weights on the devices: resolving the model's files, reading HF folders
(with GPTQ/AWQ quantization) and GGUF files (``gguf``), writing and restoring prepared
checkpoints (``prepared``, with orbax-checkpoint), and composing an engine from an
``EngineConfig`` (``builder``).
"""
