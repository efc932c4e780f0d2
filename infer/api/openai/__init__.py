"""OpenAI's completions and chat completions: the request bodies (:mod:`.models`), the
chunks and bodies of the answer (:mod:`.bodies`), and its writer (:mod:`.writer`)."""
