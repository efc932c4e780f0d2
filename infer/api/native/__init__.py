"""infer's own API: the native event stream (``/v1/generate``), attention inspection and
tokenizing. The request bodies (:mod:`.models`), the events and bodies of the answers
(:mod:`.bodies`), and the stream's writer (:mod:`.writer`)."""
