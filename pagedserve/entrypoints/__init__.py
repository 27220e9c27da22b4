"""What users call: the offline `LLM` (`llm.py`), the `pagedserve` command (`cli.py`), the
chat rendering shared by both (`chat_utils.py`), the option tables of the CLI
(`options.py`) and the OpenAI-compatible server (`openai/`).

Import rule: entrypoints imports engine, metrics and the leaf modules; never executor, worker
or models. Nothing but the root package imports entrypoints.
"""
