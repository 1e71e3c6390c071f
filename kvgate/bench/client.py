"""One OpenAI-compatible server as the load generator sees it: `Target`.

It resolves the model name (`/v1/models` when none is given), counts tokens with whatever tokenize
endpoint the server offers (kvgate/vLLM `/v1/tokenize` or `/tokenize`, llama.cpp, llama-cpp-python;
none: counting is unavailable), negotiates the request extras that force the output length
(`ignore_eos`, `min_tokens`, stream usage) with short warm-up requests, and sends a streaming
request into a `RequestRecord`, timing TTFT, ITL and E2E. `send` never raises for HTTP or
network errors: they are recorded. httpx is imported only when a `Target` is made.
"""

from __future__ import annotations

import json
import time

from kvgate.bench.records import Prompt, RequestRecord


def root_url(base_url: str) -> str:
    u = base_url.rstrip("/")
    return u[: -len("/v1")] if u.endswith("/v1") else u


class Target:
    """One OpenAI-compatible server: URLs, model name, negotiated request extras, token counting."""

    def __init__(self, base_url: str, endpoint: str, model: str | None, api_key: str | None, timeout: float):
        import httpx

        self.root = root_url(base_url)
        self.endpoint = endpoint
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.extras: dict = {}
        self.eos_mode = "none"
        self.tokenize_url: str | None = None
        self.tokenize_kind: str | None = None
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
            headers=self.headers,
        )

    @property
    def url(self) -> str:
        return self.root + ("/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions")

    async def close(self) -> None:
        await self.client.aclose()

    async def resolve_model(self) -> str:
        if self.model:
            return self.model
        r = await self.client.get(self.root + "/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"{self.root}/v1/models lists no model; pass --model")
        self.model = data[0]["id"]
        return self.model

    # -- token counting --
    async def count_tokens(self, text: str) -> int | None:
        """Tokens the server will see for this prompt (chat: with its template), or None if it can't say."""
        if self.tokenize_kind is None:
            await self._find_tokenizer()
        if self.tokenize_kind == "none":
            return None
        return await self._tokenize(self.tokenize_kind, text)

    async def _find_tokenizer(self) -> None:
        for kind in ("v1", "vllm", "llamacpp", "llama-cpp-python"):
            try:
                n = await self._tokenize(kind, "hello world")
            except Exception:
                n = None
            if n:
                self.tokenize_kind = kind
                return
        self.tokenize_kind = "none"

    async def _tokenize(self, kind: str, text: str) -> int | None:
        msgs = [{"role": "user", "content": text}]
        if kind in ("v1", "vllm"):
            body = {"model": self.model}
            body.update({"messages": msgs} if self.endpoint == "chat" else {"prompt": text})
            url = self.root + ("/v1/tokenize" if kind == "v1" else "/tokenize")
        elif kind == "llamacpp":
            if self.endpoint == "chat":
                return None
            body, url = {"content": text, "add_special": True}, self.root + "/tokenize"
        else:
            if self.endpoint == "chat":
                return None
            body, url = {"input": text, "model": self.model}, self.root + "/extras/tokenize"
        r = await self.client.post(url, json=body, timeout=30)
        if r.status_code != 200:
            return None
        j = r.json()
        if isinstance(j.get("count"), int):
            return j["count"]
        toks = j.get("tokens")
        return len(toks) if isinstance(toks, list) else None

    # -- request bodies --
    def body(self, p: Prompt, max_tokens: int | None, temperature: float, extras: dict | None = None) -> dict:
        b: dict = {"model": self.model, "stream": True, "temperature": temperature}
        if self.endpoint == "chat":
            b["messages"] = p.messages or [{"role": "user", "content": p.text or ""}]
        else:
            b["prompt"] = p.text if p.text is not None else _messages_text(p.messages)
        if max_tokens is not None:
            b["max_tokens"] = max_tokens
        ex = self.extras if extras is None else extras
        for k, v in ex.items():
            b[k] = max_tokens if v == "$max_tokens" else v
        if max_tokens is None:
            b.pop("min_tokens", None)
            b.pop("ignore_eos", None)
        return b

    async def negotiate(self, eos_mode: str, usage: bool, extra_body: dict, temperature: float) -> None:
        """Pick the request extras the server accepts (one short warm-up request per candidate).

        auto: ignore_eos + min_tokens (vLLM, llama.cpp servers ignore what they don't know), then
        ignore_eos alone (kvgate refuses unknown fields), then min_tokens alone, then nothing.
        """
        usage_ex = {"stream_options": {"include_usage": True}} if usage else {}
        modes = {
            "auto": [
                ("ignore_eos+min_tokens", {"ignore_eos": True, "min_tokens": "$max_tokens"}),
                ("ignore_eos", {"ignore_eos": True}),
                ("min_tokens", {"min_tokens": "$max_tokens"}),
                ("none", {}),
            ],
            "ignore_eos": [("ignore_eos", {"ignore_eos": True})],
            "min_tokens": [("min_tokens", {"min_tokens": "$max_tokens"})],
            "none": [("none", {})],
        }[eos_mode]
        candidates = [(n, {**ex, **usage_ex, **extra_body}) for n, ex in modes]
        if usage:
            candidates += [(n + " (no usage)", {**ex, **extra_body}) for n, ex in modes]
        last = None
        probe = Prompt(text="Say hello.")
        for name, ex in candidates:
            rec = RequestRecord(index=-1, sent_at=0.0)
            await self.send(rec, probe, 2, temperature, ex, time.perf_counter())
            if rec.status == 200:
                self.extras, self.eos_mode = ex, name
                return
            last = rec
            if rec.status not in (400, 422):
                break
        raise RuntimeError(
            f"warm-up request to {self.url} failed: status {last.status if last else '?'} "
            f"{(last.error or '')[:300] if last else ''}"
        )

    async def send(
        self,
        rec: RequestRecord,
        p: Prompt,
        max_tokens: int | None,
        temperature: float,
        extras: dict | None,
        t_run0: float,
    ) -> None:
        """Send one streaming request and fill `rec` (never raises for HTTP or network errors)."""
        import httpx

        body = self.body(p, max_tokens, temperature, extras)
        rec.requested_output = max_tokens
        rec.prompt_tokens = p.prompt_tokens
        t0 = time.perf_counter()
        rec.sent_at = t0 - t_run0
        last = None
        try:
            async with self.client.stream("POST", self.url, json=body) as r:
                rec.status = r.status_code
                if r.status_code != 200:
                    rec.retry_after = r.headers.get("retry-after")
                    raw = (await r.aread()).decode("utf-8", "replace")
                    rec.error = raw[:500]
                    try:
                        err = json.loads(raw).get("error")
                        rec.error_code = (err or {}).get("code") if isinstance(err, dict) else None
                    except (ValueError, AttributeError):
                        pass
                    return
                chunks = 0
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        continue
                    if "error" in obj:
                        rec.error = json.dumps(obj["error"])[:500]
                        err = obj["error"]
                        rec.error_code = err.get("code") if isinstance(err, dict) else None
                        continue
                    if obj.get("usage"):
                        u = obj["usage"]
                        if u.get("completion_tokens") is not None:
                            rec.output_tokens = u["completion_tokens"]
                            rec.tokens_from_usage = True
                        if u.get("prompt_tokens"):
                            rec.prompt_tokens = u["prompt_tokens"]
                    for ch in obj.get("choices") or []:
                        text = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                        now = time.perf_counter()
                        if text:
                            chunks += 1
                            if last is None:
                                rec.ttft_ms = (now - t0) * 1000
                            else:
                                rec.itl_ms.append((now - last) * 1000)
                            last = now
                        if ch.get("finish_reason"):
                            rec.finish_reason = ch["finish_reason"]
                rec.e2e_ms = (time.perf_counter() - t0) * 1000
                if not rec.tokens_from_usage:
                    rec.output_tokens = chunks
                rec.ok = (
                    rec.error is None
                    and (done or rec.finish_reason is not None)
                    and rec.finish_reason != "error"
                )
                if not rec.ok and rec.error is None:
                    rec.error = "stream ended without finish_reason or [DONE]"
        except httpx.HTTPError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:500]
            rec.e2e_ms = (time.perf_counter() - t0) * 1000


def _messages_text(messages: list | None) -> str:
    return "\n".join(str(m.get("content", "")) for m in messages or [])
