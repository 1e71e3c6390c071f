"""Stop matching (`kvgate.stop.StopMatcher`): stop ids, stop strings across token boundaries, and a
hold-back that keeps only what could still become a stop string."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.stop import StopMatcher


def feed(matcher: StopMatcher, chunks: list[str]) -> tuple[list[str], bool]:
    """Push chunks until a stop completes; return the pieces released (flush included if none did)."""
    out = []
    for chunk in chunks:
        text, stopped = matcher.push(chunk)
        out.append(text)
        if stopped:
            return out, True
    text, stopped = matcher.push("", final=True)  # the row's end, as `EngineState.finish` pushes it
    if stopped:
        return [*out, text], True
    out.append(text + matcher.flush())
    return out, False


def test_stop_string_split_across_token_boundaries_is_found_and_cut():
    """Seen to fail when push searches only the new chunk (not held + new text)."""
    m = StopMatcher(set(), ["END"])
    assert m.push("Hello wor") == ("Hello wor", False)
    assert m.push("ld E") == ("ld ", False)
    assert m.push("N") == ("", False)
    assert m.push("D and more") == ("", True)


def test_text_before_a_stop_in_the_same_chunk_is_released_and_the_rest_dropped():
    """Seen to fail when the stop string and the text after it are released too."""
    m = StopMatcher(set(), ["###"])
    assert m.push("answer: 42### trailing") == ("answer: 42", True)


def test_a_partial_stop_that_never_completes_is_released_in_full_by_flush():
    """Nothing is lost: held text comes back once generation ends for another reason.

    Seen to fail when flush returns "" instead of the held tail.
    """
    m = StopMatcher(set(), ["<|end|>"])
    pieces, stopped = feed(m, ["one two", " <|e", "nd"])
    assert not stopped
    assert pieces[:-1] == ["one two", " ", ""]
    assert "".join(pieces) == "one two <|end"
    assert m.flush() == ""  # flushing empties the hold


def test_a_partial_that_turns_out_not_to_be_a_stop_is_released_at_once():
    """Seen to fail when the held tail is kept after the next chunk rules it out."""
    m = StopMatcher(set(), ["END"])
    assert m.push("the EN") == ("the ", False)
    assert m.push("ter") == ("ENter", False)
    assert m.push(" E") == (" ", False)
    assert m.push("x") == ("Ex", False)


def test_with_several_stops_the_earliest_occurrence_wins():
    """Seen to fail when the first stop in list order wins instead of the earliest in the text."""
    m = StopMatcher(set(), ["world", "lo"])
    assert m.push("hello world") == ("hel", True)
    m = StopMatcher(set(), ["zz", "b"])
    assert m.push("a zz b") == ("a ", True)


def test_the_matcher_names_the_stop_string_that_ended_the_text():
    """`matched` (vLLM's stop_reason, Anthropic's stop_sequence) is the earliest stop in the text, not the
    first listed; with exempt regions, the first outside them. Red with `matched` set to the first
    listed stop that occurs."""
    m = StopMatcher(set(), ["world", "lo"])
    assert m.push("hello world") == ("hel", True) and m.matched == "lo"
    m = StopMatcher(set(), ["}", "Obs"], exempt=("<t>", "</t>"))
    assert m.push("<t>{}</t> Obs }") == ("<t>{}</t> ", True) and m.matched == "Obs"
    m = StopMatcher(set(), ["x"])
    assert m.push("abc") == ("abc", False) and m.matched is None


def test_hold_back_is_only_the_longest_tail_that_is_a_prefix_of_some_stop():
    """Seen to fail when the matcher holds max(len(stop)) - 1 characters regardless of content, and
    when it holds the shortest matching prefix instead of the longest."""
    m = StopMatcher(set(), ["abcd", "xy"])
    assert m.push("12345") == ("12345", False)  # nothing can start a stop: nothing held
    assert m.push("ab") == ("", False)
    assert m.held == "ab"
    assert m.push("c") == ("", False)
    assert m.held == "abc"
    assert m.push("x") == ("abc", False)  # "abcx" rules out abcd; "x" may start "xy"
    assert m.held == "x"
    assert m.push("y") == ("", True)
    m = StopMatcher(set(), ["aab"])
    assert m.push("aa") == ("", False)  # "aa" and "a" are both prefixes: the longer one is held
    assert m.push("a") == ("a", False)  # "aaa": only "aa" can still become "aab"
    assert m.push("b") == ("", True)


def test_without_stop_strings_text_passes_straight_through():
    """Seen to fail when empty stop strings are kept (every text would 'contain' the stop "")."""
    m = StopMatcher(set(), ["", ""])
    assert m.push("anything") == ("anything", False)
    assert m.flush() == ""


def test_stop_token_ids_are_matched_exactly():
    """Seen to fail when is_stop_token ignores the id set."""
    m = StopMatcher({2, 7}, [])
    assert m.is_stop_token(2) and m.is_stop_token(7)
    assert not m.is_stop_token(3) and not m.is_stop_token(0)
    assert not StopMatcher(frozenset(), ["x"]).is_stop_token(2)


def expected_output(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    """What a streaming server must produce: at the first chunk boundary where the text so far contains
    a stop string, the text before the earliest such occurrence; otherwise everything."""
    text = ""
    for chunk in chunks:
        text += chunk
        found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
        if found:
            return text[: min(found)], True
    return text, False


def longest_partial(text: str, stops: list[str]) -> int:
    best = 0
    for s in stops:
        for n in range(1, len(s)):
            if text.endswith(s[:n]):
                best = max(best, n)
    return best


_alphabet = st.sampled_from("abc ")


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(st.text(_alphabet, max_size=6), max_size=12),
    stops=st.lists(st.text(_alphabet, max_size=4), max_size=3),
)
def test_streamed_output_equals_the_text_up_to_the_first_stop_and_holds_back_minimally(chunks, stops):
    """A tiny alphabet makes stops, partial stops and overlaps common.

    Seen to fail when flush drops the held text, when the hold-back keeps one character too many or
    too few, and when the earliest-occurrence rule is replaced by list order.
    """
    m = StopMatcher(set(), stops)
    released = ""
    seen = ""
    stopped = False
    for chunk in chunks:
        text, stopped = m.push(chunk)
        released += text
        seen += chunk
        if stopped:
            break
        # Minimal hold-back: all of the text is out except the longest tail that may still be a stop.
        assert released == seen[: len(seen) - longest_partial(seen, stops)]
    if not stopped:
        released += m.flush()
    assert (released, stopped) == expected_output(chunks, stops)


def outside_regions(
    text: str, stops: list[str], opening: str, closing: str, more: bool = False
) -> int | None:
    """The earliest start of a stop string that lies outside every opening...closing region (a
    region runs from its opening's first character to its closing's last; an unclosed one to the end).
    `more`: text may still follow, so an end outside every region that may begin an opening counts as
    one (what starts there is not decided yet)."""
    regions, i = [], 0
    while (a := text.find(opening, i)) >= 0:
        e = text.find(closing, a + len(opening))
        regions.append((a, len(text) if e < 0 else e + len(closing)))
        if e < 0:
            break
        i = e + len(closing)
    if more and (not regions or regions[-1][1] < len(text)):
        start = max(regions[-1][1] if regions else 0, len(text) - len(opening) + 1)
        tail = next((j for j in range(start, len(text)) if opening.startswith(text[j:])), None)
        if tail is not None:
            regions.append((tail, len(text)))
    starts = [j for s in stops if s for j in range(len(text)) if text.startswith(s, j)]
    free = [j for j in starts if not any(a <= j < b for a, b in regions)]
    return min(free) if free else None


@settings(max_examples=600, deadline=None)
@given(
    chunks=st.lists(st.text(st.sampled_from("ab<> "), max_size=6), max_size=12),
    stops=st.lists(st.text(st.sampled_from("ab<> "), min_size=1, max_size=3), max_size=3),
)
def test_stop_strings_do_not_apply_inside_exempt_regions(chunks, stops):
    """With `exempt` (a tool call's `<tool_call>` ... `</tool_call>`: QA pass 6 saw a stop string cut
    a call's JSON, and agents ran the broken call), the output is the text up to the first stop string
    that starts outside every region, at the first chunk where one is complete, whatever the chunks.
    Markers of two characters make regions, partial markers and overlaps common. A stop that starts in
    what may still become an opening waits until the text says (or the output ends). Seen red with the
    region check dropped (a stop inside a region cut), with the opening's start counted inside the
    text before it, and (session 37) with a stop in a partial opening counted at once."""
    pieces, stopped = feed(StopMatcher(set(), stops, exempt=("<<", ">>")), chunks)
    released = "".join(pieces)
    cut = None
    for n in range(1, len(chunks) + 1):  # the first chunk boundary where a free stop is complete
        so_far = "".join(chunks[:n])
        cut = outside_regions(so_far, stops, "<<", ">>", more=True)
        if cut is not None:
            break
    full = "".join(chunks)
    if cut is None:  # the end: what may have begun an opening is decided now
        cut = outside_regions(full, stops, "<<", ">>")
    assert (released, stopped) == ((full[:cut], True) if cut is not None else (full, False))


def test_a_stop_that_begins_a_tool_calls_opening_leaves_the_call_whole():
    """`stop: ["<"]` (or "<t") with tools: the opening `<tool_call>` written over several tokens is not cut
    at its first character; the same "<" beginning anything else still stops there, and a "<" the
    output ends with stops too. Red (session 37's fix undone): the call was cut at "<"."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    for stops in (["<"], ["<t"], ["<tool_call"]):
        m = StopMatcher(set(), stops, exempt=("<tool_call>", "</tool_call>"))
        out, stopped = feed(m, ["Sure. ", "<", "tool", "_call>", call[11:20], call[20:]])
        assert ("".join(out), stopped) == ("Sure. " + call, False), stops
    m = StopMatcher(set(), ["<"], exempt=("<tool_call>", "</tool_call>"))
    assert feed(m, ["a ", "<", "b>"]) == (["a ", "", ""], True)
    m = StopMatcher(set(), ["<"], exempt=("<tool_call>", "</tool_call>"))
    assert "".join(feed(m, ["a ", "<"])[0]) == "a " and m.held == ""


def test_a_stop_inside_a_tool_call_leaves_the_call_whole():
    """The case itself: `stop: ["}"]` with a call's JSON arguments, fed a token at a time."""
    call = '<tool_call>\n{"name": "f", "arguments": {"a": {"b": 1}}}\n</tool_call>'
    m = StopMatcher(set(), ["}", "Obs"], exempt=("<tool_call>", "</tool_call>"))
    out, stopped = feed(m, [call[i : i + 3] for i in range(0, len(call), 3)] + ["\nObservation"])
    assert "".join(out) == call + "\n" and stopped


def test_before_min_tokens_no_stop_counts_but_one_that_completes_after_does():
    """vLLM's min_tokens: text pushed with `match=False` (before that many tokens are out) ends no row,
    even holding a whole stop string; a stop that begins there and completes after the boundary does
    (QA pass 15: "\nB" begun in the 4th token of a min_tokens 4 row was missed, and it ran to
    max_tokens). Red with the early text released whole (no tail held)."""
    m = StopMatcher(frozenset(), ["\nB"])
    assert m.push("A: 1\nB 2", match=False) == ("A: 1\nB 2", False)  # a whole stop before: ignored
    out, hit = m.push(" 3\n", match=False)
    assert (out, hit) == (" 3", False)  # "\n" may begin "\nB": held
    out, hit = m.push("B 4", match=True)
    assert (out, hit) == ("", True)


BARE_PAIRS = (("<tool_call>", "</tool_call>"), ('{"name": ', None))  # kvgate.server.tools.stop_regions, bare
BARE_CALL = '{"name": "f", "parameters": {"q": "END } {\\" END"}}'


def feed_final(matcher: StopMatcher, chunks: list[str]) -> tuple[str, bool]:
    out, stopped = feed(matcher, chunks)
    return "".join(out), stopped


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=8))
def test_a_bare_call_is_exempt_only_where_the_answer_starts(cuts):
    """Review of session 47: the bare region (`{"name": ` to the end of its JSON object) opened anywhere,
    so prose with an unbalanced `{"name": ` switched stop strings off for the rest of the output (stop
    "END" ran past 'Use {"name": "x as the key.\\nEND'). The grammar and the tool parser take a bare call
    only as the whole answer: at the output's start, or (the matcher sees a thinking model's reasoning
    too) at the first non-space after the first `</think>`. Whatever the chunks: the call there is
    whole, and a stop after it, or in prose that holds `{"name": `, cuts. Seen red with the opening
    matched anywhere (the prose cases ran on to the end), and with the `</think>` start dropped (the
    call after a think block was cut inside its arguments)."""

    from kvgate.server import reasoning, tools
    from kvgate.stop import THINK_CLOSE

    assert (tools.CALL_REGION, tools.BARE_REGION) == BARE_PAIRS and THINK_CLOSE == reasoning.CLOSE

    def chunked(text):
        at = sorted({0, len(text), *(c for c in cuts if c < len(text))})
        return [text[a:b] for a, b in zip(at, at[1:])]

    def before_first_end(text):
        return text[: text.index("END")]

    think = '<think>hm {"name": "q</think>\n \n'  # its `{"name": ` is no call: the answer starts later
    cases = [
        'Use {"name": "x as the key.\nEND and then much more',  # prose: the stop cuts
        'A: {"name": "a", "x": "END"} tail END',
        "<think>x</think>\nSure: " + BARE_CALL + " END",  # a call-like object inside the answer's prose
    ]
    for text in cases:
        assert feed_final(StopMatcher(set(), ["END"], BARE_PAIRS), chunked(text)) == (
            before_first_end(text),
            True,
        )
    for lead, after in [("", '\n{"name": "g '), (think, " "), ("ok</think>", " ")]:  # the answer's start
        text = lead + BARE_CALL + after + "END more"  # after the call, a `{"name": ` opens no second one
        got = feed_final(StopMatcher(set(), ["END"], BARE_PAIRS), chunked(text))
        assert got == (lead + BARE_CALL + after, True), text


