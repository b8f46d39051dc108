"""Image encoders of vision-language models: what each provides (``encoder``) and the towers
they share (``siglip``); a family's projector and checkpoint names live in ``models.families``."""
