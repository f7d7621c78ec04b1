"""``python -m muonlab.launcher MODULE:FUNCTION [ARG ...]``: the entry point torchrun runs in every
process it starts (see :func:`muonlab.launcher.worker.worker_main`)."""

from muonlab.launcher.worker import worker_main

if __name__ == "__main__":
    worker_main()
