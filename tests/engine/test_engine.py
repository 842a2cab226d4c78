"""Engine surface: validation, abort, stop conditions, threads, stats, tokenizers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.llm import LLM
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import ContextLengthExceededError, InvalidRequestError
from tests.engine.reference import hf_greedy


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                               max_model_len=64, num_kv_blocks=32))


def _drain(engine: Engine) -> dict[str, object]:
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    return outs


@pytest.mark.parametrize(
    ("prompt", "params", "error", "needle"),
    [
        pytest.param(list(range(3, 70)), {}, ContextLengthExceededError, "max_model_len",
                     id="too-long"),
        pytest.param([], {}, InvalidRequestError, "empty", id="empty"),
        pytest.param([5, 512], {}, InvalidRequestError, "token ids", id="outside-vocab"),
        pytest.param([5, -1], {}, InvalidRequestError, "token ids", id="negative-id"),
        pytest.param("hello", {}, InvalidRequestError, "tokenizer", id="text-without-tokenizer"),
    ],
)
def test_bad_prompt_is_refused_by_name_and_others_are_unaffected(
    engine: Engine, prompt: object, params: dict[str, object], error: type[Exception],
    needle: str,
) -> None:
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(error, match=needle):
        engine.add_request("bad", prompt, SamplingParams(**params))  # type: ignore[arg-type]
    assert isinstance(error(), ValueError)
    outs = _drain(engine)
    assert set(outs) == {"good"}
    assert len(outs["good"].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0),
     ("top_k", -2), ("min_p", 2.0)],
)
def test_bad_sampling_parameter_raises_value_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_duplicate_request_id_is_refused(engine: Engine) -> None:
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    _drain(engine)


def test_pool_too_small_for_one_max_length_sequence_names_the_largest_that_fits(
    tiny_llama_dir: Path,
) -> None:
    with pytest.raises(ValueError, match=r"largest max_model_len that fits is 64"):
        Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                            max_model_len=128, num_kv_blocks=4, block_size=16))


def test_abort_finishes_a_request_with_reason_abort(engine: Engine) -> None:
    engine.add_request("long", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request("short", [8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    engine.abort("long")
    outs = _drain(engine)
    assert outs["long"].outputs[0].finish_reason == "abort"
    assert outs["short"].outputs[0].finish_reason == "length"
    assert engine.stats()["kv_blocks_used"] == 0


def test_stop_token_ids_and_max_model_len_end_sequences(
    engine: Engine, tiny_llama_dir: Path
) -> None:
    prompt = [5, 6, 7, 8]
    expected = hf_greedy(tiny_llama_dir, prompt, 6)
    engine.add_request("stop-id", prompt, SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True,
                                                          stop_token_ids=[expected[2]]))
    engine.add_request("to-limit", list(range(3, 61)), SamplingParams(
        temperature=0, max_tokens=None, ignore_eos=True))
    outs = _drain(engine)
    stop = outs["stop-id"].outputs[0]
    cut = expected.index(expected[2]) + 1
    assert stop.token_ids == expected[:cut] and stop.finish_reason == "stop"
    assert stop.stop_reason == expected[2]
    limit = outs["to-limit"].outputs[0]
    assert len(limit.token_ids) == 64 - 58 and limit.finish_reason == "length"


def test_eos_stops_unless_ignored(engine: Engine, tiny_llama_dir: Path) -> None:
    engine.add_request("eos", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6))
    outs = _drain(engine)
    tokens = outs["eos"].outputs[0].token_ids
    assert 2 not in tokens[:-1]
    if tokens[-1] == 2:
        assert outs["eos"].outputs[0].finish_reason == "stop"


def test_requests_added_from_another_thread_are_served(engine: Engine) -> None:
    def producer() -> None:
        for i in range(5):
            engine.add_request(f"t{i}", [5 + i, 6], SamplingParams(max_tokens=3, ignore_eos=True))

    thread = threading.Thread(target=producer)
    thread.start()
    thread.join()
    outs = _drain(engine)
    assert sorted(outs) == [f"t{i}" for i in range(5)]


def test_stats_report_the_documented_keys(engine: Engine) -> None:
    stats = engine.stats()
    for key in ("num_kv_blocks", "block_size", "kv_blocks_used", "kv_cache_usage_perc",
                "num_free_blocks", "prefix_cache_queries", "prefix_cache_hits",
                "num_preemptions", "prompt_tokens", "generation_tokens",
                "num_requests_running", "num_requests_waiting", "waiting_prompt_blocks",
                "max_model_len", "max_num_seqs", "max_concurrent_full_length_seqs"):
        assert key in stats
    assert stats["num_kv_blocks"] == 32 and stats["max_concurrent_full_length_seqs"] == 8
    engine.add_request("queued", [5, 6, 7], SamplingParams(max_tokens=1))
    queued = engine.stats()
    assert queued["num_requests_waiting"] == 1 and queued["waiting_prompt_blocks"] == 1
    _drain(engine)


def test_token_prompts_work_without_a_tokenizer_and_text_is_empty(engine: Engine) -> None:
    assert engine.tokenizer is None
    engine.add_request("ids", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    out = _drain(engine)["ids"]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 2


def test_text_prompts_stop_strings_and_chat_with_a_tokenizer(tiny_chat_model_dir: Path) -> None:
    llm = LLM(str(tiny_chat_model_dir), dtype="float32", device="cpu", max_model_len=256,
              num_kv_blocks=32)
    (free,) = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=12,
                                                           ignore_eos=True), use_tqdm=False)
    text = free.outputs[0].text
    assert free.prompt == "Hello there" and text
    assert text == llm.tokenizer.decode(free.outputs[0].token_ids, skip_special_tokens=True) or (
        text.strip() == llm.tokenizer.decode(free.outputs[0].token_ids,
                                             skip_special_tokens=True).strip()
    )
    stop = text.strip()[3:6]
    (cut,) = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=12,
                                                          ignore_eos=True, stop=[stop]),
                          use_tqdm=False)
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert stop not in cut.outputs[0].text
    assert text.startswith(cut.outputs[0].text)
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}],
                       SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    template = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.prompt_token_ids == llm.tokenizer.encode(template, add_special_tokens=False)


def test_generate_validates_every_prompt_before_running_any(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=64,
              num_kv_blocks=8)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[5, 6], []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    (out,) = llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_cpu_pool_is_sized_from_kv_cache_memory_and_capped(tiny_llama_dir: Path) -> None:
    # tiny llama: 2 layers x 2 kv heads x 16 head_dim x 16 tokens x 4 bytes x (K+V) = 8 KiB
    sized = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                                max_model_len=64, kv_cache_memory=100 * 8192))
    assert sized.stats()["num_kv_blocks"] == 100
    assert sized.stats()["max_concurrent_full_length_seqs"] == 25
    capped = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                                 max_model_len=64, max_num_seqs=4))
    assert capped.stats()["num_kv_blocks"] == 2 * 4 * 4


def test_bad_engine_settings_are_refused_by_name(tiny_llama_dir: Path) -> None:
    for field, value in (("block_size", 12), ("preemption_mode", "drop"),
                         ("attention_backend", "cuda"), ("dtype", "int8")):
        with pytest.raises(ValueError, match=field if field != "attention_backend" else "cuda"):
            Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=8,
                                max_model_len=64, **{field: value}))


def test_cpu_engine_leaves_a_core_to_the_worker_unless_told(tiny_llama_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from qworker.engine import engine_setup

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(engine_setup.os, "sched_getaffinity", lambda _: {0, 1, 2, 3},
                            raising=False)
        assert engine_setup.default_cpu_threads() == 3
        monkeypatch.setattr(engine_setup.os, "sched_getaffinity", lambda _: {0}, raising=False)
        assert engine_setup.default_cpu_threads() == 1
        Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=8,
                            max_model_len=64))
        assert torch.get_num_threads() == 1
        Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=8,
                            max_model_len=64, cpu_threads=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_queue_time_ends_when_blocks_are_given_not_at_the_first_token(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    execute = engine.runner.execute

    def slow_execute(*args: object, **kwargs: object) -> object:
        time.sleep(0.05)  # the forward lies between scheduling and the first token
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    engine.add_request("q", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=2))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    m = outs[0].metrics
    assert m.first_scheduled_time is not None and m.first_token_time is not None
    assert m.arrival_time <= m.first_scheduled_time
    assert m.first_token_time - m.first_scheduled_time >= 0.05
