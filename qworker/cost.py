"""``qworker cost``: what a measured throughput costs per million tokens and per 1,000 jobs.

Input is the output-token throughput of ONE worker on ONE GPU, from a
benchmark's JSON line (``scripts/bench_*.py``), from a running worker's
``/metrics`` (``qworker_generation_tokens_total`` scraped twice), or given
directly. Prices come from a small table of AWS GPU instances (on-demand and
typical spot, per hour, with the date they were taken) or ``--price-per-hour``.

The computation (also in deploy/README.md, "Reading the cost report")::

    instance_tps      = tokens_per_second * gpus_per_instance * utilization
    $/1M output tok   = usd_per_hour / (instance_tps * 3600) * 1e6
    seconds per job   = output_tokens / instance_tps
                        + input_tokens / (prefill_tps * gpus * utilization)
                          (the second term only with --prefill-tokens-per-second)
    $/1,000 jobs      = usd_per_hour / 3600 * seconds_per_job * 1000
    managed $/1,000   = 1000 * (input_tokens * in_price + output_tokens * out_price) / 1e6

One worker per GPU is assumed (a multi-GPU instance runs one worker per GPU).
The prices are estimates: edit ``INSTANCE_PRICES`` / ``MANAGED_PRICES`` or pass
``--price-per-hour`` with today's figure.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PRICES_TAKEN = "2025-06"
PRICES_NOTE = (
    f"AWS us-east-1 Linux list prices as of {PRICES_TAKEN} (on-demand; spot is a typical observed "
    "price and moves hourly per zone). Estimates: check `aws pricing get-products` / "
    "`aws ec2 describe-spot-price-history` before you plan a budget on them."
)


@dataclass(slots=True, frozen=True)
class InstancePrice:
    """One instance type: its GPUs and USD per hour on-demand and (typical) spot."""

    name: str
    gpu: str
    gpus: int
    on_demand: float
    spot: float


# Editable. p4d/p5 on-demand reflect AWS's mid-2025 price reduction for P4/P5.
INSTANCE_PRICES: dict[str, InstancePrice] = {
    p.name: p
    for p in (
        InstancePrice("g5.xlarge", "A10G 24GB", 1, 1.006, 0.42),
        InstancePrice("g5.2xlarge", "A10G 24GB", 1, 1.212, 0.50),
        InstancePrice("g5.12xlarge", "A10G 24GB", 4, 5.672, 2.40),
        InstancePrice("g5.48xlarge", "A10G 24GB", 8, 16.288, 6.50),
        InstancePrice("g6.xlarge", "L4 24GB", 1, 0.8048, 0.36),
        InstancePrice("g6.2xlarge", "L4 24GB", 1, 0.9776, 0.45),
        InstancePrice("g6.12xlarge", "L4 24GB", 4, 4.6016, 2.00),
        InstancePrice("g6e.xlarge", "L40S 48GB", 1, 1.861, 0.80),
        InstancePrice("p4d.24xlarge", "A100 40GB", 8, 21.96, 9.80),
        InstancePrice("p5.48xlarge", "H100 80GB", 8, 55.04, 24.00),
    )
}


@dataclass(slots=True, frozen=True)
class ManagedPrice:
    """A managed batch API's published price, USD per million input / output tokens."""

    name: str
    input_per_million: float
    output_per_million: float
    source: str


MANAGED_PRICES: dict[str, ManagedPrice] = {
    m.name: m
    for m in (
        ManagedPrice(
            "openai-batch-gpt-4o-mini",
            0.075,
            0.30,
            "OpenAI Batch API (50% of standard), gpt-4o-mini, openai.com/api/pricing, "
            + PRICES_TAKEN,
        ),
        ManagedPrice(
            "openai-batch-gpt-4.1-nano",
            0.05,
            0.20,
            "OpenAI Batch API (50% of standard), gpt-4.1-nano, openai.com/api/pricing, "
            + PRICES_TAKEN,
        ),
    )
}
DEFAULT_MANAGED = "openai-batch-gpt-4o-mini"

