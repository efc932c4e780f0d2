"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): the request
bodies and their conversation (:mod:`.models`), the message object, its stream's events and
the error body (:mod:`.bodies`), and its writer (:mod:`.writer`). It runs over the chat path:
its content blocks become chat messages, and the reply's thinking, text and tool calls are
read back out as blocks."""
