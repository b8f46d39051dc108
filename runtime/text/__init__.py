"""Text and token ids: HF fast tokenizers with streaming detokenization, chat templates rendered
in a sandbox, and stop strings matched on a generation's text.
"""
