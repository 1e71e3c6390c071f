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
- Memory is bounded and planned per distinct grammar (`kvgate.memory.workspace`, term `grammar`): the
  compiler keeps at most `slots` grammars (`--max-grammars`), cached or running, each under
  `GRAMMAR_BYTES` because the grammar text is at most `MAX_GRAMMAR_CHARS` and the lexer at most
  `LEXER_STATES` states, plus one compile in hand. Rows of one grammar share its lexer states, so a
  grammar costs its slot once however many rows run it. The scheduler takes a slot at admission
  (`acquire`: a running grammar is pinned, an idle cached one may be evicted for it; none free = the
  request waits, and the running grammar whose rows end soonest is held for it, `hold_for_head`) and
  each row gives its pin back when it ends (`release`). A check on a server thread never evicts. A string's `minLength` /
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

import logging
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace

import llguidance

log = logging.getLogger("kvgate.structured")

MAX_REASON = 400  # characters of the engine's error quoted in a 400
MAX_GRAMMAR_CHARS = 32 << 10  # a schema or tool list beyond this is refused (it bounds a grammar's size)
LEXER_STATES = 10240  # llguidance's lexer DFA states per grammar (built lazily while generating)
# A state's bytes: string-length states measured 0.38-0.7 KiB each on SmolLM2's tokenizer (maxLength 900
# to 8,000, ASCII and multi-byte text; session 36). A row's matcher shares its template's states (four
# copies driven through a 2,000-character string grew the process as one did), so distinct grammars,
# not rows, hold them, and what one grammar's rows write adds up: the plan charges each slot one.
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


# --max-grammars auto: distinct grammars kept at once. Requests with one schema or tool list share a
# slot however many run, and a client app sends few of them; the old plan charged max(4, rows / 4)
# cached plus one per row (20 at 16 rows: 168 MiB). Fixed, not a share of the limit: the advice "raise
# --memory-limit to at least X" must give a plan that fits at X.
AUTO_SLOTS = 4


