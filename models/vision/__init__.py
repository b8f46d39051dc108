"""Image encoders of vision-language models: what each provides (``encoder``) and the towers
(``siglip``, Gemma 3's; ``pixtral``, Mistral 3's); a family's projector and checkpoint names
live in ``models.families``."""
