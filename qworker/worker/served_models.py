"""Which model names a worker answers to: no job is silently served by another model.

A job's ``body.model`` must name what this worker serves (docs/formats.md, "Model
names"): the served name (``engine.model_name``), the ``--model`` argument as given
(``QWORKER_MODEL``), or one of ``QWORKER_MODEL_ALIASES``; any other name is that job's
``model_not_found`` record (a 404). ``QWORKER_ACCEPT_ANY_MODEL`` serves every job. A
job without ``body.model`` is served (the worker serves one model; older batch files
leave it out). ``qworker run`` and ``qworker generate`` share this rule through
``requests.prepare``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qworker.errors import ModelNotFoundError

if TYPE_CHECKING:
    from qworker.config import WorkerSettings


@dataclass(frozen=True, slots=True)
class ServedModels:
    """The names a worker accepts in ``body.model``; ``served_name`` is what results report."""

    served_name: str
    names: frozenset[str]
    accept_any: bool = False

    @classmethod
    def of(cls, served_name: str, given: str | None = None, aliases: str | None = None,
           accept_any: bool = False) -> ServedModels:
        """From the served name, the ``--model`` value as given and the comma-separated aliases."""
        names = {served_name}
        if given:
            names.add(given)
        names.update(a.strip() for a in (aliases or "").split(",") if a.strip())
        return cls(served_name, frozenset(names), accept_any)

    @classmethod
    def from_settings(cls, settings: WorkerSettings, served_name: str) -> ServedModels:
        """What a worker built from ``settings`` answers to, ``served_name`` its engine's."""
        return cls.of(served_name, settings.model, settings.model_aliases,
                      settings.accept_any_model)

    def check(self, model: str | None) -> ModelNotFoundError | None:
        """The ``model_not_found`` error of a job naming ``model``, or None when served."""
        if model is None or self.accept_any or model in self.names:
            return None
        return ModelNotFoundError(
            f"The model `{model}` does not exist or is not served by this worker "
            f"(it serves `{self.served_name}`)."
        )


def check_model_given(settings: WorkerSettings) -> None:
    """Raise ``ValueError`` (one line) when a queue source runs without ``--model``.

    The bundled demo model is the default only for the embedded ``file://`` spool: a
    fleet reading Kafka or SQS must say which model it serves (docs/formats.md).
    """
    if settings.source.startswith("file://") or "model" in settings.model_fields_set:
        return
    scheme = settings.source.partition("://")[0]
    raise ValueError(f"--model (QWORKER_MODEL) is required with a {scheme} source: "
                     "name the model this worker serves")
