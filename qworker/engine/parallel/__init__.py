"""Tensor parallelism: one process per rank over ``torch.distributed`` (docs/operations.md).

Rank 0 is the process the user started; it owns the scheduler, the sampler, the
structured-output matcher and the worker. ``launcher`` spawns the other ranks
(``torch.multiprocessing``, spawn) and talks to them over a pipe each; ``group`` is one
rank's view of the process group (NCCL on CUDA, gloo on CPU, plus a gloo group for
host data); ``runner`` is the model runner every rank runs (logits gathered on rank 0;
rank 0 ships each step to the others); ``wire`` is that step message; ``follower`` is
the other ranks' main loop. The model's split itself is ``qworker.models.tp_plan``.
"""