# Bench JSON keys for output-token throughput, most specific first.
_PREFERRED_KEYS = (
    "output_tokens_per_second",
    "generation_tokens_per_second",
    "output_tok_per_s",
    "gen_tok_per_s",
    "output_tok_s",
    "gen_tok_s",
    "tokens_per_second",
    "tok_per_s",
    "tok_s",
    "tokens_per_s",
)
_TPS_KEY = re.compile(r"(tok|token)s?_?(per_?s(ec(ond)?)?|_?s|/s)$", re.IGNORECASE)
_NOT_OUTPUT = re.compile(r"prompt|prefill|input", re.IGNORECASE)
GENERATION_COUNTER = "qworker_generation_tokens_total"


class CostInputError(ValueError):
    """A throughput source or price the cost report cannot use; the message says why."""


@dataclass(slots=True)
class CostRow:
    """The cost of one instance type and capacity type at the measured throughput."""

    instance: str
    capacity: str
    gpus: int
    usd_per_hour: float
    instance_tokens_per_second: float
    usd_per_million_output_tokens: float
    seconds_per_job: float
    usd_per_1000_jobs: float


def cost_row(
    instance: str,
    capacity: str,
    gpus: int,
    usd_per_hour: float,
    tokens_per_second: float,
    input_tokens: int,
    output_tokens: int,
    utilization: float = 1.0,
    prefill_tokens_per_second: float | None = None,
) -> CostRow:
    """Price one instance: ``tokens_per_second`` is output tokens/s of one worker on one GPU.

    ``utilization`` (0, 1] is the share of paid time spent generating.
    ``prefill_tokens_per_second`` adds prompt processing time per job; leave it
    None when the throughput was measured on jobs of this shape (it then
    already includes their prefill).
    """
    if tokens_per_second <= 0 or not math.isfinite(tokens_per_second):
        raise CostInputError(f"tokens_per_second must be > 0, got {tokens_per_second}")
    if usd_per_hour < 0:
        raise CostInputError(f"usd_per_hour must be >= 0, got {usd_per_hour}")
    if gpus < 1:
        raise CostInputError(f"gpus must be >= 1, got {gpus}")
    if not 0 < utilization <= 1:
        raise CostInputError(f"utilization must be in (0, 1], got {utilization}")
    if input_tokens < 0 or output_tokens < 1:
        raise CostInputError("input_tokens must be >= 0 and output_tokens >= 1")
    instance_tps = tokens_per_second * gpus * utilization
    seconds_per_job = output_tokens / instance_tps
    if prefill_tokens_per_second is not None:
        if prefill_tokens_per_second <= 0:
            raise CostInputError("prefill_tokens_per_second must be > 0")
        seconds_per_job += input_tokens / (prefill_tokens_per_second * gpus * utilization)
    return CostRow(
        instance=instance,
        capacity=capacity,
        gpus=gpus,
        usd_per_hour=usd_per_hour,
        instance_tokens_per_second=instance_tps,
        usd_per_million_output_tokens=usd_per_hour / (instance_tps * 3600.0) * 1e6,
        seconds_per_job=seconds_per_job,
        usd_per_1000_jobs=usd_per_hour / 3600.0 * seconds_per_job * 1000.0,
    )


def managed_usd_per_1000_jobs(price: ManagedPrice, input_tokens: int, output_tokens: int) -> float:
    """What 1,000 jobs of this size cost on the managed API."""
    return (
        1000.0
        * (input_tokens * price.input_per_million + output_tokens * price.output_per_million)
        / 1e6
    )


def _numeric_leaves(obj: Any, path: str = "") -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _numeric_leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _numeric_leaves(v, f"{path}.{i}" if path else str(i))
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        out.append((path, float(obj)))
    return out


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        else:
            raise CostInputError(f"bench field {path!r} not found (at {part!r})")
    return obj


