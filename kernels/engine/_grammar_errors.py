"""The typed errors of grammar and schema compilation (one hierarchy for every grammar module).

:class:`InvalidGrammar` is the base a caller catches (a 400 at the HTTP
edge); :class:`SchemaTooComplex` (a schema over a named limit, before any
compiling) and :class:`GrammarTooComplex` (the compiler crashed or ran past
its deadline) say which kind. :class:`GrammarCompilerBusy` is not the
request's fault: every compiler stayed busy.
"""

from __future__ import annotations

from kernels._errors import InvalidPrompt, KernelError

__all__ = [
    "GrammarCompilerBusy",
    "GrammarTooComplex",
    "InvalidGrammar",
    "SchemaTooComplex",
]


class InvalidGrammar(InvalidPrompt):
    """A grammar (or the JSON schema it came from) that cannot constrain decoding; says why."""


class SchemaTooComplex(InvalidGrammar):
    """A schema over one of ``SchemaLimits``' bounds; ``limit`` names which one (its field name)."""

    def __init__(self, limit: str, text: str, value: int, bound: int, where: str) -> None:
        super().__init__(f"{where} is over the {text} limit: {value} > {bound} ({limit})")
        self.limit = limit
        self.value = value
        self.bound = bound
        self.where = where


class GrammarTooComplex(InvalidGrammar):
    """The compiler crashed or ran past its deadline on this grammar (its child was replaced)."""


class GrammarCompilerBusy(KernelError):
    """Every grammar compiler child stayed busy past the deadline; try again later."""
