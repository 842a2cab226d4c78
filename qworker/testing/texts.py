"""Deterministic, varied texts for embedding tests and benchmarks (standard library only).

Lengths from a word to a few paragraphs; English prose, numbers and dates, code,
accented and non-Latin scripts, emoji, punctuation runs and odd whitespace, so a
tokenizer and a model see the inputs a real batch holds.
"""

from __future__ import annotations

import random

_PROSE = ("the model embeds every sentence into a vector space where similar meanings lie "
          "close together while unrelated topics drift apart across many dimensions of "
          "learned features batch worker queue result latency throughput river mountain "
          "kitchen recipe garlic onion tomato invoice contract lawyer court appeal football "
          "referee goal weather storm forecast rain satellite orbit telescope galaxy protein "
          "enzyme genome vaccine doctor hospital patient ticket airport delay refund")
_WORDS = tuple(_PROSE.split())
_SNIPPETS = (
    "def f(x):\n    return x ** 2 + 1  # square",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "Café déjà vu: naïve façade, Ångström, Straße, smørrebrød.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم! שלום עולם!",
    "Emoji: 🚀🔥✨ 👍🏽 🇫🇷 — ok?!",
    "Invoice #48213: $1,299.99 due 2026-12-31 (net 30), 7.5% VAT, qty 12 x 3.14159.",
    "https://example.com/path?q=embedding&lang=en#section-2",
    "   leading and trailing   spaces\tand\ttabs\n\nnew lines   ",
    "!!! ??? ... --- *** ((( ))) [[[ ]]] {{{ }}}",
    "UPPER CASE SHOUTING AND MiXeD cAsE wOrDs",
)


def varied_texts(n: int, seed: int = 0, max_words: int = 160) -> list[str]:
    """``n`` texts, the same for the same ``seed``; none empty, at most ~``max_words``
    words plus one snippet (so each stays well under 256 BERT tokens by default)."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        kind = i % 4
        words = rng.choice((1, 3, 8, 20, 40, max_words // 2, max_words))
        words = max(1, min(words, max_words))
        body = " ".join(rng.choice(_WORDS) for _ in range(words))
        if kind == 1:
            body = f"{rng.choice(_SNIPPETS)} {body}"
        elif kind == 2:
            body = f"{body} {rng.randint(0, 10**9)} {rng.random():.6f}"
        elif kind == 3:
            body = rng.choice(_SNIPPETS) + (" " + body if words < 20 else "")
        texts.append(body.capitalize() if rng.random() < 0.5 else body)
    return texts
