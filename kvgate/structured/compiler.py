"""Grammar compilation: one compiler per tokenizer, compiled grammars cached by their text.

Promises:
- `GrammarCompiler.check(text)` compiles a grammar (or raises `GrammarError` naming what the engine
  cannot do, e.g. `Unimplemented keys: ["not"]`) and leaves it in the cache. The server calls it in
  prepare's worker thread, never on the event loop.
- A request carries only a `Grammar` (its text and compiler), never a compiled object: a queued
  request holds no grammar memory. `Grammar.matcher()` runs on the engine's worker when the row is
  admitted: a copy of the cached template (about 15 us), or a compile on a cache miss.
- Compiled templates are shared read-only; each row owns its matcher (a copy), so a row's grammar state
  lives with the row and only the worker thread advances it.
- Memory is bounded and planned (`kvgate.memory.workspace`, term `grammar`): at most `cache_entries`
  cached templates plus one per running row, each under `GRAMMAR_BYTES` because the grammar text is at
  most `MAX_GRAMMAR_CHARS` and the lexer at most `LEXER_STATES` states. A string's `minLength` /
  `maxLength` costs lexer states in proportion (the lexer counts its characters), so `check_lengths`
  refuses up front, with the numbers, a schema whose bounds would need more than the grammar's
  states: a row never runs out of them mid-answer for that reason (QA pass 9: pydantic's
  `max_length=500` failed an admitted request after ~230 characters at the old 1,024 states).

NOTE: why llguidance and not xgrammar (bench/grammar_masks.py: AMD EPYC, 2 threads, vocab 49,152, a
7-property schema; three runs on a shared, loaded machine). Median batched mask time per row-token:
at 1 row llguidance 26-145 us against xgrammar's 110-830 us; at 8 rows 25-75 against 36-112; at 32
rows xgrammar is about 2x cheaper (18-25 us against 35-190). Against a 32-row decode step of tens of
milliseconds either is a few percent at most. What decided: llguidance compiles a schema to its first
mask in 1-7 ms (xgrammar 8-49 ms), builds from kvgate's own tokenizer.json with no other dependency
(xgrammar needs transformers' tokenizer classes and pulls triton and tvm-ffi, and takes 3.5 s to
import), and names the JSON-schema keywords it does not implement, which is what a 400 needs.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace

import llguidance

MAX_REASON = 400  # characters of the engine's error quoted in a 400
MAX_GRAMMAR_CHARS = 32 << 10  # a schema or tool list beyond this is refused (it bounds a grammar's size)
LEXER_STATES = 10240  # llguidance's lexer DFA states per grammar (built lazily while generating)
# A state's bytes: string-length states measured 0.38-0.7 KiB each on SmolLM2's tokenizer (maxLength 900
# to 8,000, ASCII and multi-byte text; session 36). A row's matcher shares its template's states (four
# copies driven through a 2,000-character string grew the process as one did), so distinct grammars,
# not rows, hold them, and what one grammar's rows write adds up; the plan charges each row one, as if
# every row's grammar were its own.
STATE_BYTES = 720
# States a string's length bound can cost per character, over everything the rows of one grammar may
# write: 4.2 measured for ASCII words alone, 14.1-14.5 for ASCII, 2-, 3- and 4-byte characters, escapes
# and control characters through one template (the UTF-8 and escape steps within a counted character)
STATES_PER_CHAR = 16
# States kept for the grammar's other lexemes (keys, numbers, enums, the tool markup): the old whole
# bound, which every schema without long strings fit
OTHER_STATES = 1024
# One compiled grammar at most: its lexer states + the compiled grammar, measured at ~32 bytes per
# character of grammar text (12.5 MiB for a 400 KB enum schema)
GRAMMAR_BYTES = LEXER_STATES * STATE_BYTES + MAX_GRAMMAR_CHARS * 32
# llguidance's token trie: measured 19.4 MiB for SmolLM2's 49,152 tokens (~414 B/token)
TOKENIZER_BYTES_PER_TOKEN = 512
MATCHER_ROW_BYTES = 64 << 10  # one row's matcher: parser rows and a mask's scratch (measured < 1 KiB/token)


def cache_entries(max_seqs: int) -> int:
    """Compiled templates kept for reuse, sized from --max-seqs (rows hold theirs besides)."""
    return max(4, max_seqs // 4)


class GrammarError(ValueError):
    """The grammar (a JSON schema, a tool's parameters) cannot be compiled; the message says why."""


@dataclass(frozen=True)
class Grammar:
    """What a request carries: the grammar's text and the compiler that will build its matcher. Pickled
    (a request sent to a cluster replica) it is its text alone: the compiler holds native objects, and
    the replica binds the text to its own (`bound`)."""

    text: str
    compiler: GrammarCompiler | None

    def matcher(self) -> llguidance.LLMatcher:
        if self.compiler is None:
            raise GrammarError("this grammar came without its compiler: bind it first (compiler.bound)")
        return self.compiler.matcher(self.text)

    def __reduce__(self):
        return (Grammar, (self.text, None))

    def __copy__(self):  # immutable: a copy (not a pickle) keeps its compiler
        return self

    def __deepcopy__(self, memo):
        return self


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, eog_ids: list[int], n_vocab: int, max_seqs: int):
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=n_vocab, eos_token=sorted(eog_ids) or None
        )
        self.vocab = self.tokenizer.vocab_size
        self.limits = llguidance.LLParserLimits(max_lexer_states=LEXER_STATES, verbose_errors=False)
        self.capacity = cache_entries(max_seqs)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.executor: llguidance.LLExecutor | None = None  # made by the worker, used only by it
        self.compiles = 0

    def check(self, text: str) -> Grammar:
        """Compile `text` now (cached) and return the `Grammar` a request carries."""
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                f"the grammar built from this schema is {len(text):,} characters; kvgate compiles at most "
                f"{MAX_GRAMMAR_CHARS:,} (its planned memory per grammar)"
            )
        self._template(text)
        return Grammar(text, self)

    def matcher(self, text: str) -> llguidance.LLMatcher:
        return self._template(text).deep_copy()

    def _template(self, text: str) -> llguidance.LLMatcher:
        with self._lock:
            t = self._cache.get(text)
            if t is not None:
                self._cache.move_to_end(text)
                return t
            # Compiled under the lock: at most one template outside the cache exists at a time.
            t = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
            if t.is_error():
                raise GrammarError(_reason(t.get_error()))
            t.compute_bitmask()  # builds the first lexer states here, not in an engine step
            self.compiles += 1
            self._cache[text] = t
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
            return t


