"""OpenAI's Responses API (text and function calls): the request body and its conversation
(:mod:`.models`), the response object and its events (:mod:`.bodies`), and its writer
(:mod:`.writer`). It runs over the chat path: its input items become chat messages."""
