"""Parity with transformers on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

transformers reads the same GGUF with its own code (its own dequantization call, its own inverse of
llama.cpp's q/k permutation, its own Llama forward), so agreeing with it checks our converter, our
RoPE and our paged-attention forward together. Both sides run in float32 and are fed the SAME token
ids: our tokenizer isolates digits before the GPT-2 split like llama.cpp's `smollm` pre-tokenizer (and
SmolLM2's own tokenizer.json), while transformers' GGUF tokenizer does not, which changes the ids of
some text with digits; tokenization is compared separately on digit-free text.

transformers refuses GGUF files unless `accelerate` is importable, although its plain CPU float32
path never uses it; kvgate does not depend on accelerate, so the check is bypassed for this load.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from kvgate.config import EngineConfig
from kvgate.models import load_model, resolve_model_path
from kvgate.models.llama import LlamaModel
from kvgate.request import GenerationRequest
from kvgate.sampling import SamplingParams
from kvgate.tokenizer import TextTokenizer
from tests.tiny_gguf import prompt_logits

pytestmark = pytest.mark.slow

LOGIT_ATOL = 5e-4  # float32 on both sides: seen up to 7e-5 on logits that span about +-40
GREEDY_STEPS = 32
PROMPTS = {
    "story": "Once upon a time",
    "digits": "In 2024, 3 of the 17 cats (about 18%) ate 1,250 grams of fish.",
    "long": (
        "The mitochondria is the powerhouse of the cell. It produces energy through a process called "
        "cellular respiration, which turns glucose and oxygen into carbon dioxide, water and ATP. "
        "Scientists have studied this organelle for more than a century, and"
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread for this module: on the shared 2-core machine two spinning OpenMP threads
    made these forwards 4-8x slower whenever anything else ran; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def parse_once():
    """The GGUF is parsed once (gguf.GGUFReader memoized) for transformers' config, weights and
    tokenizer loads and, on a cold cache, our conversion: each parse of this file takes seconds."""
    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=2)(gguf.GGUFReader))
        yield


@pytest.fixture(scope="module")
def hf(parse_once):
    """transformers' model and tokenizer for the default GGUF, loaded once for the module."""
    import transformers
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_accelerate_available

    path = resolve_model_path("default")
    transformers.utils.logging.disable_progress_bar()
    with pytest.MonkeyPatch.context() as mp:
        if not is_accelerate_available():
            mp.setattr(transformers.modeling_utils, "is_accelerate_available", lambda *a, **k: True)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model.eval()
    return model, tok


@pytest.fixture(scope="module")
def ours(parse_once):
    loaded = load_model("default")
    tok = TextTokenizer(loaded.tokenizer)
    return LlamaModel(loaded.spec, loaded.weights, torch.float32, "cpu"), tok


@pytest.fixture(scope="module")
def engine():
    from kvgate.core.engine import Engine

    cfg = EngineConfig(dtype="float32", kv_dtype="float32", memory_limit="3GiB")  # float32 throughout
    e = Engine.from_model("default", cfg).start()
    yield e
    e.shutdown()


def engine_greedy(engine, ids: list[int], n: int):
    req = GenerationRequest(list(ids), SamplingParams(temperature=0), max_tokens=n, ignore_eos=True)
    return engine.generate(req, timeout=300)


@pytest.fixture(scope="module")
def greedy_runs(ours, engine):
    """Our greedy generations, GREEDY_STEPS tokens each, for the story and the chat prompt."""
    tok = ours[1]
    prompts = {"story": tok.encode(PROMPTS["story"]), "chat": chat_prompt(tok)}
    return {name: (ids, engine_greedy(engine, ids, GREEDY_STEPS)) for name, ids in prompts.items()}


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, with its KV cache (`cache` in 5.x, `past_key_values` before)."""
    new_api = "cache" in inspect.signature(model.forward).parameters
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        kv = out["cache"] if new_api else out["past_key_values"]
        out = model(
            torch.tensor([[tokens[-1]]]), use_cache=True, **{"cache" if new_api else "past_key_values": kv}
        )
    return tokens


def chat_prompt(tok: TextTokenizer) -> list[int]:
    return tok.chat_ids([{"role": "user", "content": "Name three primary colors and one use for each."}])


@pytest.mark.parametrize("name", [*PROMPTS, "chat"])
def test_float32_logits_match_transformers_at_every_position(hf, ours, name):
    """Seen to fail when the converter skips the q/k unpermute, when RoPE uses the wrong theta, and
    when rms_norm_eps is ignored (1e-6)."""
    model, tok = ours
    ids = chat_prompt(tok) if name == "chat" else tok.encode(PROMPTS[name])
    mine = prompt_logits(model, ids)
    with torch.inference_mode():
        theirs = hf[0](torch.tensor([ids])).logits[0].float()
    assert mine.shape == theirs.shape
    diff = float((mine - theirs).abs().max())
    assert diff < LOGIT_ATOL, f"max |logit difference| {diff:.2e} over {len(ids)} positions"
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("name", ["story", "chat"])
def test_greedy_tokens_through_the_engine_match_transformers_for_32_steps(hf, greedy_runs, name):
    """Decode runs over the paged KV cache, one token a step, through scheduler and sampler.

    Seen to fail when the decode path writes K/V one slot off (prefill logits still agree).
    """
    ids, result = greedy_runs[name]
    assert len(result.token_ids) == GREEDY_STEPS
    assert result.token_ids == hf_greedy(hf[0], ids, GREEDY_STEPS)


def test_greedy_once_upon_a_time_continues_with_nova_haven(greedy_runs):
    """The canonical smoke check: no chat template and no BOS (add_bos_token is false).

    Seen to fail when BOS is always prepended, and when the GGUF's q/k rows are left permuted.
    """
    ids, result = greedy_runs["story"]
    assert ids == [6403, 1980, 253, 655]
    assert result.text.startswith(", the city of Nova Haven was a thriving metropolis"), result.text


DIGIT_FREE = [
    "Once upon a time",
    "Hello, world! How's it going? I'm fine; you'll see, we'd've known.",
    "  leading spaces, trailing spaces  \n\nnew lines\tand tabs\r\n",
    "naïve café, 你好世界, emoji 🙂👍🏽, Ελληνικά",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** two  # code, symbols: {}[]()<>!?@#$%^&*",
]


def test_tokenization_of_digit_free_text_matches_transformers(hf, ours):
    """Seen to fail when control tokens are not special (<|im_start|> split into pieces), and when the
    GPT-2 split regex is replaced by whitespace splitting."""
    tok = ours[1]
    for text in DIGIT_FREE:
        assert tok.encode(text) == hf[1](text, add_special_tokens=False).input_ids, text


def test_digits_are_split_off_before_the_gpt2_split_like_llama_cpp_smollm(hf, ours):
    """llama.cpp's `smollm` pre-tokenizer (like SmolLM2's own tokenizer.json) isolates every digit
    first, so the GPT-2 regex never sees what follows a run of spaces: "\n\n " stays one token.
    transformers' GGUF tokenizer runs the GPT-2 regex over the whole text and splits " " off.

    Seen to fail when the `smollm` pre-tokenizer drops the individual-digit split.
    """
    tok = ours[1]
    text = "x\n\n 12 "
    ids = tok.encode(text)
    assert [tok.decode([i]) for i in ids] == ["x", "\n\n ", "1", "2", " "]
    assert ids != hf[1](text, add_special_tokens=False).input_ids  # why parity is checked on ids
    digits = [
        p for p in (tok.decode([i]) for i in tok.encode("year 2024, code 98765")) if p.strip().isdigit()
    ]
    assert digits == list("202498765")
