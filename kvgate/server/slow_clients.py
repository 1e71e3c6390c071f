"""Deadlines for receiving a request, so clients that never finish sending one cannot hold connections.

uvicorn times a connection out only between requests (`timeout_keep_alive`): a client that opens a
connection and sends nothing, part of a request head, or a head and then less body than its
Content-Length held the connection (a file descriptor, a slot) for good, and a few hundred such
clients used them all up (slowloris). As nginx's client_header_timeout and client_body_timeout do:

- the request head (request line and headers) must be complete `head_seconds` after the connection
  opened or the head's first byte came (a client trickling header bytes does not reset the clock);
- while the body is incomplete, `body_idle_seconds` without a byte of it end the request;
- a response its client takes nothing of for `send_stall_seconds` (the socket's buffers full all that
  time) is cut (nginx's send_timeout): what the server keeps for it until it is sent, a whole answer's
  logprobs among them (reserved, kvgate.core.logprob_budget), goes back (QA pass 10: 5.6 MB held for
  as long as a client that read nothing kept its socket open).

A timed-out head or body gets a 408 (JSON, kvgate's error shape, `Connection: close`); a connection
that sent nothing is closed without a response, as uvicorn's keep-alive timeout does. The clocks stop
whenever it is not the client's turn: while kvgate's answer to an earlier request on the connection
is under way (a minutes-long SSE stream), while uvicorn has paused reading (the app has not taken the
body it has) and while the client waits for `100 Continue`. Nothing here writes to or closes a
connection whose response has started and not finished.

Applied to the HTTP/1.1 protocol uvicorn's `http="auto"` picks: httptools where it is installed
(uvicorn[standard], ray[serve]), else h11 (a plain `pip install kvgate`).
"""

from __future__ import annotations

import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: uvicorn's "auto" is h11
    HttpToolsProtocol = None

REQUEST_HEAD_SECONDS = 30.0  # nginx's client_header_timeout is 60 s; uvicorn's keep-alive here is 30 s
REQUEST_BODY_IDLE_SECONDS = 30.0  # nginx's client_body_timeout (between two reads) is 60 s
RESPONSE_STALL_SECONDS = 60.0  # nginx's send_timeout: a client that takes nothing of its response this long
LATE_SECONDS = 1.0  # a timer this late means the loop was busy: look again before blaming the client

log = logging.getLogger("kvgate.serve")
_off: list = []  # holds the error once the deadlines could not read uvicorn's state (then they stay off)


def _switch_off(exc: Exception) -> None:
    """The deadlines read uvicorn's protocol state (its parser's and its cycle's attributes), which is not
    public API: if a uvicorn release moves it, serving goes on without them, logged once."""
    if not _off:
        _off.append(exc)
        log.warning(
            "request deadlines off: uvicorn's HTTP protocol state is not what kvgate.server.slow_clients "
            "reads (%s: %s); slow clients are not timed out. Install the uvicorn version kvgate is tested "
            "with, or report it.",
            type(exc).__name__,
            exc,
        )


