"""llama.cpp's ``/infill``: code completion as llama.vim and llama.vscode ask for it.

``models``: the request and the engine request it becomes (a fill built by
:mod:`infer.api.fim`, with the editor's stops); ``bodies``: llama.cpp's answers and error
shape; ``writer``: the completion objects, or their pieces as ``data:`` events.
"""
