"""A batch's life outside the worker: produce, watch, cancel, collect (docs/formats.md).

- ``files``: read and write ``-i``/``-o`` files, local or ``s3://bucket/key``;
- ``manifest``: what ``qworker produce`` sent (total, input, custom_ids in input order),
  stored at ``<results>/<batch>/_manifest.json``;
- ``store``: a batch's stored objects (S3 or a directory), listed in parallel pages and
  fetched by a thread pool;
- ``lifecycle``: the batch's markers beside the manifest: ``_cancel.json`` (``qworker
  cancel``), ``_failed.json`` (a produce that did not finish), ``_collected.json``
  (where ``collect`` wrote), and the completion window;
- ``status``: the OpenAI ``Batch`` object ``qworker status`` prints;
- ``collect``: ``results.jsonl`` / ``errors.jsonl`` in input order.

Nothing here runs inside the worker; the CLI calls it.
"""
