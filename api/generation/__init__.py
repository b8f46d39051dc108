"""A checked request to text on the wire: prompts rendered and tokenized, the engine's stream
consumed as text (logprobs, reasoning sections, structured output), and server-sent events in the
framing OpenAI clients parse.
"""
