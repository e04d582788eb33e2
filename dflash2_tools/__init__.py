"""Tools around the DFlash 2 drafter: embedded target, data, training, benchmarks, CLI.

The drafter itself (config, model, generation) lives in the repository root as
Hugging Face remote code; this package loads it the way a user would
(see :mod:`dflash2_tools.drafter`).
"""