SOURCE_LINE = re.compile(r"^\s*\d+\s*\|")  # `  8 | next: NEWLINES "<tool_call>..."`


def check_lengths(bounds: list[tuple[str, int]]) -> None:
    """Raise `GrammarError` when the string length bounds (path, characters) of a request's schemas
    would need more lexer states than a grammar has (`LEXER_STATES`; the module's doc says why)."""
    need = STATES_PER_CHAR * sum(n for _, n in bounds) + OTHER_STATES
    if need <= LEXER_STATES:
        return
    most = (LEXER_STATES - OTHER_STATES) // STATES_PER_CHAR
    worst = sorted(bounds, key=lambda b: -b[1])[:3]
    named = ", ".join(f"{n:,} at {p}" for p, n in worst)
    raise GrammarError(
        f"its string length bounds (minLength / maxLength: {named}; {sum(n for _, n in bounds):,} characters "
        f"in all) would need about {need:,} lexer states while generating, and a grammar has {LEXER_STATES:,} "
        f"(its planned memory). Lower them to {most:,} characters in all, or drop maxLength (max_tokens still "
        "bounds the output)"
    )


def _reason(error: str) -> str:
    """llguidance's error on one line: its lines joined, the caret lines that mark a position and the
    quoted lines of the grammar's text (kvgate's Lark, cut mid-schema: QA pass 9) dropped (a regex
    error's detail is on the lines after "regex parse error:"), Rust's `Some(x)` written as x, and the
    way out for integer bounds it cannot turn into a grammar."""
    lines = [
        ln.strip()
        for ln in error.strip().splitlines()
        if ln.strip().strip("^") and not SOURCE_LINE.match(ln)  # the grammar's own text: kvgate's, not theirs
    ]
    line = " ".join(lines) if lines else "the grammar engine refused it"
    if "failed to compile JSON schema:" in line:
        line = line.split("failed to compile JSON schema:", 1)[1].strip()
    line = re.sub(r"Some\(([^()]*)\)", r"\1", line)[:MAX_REASON]
    if "regex for integer range" in line or "regex for float range" in line:
        line += (
            " (bounds near or past 2^63 or 1e308 cannot be enforced: narrow minimum/maximum, or drop them)"
        )
    return line


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer, n_vocab: int, max_seqs: int) -> GrammarCompiler:
    """The one compiler of a `TextTokenizer` (built on first use, ~0.3-0.7 s: call it off the loop)."""
    with _compilers_lock:
        c = _compilers.get(tokenizer)
        if c is None:
            info = tokenizer.info
            c = GrammarCompiler(
                info.tokenizer_json, list(info.eog_token_ids), max(n_vocab, tokenizer.vocab_size), max_seqs
            )
            _compilers[tokenizer] = c
        return c


def bound(engine, request):
    """`request` with its grammar (if any) compiled by `engine`'s own compiler: a request that came
    pickled from a cluster's ingress carries the grammar's text alone (QA pass 10: structured output and
    tools through the cluster were a 500, "cannot pickle 'builtins.LLTokenizer' object")."""
    g = request.sampling.grammar
    if g is None or g.compiler is not None:
        return request
    compiler = compiler_for(engine.tokenizer, engine.spec.vocab_size, engine.plan.limits.max_seqs)
    return replace(request, sampling=replace(request.sampling, grammar=compiler.check(g.text)))