class _RequestDeadlines:
    """Mixin over a uvicorn HTTP protocol; `_phase()` says where the current request stands."""

    head_seconds = REQUEST_HEAD_SECONDS
    body_idle_seconds = REQUEST_BODY_IDLE_SECONDS
    send_stall_seconds = RESPONSE_STALL_SECONDS
    _kv_timer = None
    _kv_stall = None  # the send-stall timer, while the transport's buffer is full
    _kv_due = 0.0
    _kv_body_bytes = 0  # of the request whose body is being received

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._kv_arm(self.head_seconds)  # a client that sends nothing at all is closed too

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing() or _off:
            return
        try:
            self._kv_data()
        except Exception as exc:  # uvicorn's internals moved: serve on without deadlines, and say so
            _switch_off(exc)
            self._kv_cancel()

    def _kv_data(self) -> None:
        phase = self._phase()
        if phase == "body":  # any byte of the body restarts its idle clock
            self._kv_arm(self.body_idle_seconds)
        elif phase == "received":  # the request is all here: the app's turn
            self._kv_cancel()
        elif self._kv_timer is None:  # a head began: its clock runs from here and is not reset
            self._kv_arm(self.head_seconds)

    def connection_lost(self, exc) -> None:
        self._kv_cancel()
        self._kv_unstall()
        super().connection_lost(exc)

    # ---- a response its client stopped reading ----------------------------------------------------
    def pause_writing(self) -> None:
        """The transport's buffer is full: the client reads nothing. Past `send_stall_seconds` of that
        the connection is cut, so a response nobody takes does not hold its memory (the server keeps a
        whole logprobs body's values until it is sent: their reservation, kvgate.core.logprob_budget)."""
        super().pause_writing()
        if not _off and self._kv_stall is None:
            self._kv_stall = self.loop.call_later(self.send_stall_seconds, self._kv_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._kv_unstall()

    def _kv_unstall(self) -> None:
        if self._kv_stall is not None:
            self._kv_stall.cancel()
            self._kv_stall = None

    def _kv_stalled(self) -> None:
        self._kv_stall = None
        try:
            if self.flow.write_paused and not self.transport.is_closing():
                client = self._kv_client()
                log.info(
                    "%s: closed: it read nothing of its response for %g s", client, self.send_stall_seconds
                )
                self.transport.abort()  # its buffer will never drain: close() would wait for it
        except Exception as exc:
            _switch_off(exc)

    def _kv_client(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    def _kv_arm(self, seconds: float) -> None:
        self._kv_cancel()
        if _off:
            return
        self._kv_due = self.loop.time() + seconds
        self._kv_timer = self.loop.call_later(seconds, self._kv_expired)

    def _kv_cancel(self) -> None:
        if self._kv_timer is not None:
            self._kv_timer.cancel()
            self._kv_timer = None

    def _kv_expired(self) -> None:
        self._kv_timer = None
        try:
            self._kv_judge()
        except Exception as exc:
            _switch_off(exc)

    def _kv_judge(self) -> None:
        if (
            _off or self.transport.is_closing() or self.transport.get_protocol() is not self
        ):  # closed, or upgraded
            return
        phase, cycle = self._phase(), self.cycle
        pending = cycle is not None and not cycle.response_complete  # an answer not (all) sent yet
        if phase == "received":
            return
        if (
            self.loop.time() - self._kv_due > LATE_SECONDS
            or self.flow.read_paused
            or (phase == "body" and (self._client_waits() or (pending and cycle.response_started)))
            or (phase != "body" and pending)
        ):  # not the client's turn, or not known to be: look again later
            self._kv_arm(self.body_idle_seconds if phase == "body" else self.head_seconds)
            return
        if phase == "idle":  # nothing of a request came: close quietly, as the keep-alive timeout does
            self.transport.close()
            return
        if phase == "body" and not pending:  # answered without reading it all: nothing more to say
            self.transport.close()
            return
        if phase == "head":
            seconds = self.head_seconds
            what = f"the request head (request line and headers) was still incomplete after {seconds:g} s"
            extra = {}
        else:
            seconds, declared = self.body_idle_seconds, dict(self.headers).get(b"content-length")
            got = self._kv_body_bytes
            declared = int(declared) if declared and declared.isdigit() else None
            of = f" of the {declared} bytes its Content-Length announced" if declared is not None else ""
            what = f"the request body stopped arriving: {got} bytes{of} came, then nothing for {seconds:g} s"
            extra = {"body_bytes_received": got}
            if declared is not None:
                extra["content_length"] = declared
            cycle.disconnected = True  # the app's receive() says http.disconnect; its send() is dropped
            cycle.message_event.set()
        message = (
            f"request timeout: {what}. kvgate closes connections that send a request this slowly, so "
            f"they cannot hold its connections; send the whole request without pausing {seconds:g} s "
            "(and as many body bytes as Content-Length says)."
        )
        err = {"message": message, "type": "invalid_request_error", "code": "request_timeout", "param": None}
        body = json.dumps({"error": {**err, "timeout_seconds": seconds, **extra}}).encode()
        client = self._kv_client()
        log.info("%s: 408: %s", client, what)  # info: a slowloris is many
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


class _HttpToolsDeadlines(_RequestDeadlines, HttpToolsProtocol or H11Protocol):  # (unused without httptools)
    _kv_state = "idle"  # set by the parser's callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._kv_state, self._kv_body_bytes = "head", 0

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._kv_state = "body"

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._kv_body_bytes += len(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._kv_state = "received"

    def _phase(self) -> str:
        if self._kv_state == "received" and (self.cycle is None or self.cycle.response_complete):
            return "idle"  # answered; what came since has not begun a request
        return self._kv_state

    def _client_waits(self) -> bool:
        return bool(getattr(self.cycle, "waiting_for_100_continue", False))


class _H11Deadlines(_RequestDeadlines, H11Protocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        next_event = getattr(getattr(self, "conn", None), "next_event", None)
        if next_event is None:
            _switch_off(AttributeError("H11Protocol.conn.next_event"))
            return

        def counted():  # h11 has no callback for body bytes: count them as uvicorn takes them
            event = next_event()
            if isinstance(event, h11.Request):
                self._kv_body_bytes = 0
            elif isinstance(event, h11.Data):
                self._kv_body_bytes += len(event.data)
            return event

        self.conn.next_event = counted

    def _phase(self) -> str:
        state, buffered = self.conn.their_state, self.conn.trailing_data[0]
        if state is h11.SEND_BODY:
            return "body"
        if state in (h11.IDLE, h11.DONE) and buffered:  # DONE: a pipelined request's head, waiting
            return "head"
        return "idle" if state is h11.IDLE else "received"

    def _client_waits(self) -> bool:
        return self.conn.they_are_waiting_for_100_continue


def guarded_http_protocol(
    head_seconds: float | None = None,
    body_idle_seconds: float | None = None,
    kind: str = "auto",
    send_stall_seconds: float | None = None,
):
    """uvicorn's HTTP/1.1 protocol class with the request deadlines, for `uvicorn.Config(http=...)`:
    `kind` "auto" is what uvicorn's `http="auto"` picks (httptools if installed, else h11); tests pass
    short deadlines and each kind."""
    if kind == "auto":
        kind = "h11" if HttpToolsProtocol is None else "httptools"
    if kind == "httptools" and HttpToolsProtocol is None:
        raise ValueError("httptools is not installed: pass kind='h11' or 'auto'")
    base = _H11Deadlines if kind == "h11" else _HttpToolsDeadlines
    fields = {}
    if head_seconds is not None:
        fields["head_seconds"] = head_seconds
    if body_idle_seconds is not None:
        fields["body_idle_seconds"] = body_idle_seconds
    if send_stall_seconds is not None:
        fields["send_stall_seconds"] = send_stall_seconds
    return type(base.__name__.lstrip("_"), (base,), fields) if fields else base
