"""Constrained decoding: answers that follow a JSON schema, any JSON object, a regular
expression or a choice among strings (docs/structured.md).

``spec.py`` reads a call's ``response_format`` into a :class:`GrammarSpec`; ``compiler.py``
compiles specs with llguidance (the ``structured`` extra, imported on first use) for one
tokenizer, caches them by spec, and gives each request its own :class:`RowGrammar`, the
``Constraint`` its answer's draws carry (``kestrel.skills.base``).
"""

from __future__ import annotations

from kestrel.grammar.compiler import Grammars, RowGrammar
from kestrel.grammar.spec import GrammarSpec, parse_response_format

__all__ = ["GrammarSpec", "Grammars", "RowGrammar", "parse_response_format"]
