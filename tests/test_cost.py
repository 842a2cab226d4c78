"""`qworker cost`: arithmetic, throughput from bench JSON and live metrics, bad input."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qworker import cost


def _json_line(capsys: pytest.CaptureFixture[str]) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_cost_row_prices_a_million_tokens_and_a_thousand_jobs() -> None:
    # 1000 tok/s on a $3.60/h GPU: 3.6M tokens per hour for $3.60 -> $1 per million.
    row = cost.cost_row("x", "spot", 1, 3.6, 1000.0, input_tokens=800, output_tokens=150)
    assert row.usd_per_million_output_tokens == pytest.approx(1.0)
    assert row.seconds_per_job == pytest.approx(0.15)
    # 1000 jobs x 0.15 s = 150 s at $0.001/s.
    assert row.usd_per_1000_jobs == pytest.approx(0.15)


def test_gpus_and_utilization_scale_instance_throughput() -> None:
    row = cost.cost_row("x", "spot", 8, 28.8, 1000.0, 0, 100, utilization=0.5)
    assert row.instance_tokens_per_second == pytest.approx(4000.0)
    assert row.usd_per_million_output_tokens == pytest.approx(28.8 / (4000 * 3600) * 1e6)


def test_prefill_rate_adds_prompt_time_per_job() -> None:
    base = cost.cost_row("x", "spot", 1, 3.6, 1000.0, 2000, 100)
    with_prefill = cost.cost_row(
        "x", "spot", 1, 3.6, 1000.0, 2000, 100, prefill_tokens_per_second=10000.0
    )
    assert with_prefill.seconds_per_job == pytest.approx(base.seconds_per_job + 0.2)
    assert with_prefill.usd_per_million_output_tokens == base.usd_per_million_output_tokens


def test_managed_price_counts_input_and_output_tokens() -> None:
    m = cost.ManagedPrice("m", 0.075, 0.30, "test")
    assert cost.managed_usd_per_1000_jobs(m, 800, 150) == pytest.approx(0.105)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tokens_per_second": 0.0}, "tokens_per_second"),
        ({"usd_per_hour": -1.0}, "usd_per_hour"),
        ({"gpus": 0}, "gpus"),
        ({"utilization": 1.5}, "utilization"),
        ({"output_tokens": 0}, "output_tokens"),
    ],
)
def test_cost_row_rejects_impossible_values_naming_the_field(kwargs: dict, field: str) -> None:
    args = {
        "instance": "x", "capacity": "spot", "gpus": 1, "usd_per_hour": 1.0,
        "tokens_per_second": 100.0, "input_tokens": 10, "output_tokens": 10,
    }
    args.update(kwargs)
    with pytest.raises(cost.CostInputError, match=field):
        cost.cost_row(**args)


def test_bench_reader_takes_known_key_from_last_json_line() -> None:
    text = "name  tok/s\nqworker 812.5\n" + json.dumps({"output_tokens_per_second": 812.5}) + "\n"
    assert cost.tokens_per_second_from_bench(cost.last_json_object(text)) == 812.5


def test_bench_reader_finds_single_nested_candidate_and_skips_prompt_rates() -> None:
    record = {"engine": {"gen_tok_s": 640.0, "prompt_tok_s": 9000.0}, "batch": 64}
    assert cost.tokens_per_second_from_bench(record) == 640.0


def test_bench_reader_asks_for_a_field_when_several_rates_compete() -> None:
    record = {"rows": [{"name": "qworker", "tok_s": 900.0}, {"name": "hf", "tok_s": 80.0}]}
    with pytest.raises(cost.CostInputError, match=r"rows\.0\.tok_s=900.*rows\.1\.tok_s=80"):
        cost.tokens_per_second_from_bench(record)
    assert cost.tokens_per_second_from_bench(record, "rows.0.tok_s") == 900.0


def test_bench_reader_rejects_missing_or_non_numeric_field() -> None:
    with pytest.raises(cost.CostInputError, match="not found"):
        cost.tokens_per_second_from_bench({"a": 1}, "b.c")
    with pytest.raises(cost.CostInputError, match="not a number"):
        cost.tokens_per_second_from_bench({"a": "fast"}, "a")
    with pytest.raises(cost.CostInputError, match="no tokens-per-second"):
        cost.tokens_per_second_from_bench({"latency_ms": 3.0})


def test_main_prices_a_bench_result_per_million_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = tmp_path / "bench.txt"
    bench.write_text("table...\n" + json.dumps({"tokens_per_second": 1000.0, "device": "H200"}))
    rc = cost.main(
        ["--bench", str(bench), "--instance", "g5.xlarge", "--capacity", "on-demand",
         "--input-tokens", "500", "--output-tokens", "200"]
    )
    assert rc == 0
    record = _json_line(capsys)
    assert record["source"].endswith("on H200")
    (row,) = record["rows"]
    price = cost.INSTANCE_PRICES["g5.xlarge"].on_demand
    assert row["usd_per_million_output_tokens"] == pytest.approx(price / 3.6)
    assert row["usd_per_1000_jobs"] == pytest.approx(price / 3600 * 0.2 * 1000)
    assert record["managed"]["usd_per_1000_jobs"] > 0


def test_main_custom_price_gives_one_row(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cost.main(["--tokens-per-second", "500", "--price-per-hour", "1.8", "--gpus", "2",
                    "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    (row,) = json.loads(out[0])["rows"]
    assert row["instance"] == "custom"
    assert row["usd_per_million_output_tokens"] == pytest.approx(1.8 / (1000 * 3600) * 1e6)


def test_main_both_capacities_for_every_listed_instance(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cost.main(["--tokens-per-second", "100", "--instance", "g6.xlarge",
                      "--instance", "p5.48xlarge"]) == 0
    rows = _json_line(capsys)["rows"]
    assert [(r["instance"], r["capacity"]) for r in rows] == [
        ("g6.xlarge", "on-demand"), ("g6.xlarge", "spot"),
        ("p5.48xlarge", "on-demand"), ("p5.48xlarge", "spot"),
    ]
    assert rows[1]["usd_per_hour"] < rows[0]["usd_per_hour"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "one of the arguments"),
        (["--tokens-per-second", "1", "--bench", "x.json"], "not allowed with"),
        (["--tokens-per-second", "fast"], "invalid float"),
        (["--tokens-per-second", "100", "--instance", "g9.huge"], "unknown instance type g9.huge"),
        (["--tokens-per-second", "100", "--utilization", "0"], "utilization"),
        (["--tokens-per-second", "-5"], "tokens_per_second must be > 0"),
        (["--tokens-per-second", "100", "--output-tokens", "0"], "output_tokens"),
        (["--bench", "/nonexistent/bench.json"], "cannot read"),
        (["--tokens-per-second", "100", "--compare", "nobody"], "invalid choice"),
    ],
)
def test_main_rejects_bad_arguments_with_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cost.main(argv) == 2
    assert message in capsys.readouterr().err


def test_main_rejects_bench_output_without_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = tmp_path / "bench.txt"
    bench.write_text("only a table\nqworker 12.0 tok/s\n")
    assert cost.main(["--bench", str(bench)]) == 2
    assert "no JSON object line" in capsys.readouterr().err


class _Counter:
    """Serves qworker_generation_tokens_total, growing by ``step`` on every scrape."""

    def __init__(self, step: float, name: str = cost.GENERATION_COUNTER) -> None:
        self.value, self.step, self.name = 0.0, step, name
        self.lock = threading.Lock()

    def body(self) -> bytes:
        with self.lock:
            self.value += self.step
            v = self.value
        family = self.name.removesuffix("_total")
        return (
            f"# HELP {family} Generated tokens\n# TYPE {family} counter\n"
            f'{self.name}{{model="a"}} {v / 2}\n{self.name}{{model="b"}} {v / 2}\n'
        ).encode()


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, _Counter]]:
    counter = _Counter(step=300.0)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = counter.body()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", counter
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_live_metrics_rate_is_counter_increase_over_interval(
    metrics_server: tuple[str, _Counter],
) -> None:
    url, _ = metrics_server
    tps = cost.tokens_per_second_from_metrics(url, 0.2)
    # +300 tokens (summed over both label sets) in a little over 0.2 s.
    assert 100.0 < tps <= 1500.0


def test_main_reads_live_metrics(
    metrics_server: tuple[str, _Counter], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = metrics_server
    rc = cost.main(["--metrics-url", url, "--interval", "0.1", "--price-per-hour", "1", "--json"])
    assert rc == 0
    assert _json_line(capsys)["source"] == url


def test_live_metrics_that_do_not_grow_are_an_error(
    metrics_server: tuple[str, _Counter], capsys: pytest.CaptureFixture[str]
) -> None:
    url, counter = metrics_server
    counter.step = 0.0
    assert cost.main(["--metrics-url", url, "--interval", "0.05"]) == 2
    assert "did not grow" in capsys.readouterr().err


def test_unreachable_metrics_endpoint_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 9 on loopback: nothing listens there in the test environment.
    assert cost.main(["--metrics-url", "http://127.0.0.1:9/metrics", "--interval", "0.05"]) == 2
    assert "cannot read metrics" in capsys.readouterr().err
