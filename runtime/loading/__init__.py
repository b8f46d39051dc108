"""From ``--model-id`` to weights on the devices: resolving the model's files, reading HF folders
(with GPTQ/AWQ quantization) and GGUF files (``gguf``), and composing an engine from an
``EngineConfig`` (``builder``).
"""
