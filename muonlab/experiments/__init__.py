"""Importable worker entry points for notebooks, the CLI and benchmarks, outside the library's core.

:func:`muonlab.launch` starts functions by module and name, so a worker cannot live in
a notebook cell; these modules hold them. Nothing in muonlab's core imports this package.

* ``steps``: ``distributed_steps``, the one training loop the three workers below run (each rank on
  its batch, the mean loss over ranks a step), its ``StepsRecord``, and ``optimizer_report``: the
  keys their results share about the optimizer (plan, spans, choices);
* ``train``: ``train_worker``, the small GPT (or its MoE variant) with Muon under FSDP2, DDP or
  expert parallelism (notebooks 02, 03, the demo);
* ``any_model``: ``train_model``, a model of your own (an nn.Sequential from a cell, or an importable
  function building one) with a loss and batches, under FSDP2, HSDP or DDP;
* ``checkpoint``: save, reshard and resume a run (notebook 05, benchmarks/bench_checkpoint.py);
* ``faults``: a worker that fails on purpose (notebook 05);
* ``compare``: named configurations x seeds, on one process or launched ranks, with intervals and a
  test of the difference (notebook 07).
"""