def test_before_min_tokens_no_stop_counts_with_exempt_regions_either():
    """min_tokens with tools (every such request has exempt regions): `match=False` was skipped on the
    regions' path, so `stop: ["A"]` ended 'xA y' at "x" before min_tokens. Now no stop counts before it,
    one begun there and completed after does, and the regions are followed meanwhile (a call opened
    before min_tokens stays exempt after it). Seen red with the regions' path ignoring `match`
    ('xA y' gave ("x", True))."""
    assert StopMatcher(set(), ["A"], ("<tool_call>", "</tool_call>")).push("xA y", match=False) == (
        "xA y",
        False,
    )
    for pairs in (("<tool_call>", "</tool_call>"), BARE_PAIRS):
        m = StopMatcher(set(), ["\nB"], pairs)
        assert m.push("A: 1\nB 2", match=False) == ("A: 1\nB 2", False)
        assert m.push(" 3\n", match=False) == (" 3", False)  # "\n" may begin "\nB": held
        assert m.push("B 4") == ("", True)
    m = StopMatcher(set(), ["}"], BARE_PAIRS)
    assert m.push('{"name": "f", "par', match=False) == ('{"name": "f", "par', False)
    assert m.push('ameters": {}}\n}') == ('ameters": {}}\n', True)  # the call whole, the stop after it cuts