OFF = (
    "structured output is off on this server: it was started with --max-grammars 0, which plans no memory "
    "for grammars. Send the request without a schema or tools, or ask the operator for --max-grammars 1 "
    "or more"
)


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
    def __init__(self, tokenizer_json: str, eog_ids: list[int], n_vocab: int, slots: int):
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=n_vocab, eos_token=sorted(eog_ids) or None
        )
        self.vocab = self.tokenizer.vocab_size
        self.limits = llguidance.LLParserLimits(max_lexer_states=LEXER_STATES, verbose_errors=False)
        self.slots = slots  # distinct grammars kept at once, cached or running (the plan's)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # oldest use first
        self._pins: dict[str, int] = {}  # running rows per grammar: never evicted while pinned
        self._lock = threading.Lock()  # the cache and the pins; never held while compiling
        self._compiling = threading.Lock()  # one compile at a time
        self.executor: llguidance.LLExecutor | None = None  # made by the worker, used only by it
        self.compiles = 0
        # the running grammar held for a head waiting for a slot: it takes no new rows until it has
        # none (`hold_for_head`); None when none is held
        self.held: str | None = None

    def check(self, text: str) -> Grammar:
        """Compile `text` now (cached while a slot is free) and return the `Grammar` a request carries."""
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                f"the grammar built from this schema is {len(text):,} characters; kvgate compiles at most "
                f"{MAX_GRAMMAR_CHARS:,} (its planned memory per grammar)"
            )
        if self.slots < 1:
            raise GrammarError(OFF)
        self._template(text)
        return Grammar(text, self)

    def matcher(self, text: str) -> llguidance.LLMatcher:
        """A row's own matcher: a copy of the cached template (pinned by `acquire` before)."""
        return self._template(text).deep_copy()

    def acquire(self, text: str, rows: int, new_slot: bool = True) -> bool:
        """Pin `text` for `rows` running rows. True when it is kept already (cached or running), but
        not the grammar held for a head (`hold_for_head`); or, with `new_slot`, when a slot is free or
        held by an idle cached grammar, which is evicted. False: every slot holds a running grammar,
        and the request waits. A miss compiles in `matcher`."""
        with self._lock:
            if text not in self._cache and text not in self._pins:
                if not new_slot or not self._room():
                    return False
                self.held = None  # a head waiting for a slot has one
            elif text == self.held and not self._spare():  # a spare slot is there for the head
                return False
            elif text in self._cache:
                self._cache.move_to_end(text)
            self._pins[text] = self._pins.get(text, 0) + rows
            return True

    def hold_for_head(self, steps_left: dict[str, int]) -> None:
        """A head waits for a slot: hold the running grammar whose rows end soonest (`steps_left`: the
        steps until each running grammar's last row ends at the latest). It takes no new rows, from
        any request, until its rows have ended or a head got a slot: so a steady stream of one schema
        cannot keep every slot busy (review of session 38: 14 later requests of one passed a new
        schema, then the 429), and the hold outlasts a head that gave up, so the slot it freed is
        still there when its client retries (QA pass 12: a retry after each 429 met the running
        schema refilled, seven times)."""
        with self._lock:
            if self.held not in self._pins and self._pins:
                self.held = min(self._pins, key=lambda t: (steps_left.get(t, 1 << 62), self._pins[t]))

    def release(self, text: str, rows: int = 1) -> None:
        """`rows` running rows of `text` ended; the grammar stays cached, evictable once none run it."""
        with self._lock:
            left = self._pins.get(text, 0) - rows
            if left > 0:
                self._pins[text] = left
                return
            if left < 0:  # never seen: a double release would leave another row's grammar evictable
                log.error("grammar released by %d more rows than pinned it", -left)
            self._pins.pop(text, None)
            if text == self.held:  # its rows have ended: its slot is free for the head held for
                self.held = None

    def can_pin(self, text: str) -> bool:
        """`acquire(text, ...)` (a head's) would succeed now (nothing is evicted by asking)."""
        with self._lock:
            if text == self.held and not self._spare():
                return False
            return text in self._cache or text in self._pins or self._spare()

    def kept(self) -> tuple[int, int]:
        """(grammars kept, of which running): what the slots hold now."""
        with self._lock:
            return self.counts()

    def counts(self) -> tuple[int, int]:
        """`kept()` without waiting for the lock (a compile may hold it for milliseconds), for the
        worker's snapshot: only the worker pins and unpins, and a read of the cache's size is atomic."""
        pins = list(self._pins)
        return len(self._cache) + sum(1 for t in pins if t not in self._cache), len(pins)

    def _kept(self) -> int:
        return self.counts()[0]

    def _spare(self) -> bool:
        """A slot is free, or held by an idle grammar that could be evicted (locked)."""
        return self._kept() < self.slots or any(t not in self._pins for t in self._cache)

    def _room(self) -> bool:
        """A slot for one more grammar, evicting the least recently used idle one if need be (locked)."""
        while self._kept() >= self.slots:
            idle = next((t for t in self._cache if t not in self._pins), None)
            if idle is None:
                return False
            del self._cache[idle]
        return True

    def _template(self, text: str) -> llguidance.LLMatcher:
        """The cached template of `text`, or one compiled now: kept when it is pinned (its slot is
        taken) or a slot is free, else handed back uncached. A check never evicts: a request validated
        on a server thread must not turn a queued request's kept grammar into one that needs a new
        slot (review of session 38: a prompt list's later prompt then waited behind the head its own
        answer held up); `acquire` evicts, in the queue's order. One unpinned compile at a time
        (`_compiling`): at most one template outside the slots exists, the plan's compile in hand. The
        cache's lock is not held while compiling, so the worker's cache hits (every admitted row's
        matcher) never wait for a request's schema being compiled on a server thread (1-7 ms for common
        schemas, more for large ones); nor does its compile of a pinned miss (a schema checked while no
        slot was free), whose slot `acquire` took: before, the whole engine waited on `_compiling` for
        other requests' compiles (review of session 38)."""
        with self._lock:
            t = self._cache.get(text)
            if t is not None:
                self._cache.move_to_end(text)
                return t
            pinned = text in self._pins
        if pinned:  # its slot is taken (`acquire`, on the worker): not the compile in hand, no wait for it
            return self._compile(text)
        with self._compiling:
            with self._lock:  # compiled by another thread while this one waited
                t = self._cache.get(text)
                if t is not None:
                    return t
            return self._compile(text)

    def _compile(self, text: str) -> llguidance.LLMatcher:
        t = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if t.is_error():
            raise GrammarError(_reason(t.get_error()))
        t.compute_bitmask()  # builds the first lexer states here, not in an engine step
        with self._lock:
            self.compiles += 1
            if text in self._cache:  # another thread compiled it meanwhile: one template per slot
                return self._cache[text]
            if text in self._pins or self._kept() < self.slots:
                self._cache[text] = t
        return t


