"""Structured outputs: the grammar engine (xgrammar) that constrains a request's output to a
JSON schema, a regex, a choice, an EBNF/Lark grammar or a structural tag.

    backend_xgrammar.py → XgrammarBackend, XgrammarGrammar, validate_structured_outputs
    manager.py          → StructuredOutputManager (matchers, the step's bitmask),
                          StructuredOutputRequest
    grammar_compiler.py → GrammarCompiler (the manager's compile cache and thread pool),
                          GrammarStats

The worker's side (applying the bitmask to the logits) is `worker/grammar_bitmask.py`.
Imports no torch; xgrammar is imported when the first constraint is validated or compiled.
"""
