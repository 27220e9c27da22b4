"""Files shipped with the package: the bundled default model (`stories260k/`, a tiny
SentencePiece Llama; see `config.DEFAULT_MODEL`).

Import rule: no code.
"""
