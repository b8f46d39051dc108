"""Images for vision-language models: untrusted bytes decoded with bounds (``decode``), pixels
preprocessed as the model's HF image processor does and prompts expanded as its HF processor
does (``processor``), and what the engine keeps per image (``inputs``)."""
