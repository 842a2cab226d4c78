"""What the sampler returns: token ids that stay on the device, host values on demand.

``token_ids_device`` (int64 ``[rows]``, on the sampling device) can feed the next step
directly. ``to_host()`` starts the single device-to-host copy of the step (token ids,
plus the chosen and top-k logprobs of the rows that asked, packed into one float64
buffer in pinned memory) without waiting; ``token_ids`` / ``logprobs`` /
``top_logprobs`` wait for it once and return plain Python values (starting the copy
first if nobody did). On CPU there is no copy at all.
"""

from __future__ import annotations

import torch


class SamplerOutput:
    """Chosen token per row; for rows that asked, its raw logprob and the top-k dict.

    ``lp_rows`` lists the rows that asked for logprobs and ``lp_k[j]`` how many top
    alternatives row ``lp_rows[j]`` wants; ``chosen`` ``[len(lp_rows)]`` holds the
    chosen tokens' logprobs and ``top_vals``/``top_ids`` ``[len(lp_rows), max k]`` the
    best alternatives, all on the device.
    """

    __slots__ = (
        "_chosen",
        "_event",
        "_logprobs",
        "_lp_k",
        "_lp_rows",
        "_packed",
        "_tokens",
        "_top_ids",
        "_top_vals",
        "_tops",
        "token_ids_device",
    )

    def __init__(self, token_ids: torch.Tensor, lp_rows: list[int] | None = None,
                 lp_k: list[int] | None = None, chosen: torch.Tensor | None = None,
                 top_vals: torch.Tensor | None = None,
                 top_ids: torch.Tensor | None = None) -> None:
        self.token_ids_device = token_ids
        self._lp_rows = lp_rows or []
        self._lp_k = lp_k or []
        self._chosen = chosen
        self._top_vals = top_vals
        self._top_ids = top_ids
        self._packed: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._tokens: list[int] | None = None
        self._logprobs: list[float | None] | None = None
        self._tops: list[dict[int, float] | None] | None = None

    def __len__(self) -> int:
        return int(self.token_ids_device.shape[0])

    def to_host(self) -> None:
        """Start the one device-to-host copy of this step (no wait); idempotent."""
        if self._packed is not None:
            return
        parts = [self.token_ids_device.to(torch.float64)]
        if self._chosen is not None:
            parts.append(self._chosen.to(torch.float64))
            if self._top_vals is not None and self._top_ids is not None:
                parts += [self._top_vals.reshape(-1).to(torch.float64),
                          self._top_ids.reshape(-1).to(torch.float64)]
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._packed = host
        else:
            self._packed = packed

    def _unpack(self) -> None:
        if self._tokens is not None:
            return
        if self.token_ids_device.device.type != "cuda" and self._chosen is None:
            self._tokens = self.token_ids_device.tolist()  # exact, no float round trip
            rest: list[float] = []
        else:
            self.to_host()
            if self._event is not None:
                self._event.synchronize()
            assert self._packed is not None
            values = self._packed.tolist()
            n = len(self)
            self._tokens = [int(v) for v in values[:n]]
            rest = values[n:]
        num_rows = len(self._tokens)
        self._logprobs = [None] * num_rows
        self._tops = [None] * num_rows
        if self._chosen is None:
            return
        m = len(self._lp_rows)
        chosen, rest = rest[:m], rest[m:]
        width = self._top_vals.shape[1] if self._top_vals is not None else 0
        vals, ids = rest[: m * width], rest[m * width:]
        for j, row in enumerate(self._lp_rows):
            k = self._lp_k[j]
            d = {int(ids[j * width + c]): vals[j * width + c] for c in range(min(k, width))}
            d[self._tokens[row]] = chosen[j]
            self._logprobs[row] = chosen[j]
            self._tops[row] = d

    @property
    def token_ids(self) -> list[int]:
        """The chosen token ids (waits for the host copy once)."""
        self._unpack()
        assert self._tokens is not None
        return self._tokens

    @property
    def logprobs(self) -> list[float | None]:
        """Per row: the chosen token's raw logprob, or None if the row did not ask."""
        self._unpack()
        assert self._logprobs is not None
        return self._logprobs

    @property
    def top_logprobs(self) -> list[dict[int, float] | None]:
        """Per row: {token id: raw logprob} of its top-k plus the chosen one, or None."""
        self._unpack()
        assert self._tops is not None
        return self._tops
