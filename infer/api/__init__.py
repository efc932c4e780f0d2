"""The wire formats, as pure functions of a request's outputs: OpenAI chunks and bodies, and
the native event stream. Nothing here holds a connection or any state."""
