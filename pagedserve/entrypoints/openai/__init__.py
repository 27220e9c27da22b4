"""The OpenAI-compatible HTTP server: the app and its routes (`api_server`), request and
response schemas (`protocol`), completions and chat (`serving*`), and the edge: body limit,
off-loop tokenizing, OpenAPI schema, launch and shutdown.

Import rule: as entrypoints; torch-free (the server's process loads no model code).
"""
