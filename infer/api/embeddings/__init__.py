"""OpenAI's ``/v1/embeddings``: vectors of texts or token ids from an embedding model.

``models``: the request; ``bodies``: the answer (floats, or base64 of little-endian float32
as the ``openai`` client asks by default) and its usage.
"""
