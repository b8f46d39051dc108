"""The OpenAI wire format: request and response bodies as msgspec structs, their decoding and
checking, the server-side defaults and caps applied to them, the error envelope, and the OpenAPI
document built from the same structs.
"""
