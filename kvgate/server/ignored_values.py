"""OpenAI's values for the request fields kvgate accepts and ignores (`protocol`'s module doc says why each
changes nothing here), shared by the chat, completions and Responses bodies. Ignored is not unchecked:
a value OpenAI answers with a 400 gets one here too (QA pass 8: "bogus" was accepted, where OpenAI, and
vLLM for reasoning_effort, refuse it).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
Verbosity = Literal["low", "medium", "high"]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
CacheRetention = Literal["in-memory", "24h"]
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
    Field(max_length=16),
]  # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
