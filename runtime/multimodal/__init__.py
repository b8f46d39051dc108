"""Images for vision-language models: untrusted bytes decoded with bounds (``decode``), pixels
preprocessed as the model's HF image processor does and prompts expanded as its HF processor
does (``processor``; ``pixtral`` for Mistral 3's images of any size), and what the engine keeps
per image (``inputs``)."""