def last_json_object(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object (bench scripts print a table first)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    raise CostInputError("no JSON object line found in the benchmark output")


def tokens_per_second_from_bench(record: dict[str, Any], field: str | None = None) -> float:
    """Output tokens/s from a bench JSON record: ``field`` (dotted path) or the one obvious key.

    Without ``field``: a top-level key from the known names, else the single
    numeric leaf whose key looks like tokens-per-second and is not about
    prompt/prefill/input. Several candidates raise CostInputError listing them.
    """
    if field:
        value = _get_path(record, field)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CostInputError(f"bench field {field!r} is not a number: {value!r}")
        return float(value)
    for key in _PREFERRED_KEYS:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    candidates = [
        (p, v)
        for p, v in _numeric_leaves(record)
        if _TPS_KEY.search(p.rsplit(".", 1)[-1]) and not _NOT_OUTPUT.search(p)
    ]
    if len(candidates) == 1:
        return candidates[0][1]
    if not candidates:
        raise CostInputError(
            "no tokens-per-second field in the benchmark JSON; name it with --bench-field"
        )
    listed = ", ".join(f"{p}={v:g}" for p, v in candidates[:12])
    raise CostInputError(f"several throughput fields, choose one with --bench-field: {listed}")


def scrape_counter(url: str, name: str = GENERATION_COUNTER, timeout: float = 5.0) -> float:
    """Sum of every sample of counter ``name`` on a Prometheus text endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode("utf-8")
    except OSError as exc:
        raise CostInputError(f"cannot read metrics from {url}: {exc}") from exc
    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
                seen = True
    if not seen:
        raise CostInputError(f"{url} has no {name} metric")
    return total


def tokens_per_second_from_metrics(url: str, interval: float) -> float:
    """Output tokens/s of a live worker: the generation counter's increase over ``interval`` s."""
    if interval <= 0:
        raise CostInputError("--interval must be > 0")
    first, t0 = scrape_counter(url), time.monotonic()
    time.sleep(interval)
    second, t1 = scrape_counter(url), time.monotonic()
    if second <= first:
        raise CostInputError(
            f"{GENERATION_COUNTER} did not grow in {interval:g}s: is the worker busy?"
        )
    return (second - first) / (t1 - t0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qworker cost",
        description="Dollars per million output tokens and per 1,000 jobs "
        "from a measured throughput.",
        epilog=PRICES_NOTE,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--tokens-per-second", type=float, help="output tokens/s of one worker on one GPU"
    )
    src.add_argument("--bench", metavar="FILE", help="bench output with a JSON line ('-' = stdin)")
    src.add_argument("--metrics-url", metavar="URL", help="a worker's /metrics, scraped twice")
    p.add_argument(
        "--bench-field", metavar="PATH", help="dotted path of the throughput in the bench JSON"
    )
    p.add_argument(
        "--interval", type=float, default=30.0, help="seconds between metric scrapes (30)"
    )
    p.add_argument(
        "--instance",
        action="append",
        metavar="TYPE",
        help=f"instance type(s) to price (default: all of {', '.join(INSTANCE_PRICES)})",
    )
    p.add_argument("--capacity", choices=("spot", "on-demand", "both"), default="both")
    p.add_argument(
        "--price-per-hour", type=float, help="price one custom instance at this USD/hour"
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the --price-per-hour instance (1)")
    p.add_argument("--input-tokens", type=int, default=800, help="prompt tokens per job (800)")
    p.add_argument("--output-tokens", type=int, default=150, help="generated tokens per job (150)")
    p.add_argument(
        "--prefill-tokens-per-second",
        type=float,
        help="add prompt time per job at this rate (omit when the bench used jobs of this shape)",
    )
    p.add_argument(
        "--utilization",
        type=float,
        default=1.0,
        help="share of paid GPU time spent generating, (0, 1] (1.0)",
    )
    p.add_argument(
        "--compare",
        choices=sorted(MANAGED_PRICES),
        default=DEFAULT_MANAGED,
        help=f"managed batch API to compare with ({DEFAULT_MANAGED})",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    return p


def _throughput(args: argparse.Namespace) -> tuple[float, str]:
    if args.tokens_per_second is not None:
        return args.tokens_per_second, "--tokens-per-second"
    if args.bench is not None:
        try:
            text = sys.stdin.read() if args.bench == "-" else Path(args.bench).read_text()
        except OSError as exc:
            raise CostInputError(f"cannot read {args.bench}: {exc}") from exc
        record = last_json_object(text)
        tps = tokens_per_second_from_bench(record, args.bench_field)
        device = record.get("device") or record.get("gpu")
        return tps, f"bench {args.bench}" + (f" on {device}" if device else "")
    return tokens_per_second_from_metrics(args.metrics_url, args.interval), args.metrics_url


def build_rows(args: argparse.Namespace, tps: float) -> list[CostRow]:
    """Every (instance, capacity) row the arguments ask for."""
    common = dict(
        tokens_per_second=tps,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        utilization=args.utilization,
        prefill_tokens_per_second=args.prefill_tokens_per_second,
    )
    if args.price_per_hour is not None:
        return [cost_row("custom", "given", args.gpus, args.price_per_hour, **common)]
    names = args.instance or list(INSTANCE_PRICES)
    unknown = [n for n in names if n not in INSTANCE_PRICES]
    if unknown:
        raise CostInputError(
            f"unknown instance type {', '.join(unknown)}; known: {', '.join(INSTANCE_PRICES)} "
            "(or use --price-per-hour)"
        )
    capacities = ("on-demand", "spot") if args.capacity == "both" else (args.capacity,)
    rows = []
    for name in names:
        inst = INSTANCE_PRICES[name]
        for cap in capacities:
            price = inst.on_demand if cap == "on-demand" else inst.spot
            rows.append(cost_row(name, cap, inst.gpus, price, **common))
    return rows


def render_table(rows: list[CostRow], managed: ManagedPrice, managed_per_1000: float) -> str:
    """The human table: one line per row, then the managed API line."""
    head = (
        f"{'instance':<14} {'capacity':<9} {'gpus':>4} {'$/h':>8} {'tok/s':>9} "
        f"{'$/1M out':>9} {'$/1k jobs':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.instance:<14} {r.capacity:<9} {r.gpus:>4} {r.usd_per_hour:>8.3f} "
            f"{r.instance_tokens_per_second:>9.1f} {r.usd_per_million_output_tokens:>9.4f} "
            f"{r.usd_per_1000_jobs:>10.4f}"
        )
    lines.append(
        f"{managed.name:<29} {'':>8} {'':>9} {managed.output_per_million:>9.4f} "
        f"{managed_per_1000:>10.4f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``qworker cost``; returns the exit code (2 for unusable input)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage / help
        return int(exc.code or 0)
    try:
        tps, source = _throughput(args)
        rows = build_rows(args, tps)
    except CostInputError as exc:
        print(f"qworker cost: error: {exc}", file=sys.stderr)
        return 2
    managed = MANAGED_PRICES[args.compare]
    managed_1000 = managed_usd_per_1000_jobs(managed, args.input_tokens, args.output_tokens)
    record = {
        "tokens_per_second": tps,
        "source": source,
        "input_tokens": args.input_tokens,
        "output_tokens": args.output_tokens,
        "utilization": args.utilization,
        "prices_taken": PRICES_TAKEN,
        "rows": [asdict(r) for r in rows],
        "managed": {**asdict(managed), "usd_per_1000_jobs": managed_1000},
    }
    if not args.json:
        print(
            f"throughput: {tps:.1f} output tok/s per GPU ({source}); jobs of "
            f"{args.input_tokens} in + {args.output_tokens} out tokens; "
            f"utilization {args.utilization:g}"
        )
        print(render_table(rows, managed, managed_1000))
        print(f"managed: {managed.source}")
        print(f"note: {PRICES_NOTE}")
        if args.price_per_hour is None:
            print(
                "note: every row assumes the measured per-GPU throughput; "
                "measure on the GPU you price."
            )
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
