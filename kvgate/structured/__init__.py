"""Structured output: grammars compiled from JSON schemas and tool lists, and the token masks they give.

`compiler.py` turns a grammar (llguidance's Lark dialect, with `%json {schema}` for JSON schemas) into
a compiled, read-only template, cached by its text; `masks.py` computes the batch's masks and applies
them to logits. The grammar engine is llguidance (measured against xgrammar in bench/grammar_masks.py).
"""