SOURCE_LINE = re.compile(r"^\s*\d+\s*\|")  # `  8 | next: NEWLINES "<tool_call>..."`


def check_lengths(bounds: list[tuple[str, int]], per_token: int | None = None) -> None:
    """Raise `GrammarError` when the string length bounds (path, characters) of a request's schemas
    would need more lexer states than a grammar has (`LEXER_STATES`; the module's doc says why).
    `per_token`: the longest token's bytes, for the advice (a maxLength of max_tokens times it or more
    cannot bind, and is not enforced: `schema_prep.unreachable`)."""
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
        + (
            f", or lower max_tokens: a maxLength of max_tokens x {per_token} characters or more (this model's "
            "longest token) can never bind and costs nothing"
            if per_token
            else ""
        )
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


def compiler_for(tokenizer, n_vocab: int, slots: int) -> GrammarCompiler:
    """The one compiler of a `TextTokenizer` (built on first use, ~0.3-0.7 s: call it off the loop), with
    `slots` distinct grammars (the plan's `limits.grammars`; the first caller's count holds)."""
    if slots < 1:  # before the token trie is built: such a plan has no memory for it
        raise GrammarError(OFF)
    with _compilers_lock:
        c = _compilers.get(tokenizer)
        if c is None:
            info = tokenizer.info
            c = GrammarCompiler(
                info.tokenizer_json, list(info.eog_token_ids), max(n_vocab, tokenizer.vocab_size), slots
            )
            _compilers[tokenizer] = c
        return c


def kept_for(tokenizer) -> tuple[int, int]:
    """(grammars kept, of which running) by `tokenizer`'s compiler, for the worker's snapshot; (0, 0)
    before its first grammar. Without `_compilers_lock`: `compiler_for` holds it while it builds a
    compiler (~0.5 s), and a lookup in the mapping is atomic."""
    c = _compilers.get(tokenizer) if tokenizer is not None else None
    return c.counts() if c is not None else (0, 0)


def held_for(tokenizer) -> str | None:
    """The grammar `tokenizer`'s compiler holds for a head waiting for a slot, or None (as `kept_for`)."""
    c = _compilers.get(tokenizer) if tokenizer is not None else None
    return c.held if c is not None else None


def bound(engine, request):
    """`request` with its grammar (if any) compiled by `engine`'s own compiler: a request that came
    pickled from a cluster's ingress carries the grammar's text alone (QA pass 10: structured output and
    tools through the cluster were a 500, "cannot pickle 'builtins.LLTokenizer' object")."""
    g = request.sampling.grammar
    if g is None or g.compiler is not None:
        return request
    compiler = compiler_for(engine.tokenizer, engine.spec.vocab_size, engine.plan.limits.grammars)
    return replace(request, sampling=replace(request.sampling, grammar=compiler.check(g.text)))
