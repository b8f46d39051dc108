"""OpenAI's Responses API (the subset agents use): its bodies, its input items turned into chat
terms, one model turn as output items and stream events, the multi-turn run with MCP calls between
turns, and the store that ``previous_response_id`` reads.
"""
